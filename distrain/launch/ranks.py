"""Starting ranks: reuse an outer launcher (torchrun, SLURM) or start them here with PyTorch's elastic agent.

A run is one Hydra job with one output directory. The parent process composes the config, creates the run
directory and hands both to ``nproc_per_node`` worker processes started by ``torch.distributed.launcher`` (the
machinery behind torchrun), so Hydra never runs once per rank.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from distrain.launch.fork_server import restore_stop_signals, start_fork_server

__all__ = [
    "ChildFailedError",
    "adopt_slurm_tasks",
    "in_slurm_job",
    "requeue_slurm_job",
    "slurm_restart_count",
    "slurm_step",
    "default_nproc_per_node",
    "inside_launcher",
    "launcher_rank",
    "restarted_attempt",
    "resume_setting",
    "run_ranks",
]


def inside_launcher() -> bool:
    """True when an outer launcher (torchrun, or a SLURM task started by submitit) already made this process a rank."""
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= os.environ.keys()


def launcher_rank() -> int:
    """This process's rank under an outer launcher; a SLURM task that starts ranks itself (replica groups, one task
    per node) counts by its task index."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def slurm_step() -> tuple[int, int]:
    """(tasks, nodes) of the ``srun`` step this process is a task of; (1, 1) outside one (``salloc``'s shell, a
    batch script itself: SLURM sets the step's counts only for the tasks of a step)."""
    if "SLURM_STEP_NUM_TASKS" not in os.environ:
        return 1, 1
    return int(os.environ["SLURM_STEP_NUM_TASKS"]), int(os.environ.get("SLURM_STEP_NUM_NODES", "1"))


def restarted_attempt() -> bool:
    """True in ranks the elastic agent restarted after a failure (``distributed.max_restarts`` > 0), and in a SLURM
    job that was requeued (after a time limit or preemption)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 or slurm_restart_count() > 0


def resume_setting(resume: str) -> str:
    """``checkpoint.resume`` as this attempt applies it: an elastic restart or a requeued SLURM job continues from
    its newest checkpoint (``auto``) even when the first attempt started fresh (``never``)."""
    return "auto" if resume == "never" and restarted_attempt() else resume


def slurm_restart_count() -> int:
    """How many times SLURM has requeued this job."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def in_slurm_job() -> bool:
    return "SLURM_JOB_ID" in os.environ


def adopt_slurm_tasks() -> bool:
    """In a SLURM step with several tasks (``srun``, or submitit with nodes x tasks_per_node > 1), make this task
    one rank: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and MASTER_ADDR/PORT (the first node) from SLURM's
    environment through submitit's helper. Returns whether it did; one-task jobs launch their ranks locally."""
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1 or "SLURM_PROCID" not in os.environ or "RANK" in os.environ:
        return False
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True


def requeue_slurm_job() -> None:
    """Ask SLURM to requeue this job (it restarts with the same command and resumes from its checkpoints)."""
    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True, timeout=60)


def default_nproc_per_node(device_type: str) -> int:
    """One rank per visible GPU, else 2 CPU ranks."""
    return torch.cuda.device_count() if device_type == "cuda" else 2


# How long a worker outlives handing over its return value: a launcher that is collecting reads it within its
# ``monitor_interval`` (0.1 s); one that is shutting down (it received a stop signal itself) never does.
WORKER_EXIT_GRACE_S = 5.0


def _worker_main(entrypoint: Callable[..., Any], *args: Any) -> Any:
    """What each worker ``run_ranks`` starts runs: the entrypoint, then a timer that ends the process.

    An elastic worker waits after returning until the launcher has read every rank's value. A launcher that received
    a stop signal is instead shutting its workers down, and SIGKILLs them only after its 30 s shutdown timeout (with
    a warning), time a preempted job does not have. Ending the process ``WORKER_EXIT_GRACE_S`` after the return
    loses nothing: a launcher still collecting has read the value by then, and treats status 0 as success.
    """
    restore_stop_signals()  # a rank forked from the fork server inherits its ignoring them
    result = entrypoint(*args)
    timer = threading.Timer(WORKER_EXIT_GRACE_S, _exit_now)
    timer.daemon = True  # a worker the launcher releases in time exits normally, timer and all
    timer.start()
    return result


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _single_rank_env() -> Iterator[None]:
    """The environment variables a launcher would set for a world of one, restored afterwards."""
    values = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _RoutineStopFilter(logging.Filter):
    """Drops the elastic agent's "Received <signal> death signal, shutting down workers" warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in str(record.msg)


_ROUTINE_STOP = _RoutineStopFilter()


def run_ranks(
    entrypoint: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    nproc_per_node: int,
    max_restarts: int = 0,
    start_method: str = "spawn",
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on every rank of this node and return ``{rank: return value}``.

    Inside an outer launcher this process is already one rank: it runs the entrypoint itself. A world of one
    without restarts also runs in-process (no spawn cost). Otherwise ``nproc_per_node`` processes are spawned
    with a c10d rendezvous on a free local port; if any rank fails, the agent stops the others (no hang) and,
    after ``max_restarts`` restarts, raises ``ChildFailedError`` carrying the failing rank's traceback.

    ``start_method``: ``spawn`` (a fresh interpreter per rank; required once CUDA may be initialised) or
    ``forkserver`` (ranks fork from one server process that imported ``distrain.trainer.rank`` and the entrypoint's
    module
    once, which saves seconds per rank on CPU). Never ``fork`` from here: the agent's rendezvous store serves from a
    thread of this process while ranks start, and a child forked while a thread holds a lock can hang or crash.

    The rendezvous store binds port 0, so the kernel picks a free port atomically: a port chosen first and bound
    later can be taken in between, and the agent then silently joins whatever store listens there (a hang).
    """
    if inside_launcher():
        return {launcher_rank(): entrypoint(*args)}
    if nproc_per_node == 1 and max_restarts == 0:
        with _single_rank_env():
            return {0: entrypoint(*args)}
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # 30 ms a one-process job skips

    if start_method == "forkserver":
        start_fork_server(entrypoint)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
        # SIGUSR1/SIGUSR2 too (SLURM's warnings before a time limit): forwarded to the ranks, which checkpoint.
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
    )
    # The agent logs each failed worker's traceback; the caller reports failures itself (one line for a known
    # cause, the failing rank's traceback otherwise), so the agent's copy would only bury that report.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # A forwarded stop signal is routine here (the ranks checkpoint and the caller says so in one line).
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(_ROUTINE_STOP)  # once: same object
    return elastic_launch(config, _worker_main)(entrypoint, *args)
