"""What distrain writes in a checkpoint directory, told apart from what it did not (run in the launching process,
by the job holding the directory's lock, before any rank starts).

A save is written into ``step_NNNNNNNN.tmp`` and renamed ``step_NNNNNNNN`` when complete; either holds only the
names a save writes: the per-rank RNG files, DCP's ``.metadata`` and ``*.distcp`` shards (and the metadata's
``.tmp`` name before DCP renames it), DeepSpeed's tag directory and the ``zero_to_*.py`` scripts it copies beside
it (``parallelism=zero``), ``config.yaml`` and ``manifest.json``.
An entry of either name without distrain's manifest that holds anything else is not distrain's: a save of that
step, or the removal of interrupted saves, would replace it, so the job is refused.
A save of distrain's that lost its manifest (damaged, or a prune interrupted) is still distrain's: resuming skips it.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from distrain.checkpoint.steps import step_directories

log = logging.getLogger("distrain.train")
SAVE_NAMES = {"manifest.json", "config.yaml", "deepspeed"}  # deepspeed: parallelism=zero's tag
# The per-rank RNG files; DCP's metadata, global or rank-local, also under the .tmp name DCP writes it as before its
# rename (a kill in between leaves that); the conversion scripts DeepSpeed copies beside its tag.
_SAVE_FILE = re.compile(r"rng_rank\d+\.pt|(__\d+)?\.metadata(\.tmp)?|zero_to_\w+\.py")


def written_by_distrain(path: Path) -> bool:
    """Whether ``path`` is a directory with distrain's manifest, or holding only names a save writes (an empty one
    included)."""
    try:
        if path.is_dir() and (path / "manifest.json").is_file():  # written last by distrain, before the rename
            return True
        return path.is_dir() and all(_save_name(entry.name) for entry in path.iterdir())
    except OSError:  # removed while being read: nothing of the user's was there to keep
        return True


def _save_name(name: str) -> bool:
    return name in SAVE_NAMES or name.endswith(".distcp") or _SAVE_FILE.fullmatch(name) is not None


def foreign_entries(directory: Path) -> list[Path]:
    """The ``step_NNNNNNNN`` and ``step_NNNNNNNN.tmp`` entries of ``directory`` that distrain did not write."""
    if not directory.is_dir():
        return []
    saves = [*step_directories(directory), *directory.glob("step_*.tmp")]
    return sorted(path for path in saves if not written_by_distrain(path))


def remove_partial_saves(directory: Path) -> None:
    """Delete the ``step_*.tmp`` directories that saves a crash or a full disk interrupted (never one distrain did
    not write). Only while holding the directory's lock (no other job can be writing one)."""
    for partial in directory.glob("step_*.tmp") if directory.is_dir() else ():
        if written_by_distrain(partial):
            log.warning("removing %s: an interrupted save", partial)
            shutil.rmtree(partial, ignore_errors=True)
