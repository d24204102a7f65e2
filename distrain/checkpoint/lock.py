"""One job per checkpoint directory: a lock file naming its holder, refreshed while the job runs.

``<checkpoint dir>/.lock`` holds the holder's host, pid, run directory and SLURM job id as JSON. It is created
atomically (``O_CREAT | O_EXCL``) by the launching process before any rank starts, and its modification time is
refreshed every ``HEARTBEAT_S`` by a background thread. A second job pointed at the same directory is refused.
A lock whose holder is gone is taken over with a warning, so restarts and requeues go on working:
- same host and the holder's pid no longer runs (a killed launcher);
- the same SLURM job (a requeued job that restarts on another node);
- not refreshed for ``STALE_AFTER_S`` (a holder on another host that died).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from distrain.errors import RunError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0


class CheckpointDirInUse(RunError):
    """Another live job holds the checkpoint directory."""


def _holder() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run_dir": os.getcwd(),
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
        mine = _holder() | {"run_dir": self.run_dir}
        while not self._create(mine):
            try:
                holder = json.loads(self.path.read_text())
                stale = _why_stale(self.path, holder)
            except (OSError, ValueError):  # removed meanwhile, or half written: look again
                holder, stale = {}, "unreadable"
            if stale is None:
                raise CheckpointDirInUse(
                    f"checkpoint.dir={self.path.parent} is in use by another job (host {holder.get('host')}, "
                    f"pid {holder.get('pid')}, run directory {holder.get('run_dir')}, since {holder.get('since')}); "
                    "give this job another checkpoint.dir, or stop that one"
                )
            log.warning("taking over the lock of %s: %s", self.path.parent, stale)
            self.path.unlink(missing_ok=True)
        self._heartbeat = threading.Thread(target=self._refresh, name="checkpoint-dir-lock", daemon=True)
        self._heartbeat.start()
        return self

    def _create(self, holder: dict[str, Any]) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as file:
            json.dump(holder, file)
        return True

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
