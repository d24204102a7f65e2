"""Starting ``ft=torchft``'s replica groups on this machine (or on this node of a SLURM job, one task per node): the
lighthouse (unless an external one is given; in a SLURM job, on the first node), then one supervisor process per group
of this machine, each running that group's ranks under its own elastic agent.

A group's ranks form their own torch.distributed world (its own rendezvous and store); a rank that fails takes only
its group down, and that group's agent restarts it (``ft.max_restarts`` times) while the other groups keep stepping
through torchft's quorum. Stop signals the launcher receives are forwarded to every group (each checkpoints at a
step boundary, as a plain job does).
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.api import SignalException

from distrain.errors import RunError
from distrain.ft.coordination import JobCoordination, Launchers, groups_of
from distrain.ft.replicas import REPLICA_GROUP_ENV, START_STORE_ENV

log = logging.getLogger("distrain.launch")
POLL_S = 1.0  # how often a launcher of several (one per SLURM node) asks the store whether another finished the run
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def run_replica_groups(
    entrypoint: Callable[..., Any],
    rank_args: tuple[Any, ...],
    ft: DictConfig,
    *,
    nproc_per_node: int,
    start_method: str,
) -> dict[int, Any]:
    """Run ``entrypoint(*rank_args)`` on every rank of every group; return ``{0: summary}`` from group 0 (or the first
    group that finished, when group 0 failed for good). Raises ``SignalException`` when a stop signal ended the
    groups, ``RunError`` when no group finished."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and manager servers log every quorum at info
    launchers = Launchers.of_this_job()
    groups = groups_of(launchers, ft.replica_groups)
    per_group = nproc_per_node // len(groups)
    context = multiprocessing.get_context("spawn")
    with JobCoordination(launchers, ft) as job:
        rank_args[0]["ft"]["lighthouse"] = job.lighthouse
        # Where the groups meet once before their first quorum (ReplicaGroups.join): a group whose ranks start
        # faster would otherwise form a quorum alone and train its first steps without the others.
        os.environ[START_STORE_ENV] = job.store_address
        pending: dict[int, tuple[Any, Connection]] = {}
        for slot, group in enumerate(groups):
            reader, writer = context.Pipe(duplex=False)
            group_args, devices = _share_of_node(rank_args, slot, per_group, nproc_per_node)
            process = context.Process(
                target=_supervise_group,
                args=(group, devices, entrypoint, group_args, per_group, ft.max_restarts, start_method, writer),
                name=f"replica-group-{group}",
            )
            pending[group] = (process, reader)
        with _forwarded_signals([process for process, _ in pending.values()]):
            for process, _ in pending.values():
                process.start()
            outcomes = _collect(pending, ft.timeout_s, partial(_final_checkpoint_written, rank_args[0]), job)
        finished_elsewhere = job.run_finished()
    return _job_result(outcomes, finished_elsewhere)


