"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, ``<dir>/step_00000100/``:
    strategy files                written by the strategy: DCP's ``*.distcp`` + ``.metadata`` (each rank writes
                                  its shards, replicated tensors once), or DeepSpeed's own sharded format;
    ``rng_rank<r>.pt``            each rank's RNG states (they differ between ranks, so they are not in DCP);
    ``config.yaml``               the run's resolved config;
    ``manifest.json``             written last: every file with its size and SHA-256.
Everything is written into ``step_00000100.tmp`` and renamed when all ranks are done, so a crash mid-save never
leaves a directory that looks complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import random
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from distrain.checkpoint.steps import (
    checkpoint_problem,
    newest_valid,
    step_directories,
)
from distrain.data.token_format import sha256_of
from distrain.errors import CheckpointSpaceError
from distrain.trainer.faults import maybe_inject_fault

log = logging.getLogger(__name__)

NEARLY_FULL_BYTES = 1 << 20  # free space below which a failed write is taken to have filled the file system


def checkpoint_bytes(path: Path) -> int:
    """Bytes of every file in the checkpoint directory ``path`` (files removed meanwhile count 0)."""
    total = 0
    for file in path.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            total += file.stat().st_size if file.is_file() else 0
    return total


def out_of_space(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it, or a rank's failure inside DCP's ``CheckpointException``) is a full disk."""
    seen: list[BaseException] = [err]
    while seen:
        current = seen.pop()
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        seen += [e for e in (current.__cause__, current.__context__) if e is not None]
        for failure in getattr(current, "failures", {}).values():  # DCP keeps (exception, traceback) per rank
            seen += [e for e in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(e, BaseException)]
    return "No space left on device" in str(err)


def rng_snapshot() -> dict[str, Any]:
    """This process's random number generators as their own objects, not converted for a file: taken before every
    step (what a failed step rolls back to), so half of ``rng_state``'s cost each step matters."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_state() -> dict[str, Any]:
    """This process's random number generators as tensors and plain values (saved with ``torch.save``, read back
    with ``weights_only=True``: no pickled objects)."""
    state = rng_snapshot()
    version, mt_words, gauss = state["python"]
    bit_generator, words, position, has_gauss, cached_gaussian = state["numpy"]
    state["python"] = {"version": version, "words": torch.tensor(mt_words, dtype=torch.int64), "gauss": gauss}
    state["numpy"] = {
        "bit_generator": bit_generator,
        "words": torch.from_numpy(words.astype(np.int64)),
        "position": int(position),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` saved or ``rng_snapshot`` took (the tuples checkpoints written before held)."""
    python, numpy = state["python"], state["numpy"]
    if isinstance(python, dict):
        python = (python["version"], tuple(python["words"].tolist()), python["gauss"])
    if isinstance(numpy, dict):
        numpy = (
            numpy["bit_generator"],
            numpy["words"].numpy().astype(np.uint32),
            numpy["position"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class _PendingSave:
    """An asynchronous save whose files are still being written by DCP's background thread."""

    step: int
    tmp_path: Path
    final_path: Path
    writing: Future


class Checkpointer:
    """Saves every ``every_n_steps`` optimizer steps into ``dir`` and keeps the newest ``keep_last``.

    Args:
        run_dir: the run directory; checkpoints go to ``<run_dir>/checkpoints`` unless ``dir`` is set.
        every_n_steps: period in optimizer steps; 0 disables periodic saves.
        keep_last: complete checkpoints to keep; 0 keeps all.
        dir: checkpoint directory, stable across restarts of the same run.
        save_final: also save after the last step.
        resume: ``never``, ``auto`` (the newest complete checkpoint in ``dir``, if any) or a checkpoint path.
        async_save: periodic saves copy the state to CPU memory and write it in a background thread (DCP's
            ``async_save``) while training goes on; the checkpoint becomes visible at the first step boundary
            where every rank has finished writing. Final, stop and emergency saves are always synchronous.
        emergency: after an exception, save if all ranks agree their state is consistent.
        emergency_timeout_s: how long a failed rank waits for its peers to agree.
        config: the run's resolved config, stored in each checkpoint as ``config.yaml``.
    """

    def __init__(
        self,
        *,
        run_dir: str,
        every_n_steps: int,
        keep_last: int,
        dir: str | None,
        save_final: bool,
        resume: str,
        async_save: bool = False,
        emergency: bool = True,
        emergency_timeout_s: float = 30.0,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.dir = Path(dir) if dir else Path(run_dir) / "checkpoints"
        self.config = config
        self.every_n_steps, self.keep_last, self.save_final = every_n_steps, keep_last, save_final
        self.resume, self.async_save = resume, async_save
        self.emergency, self.emergency_timeout_s = emergency, emergency_timeout_s
        self.last_saved_step: int | None = None
        self._pending: _PendingSave | None = None
        # DCP's background writer runs its collectives on its own group, never interleaved with training's.
        self._writer_group = dist.new_group(backend="gloo") if async_save else None

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
        return newest_valid(self.dir)

    def due(self, step: int, *, final: bool) -> bool:
        periodic = self.every_n_steps > 0 and step % self.every_n_steps == 0
        return periodic or (final and self.save_final)

    def save(self, step: int, strategy: Any, extra: dict[str, Any], *, blocking: bool = True) -> Path:
        """Write a checkpoint of ``strategy`` plus loop state ``extra`` for ``step``.

        Collective: every rank must call it (the strategy's writer plans globally). With ``async_save`` and
        ``blocking=False`` it returns once the state is staged in CPU memory; ``finalize`` makes it visible.
        """
        from torch.distributed.checkpoint.api import CheckpointException  # DCP's import: at the first save

        self.wait_and_finalize()
        final_path = self.dir / f"step_{step:08d}"
        tmp_path = self.dir / f"step_{step:08d}.tmp"
        rank = dist.get_rank()
        self._check_free_space()
        if rank == 0:
            shutil.rmtree(tmp_path, ignore_errors=True)
            tmp_path.mkdir(parents=True)
        dist.barrier()
        try:
            torch.save(rng_state(), tmp_path / f"rng_rank{rank}.pt")
            if self.async_save and not blocking:
                writing = strategy.save_checkpoint_async(tmp_path, extra, self._writer_group)
                self._pending = _PendingSave(step, tmp_path, final_path, writing)
                return final_path
            strategy.save_checkpoint(tmp_path, extra)
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            failure = self._write_failed(err, tmp_path)
            if failure is None:
                raise
            raise failure from err
        maybe_inject_fault(rank, step, point="save")
        dist.barrier()
        self._publish(step, tmp_path, final_path)
        return final_path

    def _write_failed(self, err: BaseException, tmp_path: Path) -> Exception | None:
        """What to raise for a save that failed while writing ``tmp_path``: ``CheckpointSpaceError`` (after rank 0
        removed the partial save) when the file system is full; for DCP's ``CheckpointException`` (a
        ``BaseException`` the training loop would not catch) a ``RuntimeError`` carrying every rank's error; None
        to re-raise ``err`` as it is."""
        free = shutil.disk_usage(self.dir).free
        # torch.save's zip writer reports a short write as "unexpected pos", not ENOSPC: a nearly empty file
        # system right after a failed write says the same.
        if out_of_space(err) or free < NEARLY_FULL_BYTES:
            written = checkpoint_bytes(tmp_path)
            if dist.get_rank() == 0:  # once, after measuring (its message is the one reported first)
                shutil.rmtree(tmp_path, ignore_errors=True)
            return CheckpointSpaceError(str(self.dir), f"more than {written:,}", free, during_write=True)
        if isinstance(err, Exception):
            return None
        return RuntimeError(f"saving checkpoint {tmp_path} failed: {getattr(err, 'failures', err)!r}")

    def _check_free_space(self) -> None:
        """Refuse a save that cannot fit, before writing anything: the size is the newest complete checkpoint's
        (a save of the same run writes as much again); unknown before the first one. Rank 0 reads the file
        system and broadcasts what it found (one object broadcast), so every rank decides the same."""
        found: list[tuple[int, int] | None] = [None]
        if dist.get_rank() == 0:
            newest = self.complete_checkpoints()[-1:]
            if newest:
                needed = checkpoint_bytes(newest[0])
                self.dir.mkdir(parents=True, exist_ok=True)
                found[0] = (needed, shutil.disk_usage(self.dir).free)
        dist.broadcast_object_list(found, src=0)
        if found[0] is not None and found[0][0] > found[0][1]:
            needed, free = found[0]
            raise CheckpointSpaceError(str(self.dir), f"{needed:,}", free, during_write=False)

    def async_save_written(self) -> bool:
        """Whether this rank's part of the pending asynchronous save is on disk (True when none is pending)."""
        return self._pending is None or self._pending.writing.done()

    def wait_and_finalize(self) -> None:
        """Wait for the pending asynchronous save on this rank, then publish it. Collective (barriers)."""
        if self._pending is None:
            return
        from torch.distributed.checkpoint.api import CheckpointException

        pending, self._pending = self._pending, None
        try:
            pending.writing.result()  # re-raises a failed write: the checkpoint stays a .tmp and is never used
        except (Exception, CheckpointException) as err:
            failure = self._write_failed(err, pending.tmp_path)
            if failure is None:
                raise
            raise failure from err
        maybe_inject_fault(dist.get_rank(), pending.step, point="save")
        dist.barrier()
        self._publish(pending.step, pending.tmp_path, pending.final_path)

    def _publish(self, step: int, tmp_path: Path, final_path: Path) -> None:
        """Rank 0 writes the manifest last and renames ``.tmp`` into place; then everyone may go on."""
        if dist.get_rank() == 0:
            try:
                if self.config is not None:
                    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(self.config))
                files = {
                    str(p.relative_to(tmp_path)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
                    for p in sorted(tmp_path.rglob("*"))
                    if p.is_file()
                }
                manifest = {"step": step, "world_size": dist.get_world_size(), "files": files}
                (tmp_path / "manifest.json").write_text(json.dumps(manifest, indent=1))
            except OSError as err:
                failure = self._write_failed(err, tmp_path)
                if failure is None:
                    raise
                raise failure from err
            shutil.rmtree(final_path, ignore_errors=True)
            tmp_path.rename(final_path)
            self._prune()
            log.info("saved checkpoint %s", final_path)
        self.last_saved_step = step
        dist.barrier()

    def complete_checkpoints(self) -> list[Path]:
        """Checkpoint directories with a manifest, oldest first."""
        return [p for p in step_directories(self.dir) if (p / "manifest.json").is_file()]

    def _prune(self) -> None:
        if self.keep_last > 0:
            for old in self.complete_checkpoints()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def load(path: Path, strategy: Any, extra: dict[str, Any]) -> dict[str, Any]:
        """Restore ``strategy`` and this rank's RNG from ``path``; return the loop state (``extra`` filled).

        Collective: every rank must call it.
        """
        from distrain.checkpoint.data_only import load_tensors_and_values  # imports DCP: only when resuming

        loaded = strategy.load_checkpoint(path, extra)
        rng_file = path / f"rng_rank{dist.get_rank()}.pt"
        if rng_file.is_file():
            set_rng_state(load_tensors_and_values(rng_file))
        return loaded
