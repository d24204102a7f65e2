"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, ``<dir>/step_00000100/``:
    strategy files                written by the strategy: DCP's ``*.distcp`` + ``.metadata`` (each rank writes
                                  its shards, replicated tensors once), or DeepSpeed's own sharded format;
    ``rng_rank<r>.pt``            each rank's RNG states (they differ between ranks, so they are not in DCP);
    ``manifest.json``             written last: every file with its size and SHA-256.
Everything is written into ``step_00000100.tmp`` and renamed when all ranks are done, so a crash mid-save never
leaves a directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a usable checkpoint (missing manifest, missing, truncated or altered file), or None."""
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
        if _sha256(file) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves every ``every_n_steps`` optimizer steps into ``dir`` and keeps the newest ``keep_last``.

    Args:
        run_dir: the run directory; checkpoints go to ``<run_dir>/checkpoints`` unless ``dir`` is set.
        every_n_steps: period in optimizer steps; 0 disables periodic saves.
        keep_last: complete checkpoints to keep; 0 keeps all.
        dir: checkpoint directory, stable across restarts of the same run.
        save_final: also save after the last step.
        resume: ``never``, ``auto`` (the newest complete checkpoint in ``dir``, if any) or a checkpoint path.
    """

    def __init__(
        self, *, run_dir: str, every_n_steps: int, keep_last: int, dir: str | None, save_final: bool, resume: str
    ) -> None:
        self.dir = Path(dir) if dir else Path(run_dir) / "checkpoints"
        self.every_n_steps, self.keep_last, self.save_final = every_n_steps, keep_last, save_final
        self.resume = resume

    def resume_path(self) -> Path | None:
        """The checkpoint to start from, or None for a fresh start."""
        if self.resume == "never":
            return None
        if self.resume == "auto":
            return self.newest_valid()
        path = Path(self.resume)
        problem = checkpoint_problem(path)
        if problem:
            raise FileNotFoundError(f"checkpoint.resume={self.resume}: {problem}")
        return path

    def newest_valid(self) -> Path | None:
        """The newest checkpoint in ``dir`` whose files match its manifest; corrupt ones are skipped, loudly."""
        for path in reversed(self.complete_checkpoints()):
            problem = checkpoint_problem(path)
            if not problem:
                log.info("resuming from %s", path)
                return path
            log.warning("skipping checkpoint %s: %s", path, problem)
        return None

    def due(self, step: int, *, final: bool) -> bool:
        periodic = self.every_n_steps > 0 and step % self.every_n_steps == 0
        return periodic or (final and self.save_final)

    def save(self, step: int, strategy: Any, extra: dict[str, Any]) -> Path:
        """Write a checkpoint of ``strategy`` plus loop state ``extra`` for ``step``.

        Collective: every rank must call it (the strategy's writer plans globally).
        """
        final_path = self.dir / f"step_{step:08d}"
        tmp_path = self.dir / f"step_{step:08d}.tmp"
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(tmp_path, ignore_errors=True)
            tmp_path.mkdir(parents=True)
        dist.barrier()
        strategy.save_checkpoint(tmp_path, extra)
        torch.save(rng_state(), tmp_path / f"rng_rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            files = {
                str(p.relative_to(tmp_path)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(tmp_path.rglob("*"))
                if p.is_file()
            }
            (tmp_path / "manifest.json").write_text(json.dumps({"step": step, "files": files}, indent=1))
            shutil.rmtree(final_path, ignore_errors=True)
            tmp_path.rename(final_path)
            self._prune()
            log.info("saved checkpoint %s", final_path)
        dist.barrier()
        return final_path

    def complete_checkpoints(self) -> list[Path]:
        """Checkpoint directories with a manifest, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if _STEP_DIR.match(p.name) and (p / "manifest.json").is_file()]
        return sorted(found, key=lambda p: p.name)

    def _prune(self) -> None:
        if self.keep_last > 0:
            for old in self.complete_checkpoints()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def load(path: Path, strategy: Any, extra: dict[str, Any]) -> dict[str, Any]:
        """Restore ``strategy`` and this rank's RNG from ``path``; return the loop state (``extra`` filled).

        Collective: every rank must call it.
        """
        loaded = strategy.load_checkpoint(path, extra)
        rng_file = path / f"rng_rank{dist.get_rank()}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        return loaded
