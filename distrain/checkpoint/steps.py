"""Checkpoint step directories as files on disk: their names, whether one is complete and unaltered (its manifest's
sizes and SHA-256s), the step and world size it records. Read without ``torch.distributed.checkpoint``, so the
launching process checks checkpoints before any rank starts without importing what saving needs."""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

from distrain.data.token_format import sha256_of

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a usable checkpoint (missing manifest, missing, truncated or altered file), or None."""
    if not path.is_dir():
        return "no such directory"
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        return "no manifest.json (incomplete)"
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as err:
        return f"unreadable manifest ({err})"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if _hashed(str(file), file.stat().st_mtime_ns, file.stat().st_size) != expected["sha256"]:
            return f"{name} does not match its checksum"
    from distrain.checkpoint.data_only import unsafe_content  # imports torch.distributed.checkpoint: only here

    return unsafe_content(path)


@functools.lru_cache(maxsize=4096)
def _hashed(path: str, mtime_ns: int, size: int) -> str:
    """A file's SHA-256, once per version of it (``mtime_ns``, ``size``): a tool checks a checkpoint, then reads
    it through a function that checks it again, and large checkpoints take seconds to hash."""
    del mtime_ns, size  # part of the cache key only
    return sha256_of(Path(path))


def checkpoint_world_size(path: Path) -> int | None:
    """The number of ranks that wrote the checkpoint at ``path`` (None if its manifest does not say)."""
    try:
        return json.loads((path / "manifest.json").read_text()).get("world_size")
    except (OSError, ValueError):
        return None


def step_directories(directory: Path) -> list[Path]:
    """Every ``step_*`` directory in ``directory`` (not the ``.tmp`` of a save in progress), oldest first."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _STEP_DIR.match(p.name)), key=lambda p: p.name)


def newest_valid(directory: Path, *, report: bool = True) -> Path | None:
    """The newest checkpoint in ``directory`` whose files match its manifest; corrupt ones (a file altered,
    truncated or missing, the manifest missing, a pickle that is not data) are skipped, loudly if ``report``."""
    for path in reversed(step_directories(directory)):
        problem = checkpoint_problem(path)
        if not problem:
            if report:
                log.info("resuming from %s", path)
            return path
        if report:
            log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def checkpoint_step(path: Path) -> int:
    """The optimizer step a complete checkpoint holds (from its manifest)."""
    return int(json.loads((path / "manifest.json").read_text())["step"])


def uses_checkpoint_dir(checkpoint: Any) -> bool:
    """Whether a job with these ``checkpoint.*`` settings reads or writes its checkpoint directory."""
    return checkpoint.every_n_steps > 0 or checkpoint.save_final or checkpoint.emergency or checkpoint.resume == "auto"