def _share_of_node(
    rank_args: tuple[Any, ...], slot: int, ranks: int, node_ranks: int
) -> tuple[tuple[Any, ...], str | None]:
    """The rank arguments of the ``slot``-th group on this node, and on CUDA its own GPUs (``ranks`` of them, after
    the earlier groups', as ``CUDA_VISIBLE_DEVICES``). On CPU the group's ranks get their share of the node's cores:
    each would otherwise split the cores among its own group's ranks only, several groups' worth on one machine."""
    cfg = copy.deepcopy(rank_args[0])
    distributed, devices = cfg["distributed"], None
    if distributed["device"] == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        node_devices = visible.split(",") if visible else [str(d) for d in range(node_ranks)]
        devices = ",".join(node_devices[slot * ranks : (slot + 1) * ranks])
    elif not distributed.get("threads_per_rank"):
        distributed["threads_per_rank"] = max(1, (os.cpu_count() or 1) // node_ranks)
    return (cfg, *rank_args[1:]), devices


def _collect(
    pending: dict[int, tuple[Any, Connection]],
    grace_s: float,
    final_saved: Callable[[], bool],
    job: JobCoordination,
) -> dict[int, tuple[str, Any]]:
    """Each group's outcome as its supervisor sent it, or ("failed", why) when it died without sending one. Once a
    group has finished the run (here, or on another node: ``job``), the others get ``grace_s`` to finish too; a group
    still running then (restarted after the others were done, it would train the whole run again alone) is stopped,
    but never before the run's final checkpoint is complete (``final_saved``: the group writing it may be the one
    still running)."""
    outcomes: dict[int, tuple[str, Any]] = {}
    pending, deadline = dict(pending), None
    while pending:
        if deadline is None and job.run_finished():
            deadline = time.monotonic() + grace_s
        waitables = [reader for _, reader in pending.values()] + [process.sentinel for process, _ in pending.values()]
        # Another node's news arrives through the store, which is polled: a launcher alone waits for its groups.
        wake = None if job.launchers.count == 1 else POLL_S
        if deadline is not None:
            remaining = max(0.0, deadline - time.monotonic())
            wake = remaining if wake is None else min(wake, remaining)
        ready = set(wait(waitables, timeout=wake))
        for group, (process, reader) in list(pending.items()):
            outcome = _outcome(process, reader) if reader in ready or process.sentinel in ready else None
            if outcome is None and deadline is not None and time.monotonic() >= deadline and final_saved():
                os.killpg(process.pid, signal.SIGKILL)  # the supervisor leads its own process group
                outcome = ("cut", "another group had finished the run")
            if outcome is None:
                continue
            outcomes[group] = outcome
            process.join()
            del pending[group]
            if outcome[0] == "ok":
                job.announce_finished()
                deadline = deadline or time.monotonic() + grace_s
    return outcomes


def _final_checkpoint_written(cfg_dict: dict[str, Any]) -> bool:
    """Whether the run's last checkpoint is on disk, complete (or the run writes none at its end)."""
    from distrain.checkpoint.steps import checkpoint_step, newest_valid

    checkpoint = cfg_dict["checkpoint"]
    if not checkpoint.get("save_final") or not checkpoint.get("dir"):
        return True
    newest = newest_valid(Path(checkpoint["dir"]), report=False)
    return newest is not None and checkpoint_step(newest) >= cfg_dict["trainer"]["max_steps"]


def _outcome(process: Any, reader: Connection) -> tuple[str, Any] | None:
    """What a group's supervisor sent; ("failed", why) if it exited without sending; None while it runs."""
    try:
        if reader.poll():
            return reader.recv()
    except EOFError:
        pass
    if process.is_alive():
        return None
    return ("failed", f"its supervisor exited with status {process.exitcode}")


def _job_result(outcomes: dict[int, tuple[str, Any]], finished_elsewhere: bool = False) -> dict[int, Any]:
    """Group 0's summary (or the first group's that finished here); ``{}`` when no group here finished but one on
    another node did (the job succeeded there)."""
    for group, (kind, value) in sorted(outcomes.items()):
        if kind == "failed":
            log.warning("replica group %d failed for good (ft.max_restarts reached): %s", group, value)
        elif kind == "cut":
            log.warning("replica group %d was stopped: %s", group, value)
    stopped = [value for kind, value in outcomes.values() if kind == "stopped"]
    if stopped:
        raise SignalException(f"stopped by {stopped[0]}", getattr(signal, stopped[0]))
    finished = {group: value for group, (kind, value) in sorted(outcomes.items()) if kind == "ok"}
    if finished:
        return {0: finished.get(0, next(iter(finished.values())))}
    if finished_elsewhere:
        return {}
    failures = [value for kind, value in outcomes.values() if kind == "failed"]
    raise RunError(failures[0] if failures else "no replica group finished the run")


def _supervise_group(
    group: int,
    devices: str | None,
    entrypoint: Callable[..., Any],
    rank_args: tuple[Any, ...],
    ranks: int,
    max_restarts: int,
    start_method: str,
    outcome: Connection,
) -> None:
    """One group's supervisor (its own process): its ranks under an elastic agent that restarts them when one fails.
    Its own process group, so a terminal's Ctrl-C reaches it once, forwarded by the launcher."""
    from distrain.launch.entry import failure_line
    from distrain.launch.ranks import ChildFailedError, run_ranks

    os.setpgrp()
    os.environ[REPLICA_GROUP_ENV] = str(group)
    if devices is not None:  # before any rank starts: each takes cuda:LOCAL_RANK among these
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        results = run_ranks(
            entrypoint, rank_args, nproc_per_node=ranks, max_restarts=max_restarts, start_method=start_method
        )
        result: tuple[str, Any] = ("ok", results.get(0))
    except ChildFailedError as err:
        result = ("failed", failure_line(err, rank_args[1]) or err.format_msg())
    except SignalException as err:
        result = ("stopped", err.sigval.name)
    except RunError as err:
        result = ("failed", str(err))
    outcome.send(result)


@contextmanager
def _forwarded_signals(processes: list[Any]) -> Iterator[None]:
    """Stop signals to this process go to every group's supervisor (whose agent forwards them to its ranks)."""

    def forward(signum: int, _frame: Any) -> None:
        for process in processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
