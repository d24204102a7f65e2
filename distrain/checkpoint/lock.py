"""One job per checkpoint directory: a lock file naming its holder, refreshed while the job runs.

``<checkpoint dir>/.lock`` holds the holder's host, pid, run directory and SLURM job id as JSON. It is created
atomically (``O_CREAT | O_EXCL``) by the launching process before any rank starts, and its modification time is
refreshed every ``HEARTBEAT_S`` by a background thread. A second job pointed at the same directory is refused.
A lock whose holder is gone is taken over with a warning, so restarts and requeues go on working:
- same host and the holder's pid no longer runs (a killed launcher);
- the same SLURM job (a requeued job that restarts on another node);
- not refreshed for ``STALE_AFTER_S`` (a holder on another host that died).
The lock is created whole (a hard link of a finished file) and taken over by an atomic rename, so of several
jobs starting at once exactly one holds it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from distrain.errors import RunError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 300.0  # generous: network file systems cache modification times


class CheckpointDirInUse(RunError):
    """Another live job holds the checkpoint directory."""


def _holder(run_dir: str) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run_dir": run_dir,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _why_stale(path: Path, holder: dict[str, Any]) -> str | None:
    """Why the lock at ``path`` no longer protects anything (its holder is gone), or None if it is live."""
    if holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1))):
        return f"process {holder.get('pid')} on {holder.get('host')} no longer runs"
    if holder.get("slurm_job_id") and holder["slurm_job_id"] == os.environ.get("SLURM_JOB_ID"):
        return f"it belongs to an earlier run of this SLURM job {holder['slurm_job_id']} (requeued)"
    age = time.time() - path.stat().st_mtime
    if age > STALE_AFTER_S:
        return f"it was last refreshed {age:.0f} s ago (a live holder refreshes it every {HEARTBEAT_S:.0f} s)"
    return None


class CheckpointDirLock:
    """Hold ``<directory>/.lock`` for the life of a job (a context manager).

    Args:
        directory: the checkpoint directory (created if missing).
        run_dir: this job's run directory, recorded for whoever is refused.
    """

    def __init__(self, directory: Path, run_dir: str) -> None:
        self.path = directory / LOCK_NAME
        self.run_dir = run_dir
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def __enter__(self) -> CheckpointDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = json.dumps(_holder(self.run_dir))
        while not self._create(mine):
            try:
                seen = self.path.read_text()
                holder = json.loads(seen)
            except FileNotFoundError:  # released meanwhile: try again
                continue
            except (OSError, ValueError):  # created whole (see _create), so only a damaged file reads badly
                seen, holder = None, {}
            stale = "its content is unreadable" if seen is None else _why_stale(self.path, holder)
            if stale is None:
                raise CheckpointDirInUse(
                    f"checkpoint.dir={self.path.parent} is in use by another job (host {holder.get('host')}, "
                    f"pid {holder.get('pid')}, run directory {holder.get('run_dir')}, since {holder.get('since')}); "
                    "give this job another checkpoint.dir, or stop that one"
                )
            if self._remove_if_unchanged(seen):
                log.warning("taking over the lock of %s: %s", self.path.parent, stale)
        self._heartbeat = threading.Thread(target=self._refresh, name="checkpoint-dir-lock", daemon=True)
        self._heartbeat.start()
        return self

    def _create(self, content: str) -> bool:
        """Create the lock with its content in one step (a hard link of a finished file): a reader never sees it
        half written. False if another holder's lock is there."""
        draft = self.path.with_name(f"{LOCK_NAME}.{uuid.uuid4().hex}")
        draft.write_text(content)
        try:
            os.link(draft, self.path)
        except FileExistsError:
            return False
        finally:
            draft.unlink()
        return True

    def _remove_if_unchanged(self, seen: str | None) -> bool:
        """Move the stale lock aside (one atomic rename: of several jobs taking over, one wins) and drop it, unless
        it is no longer the lock judged stale (then put it back: a new holder took it meanwhile)."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            if seen is not None and aside.read_text() != seen:
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
                return False
            return True
        finally:
            aside.unlink()

    def _refresh(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass
