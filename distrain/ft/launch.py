"""Starting ``ft=torchft``'s replica groups on this machine: the lighthouse (unless an external one is given), then
one supervisor process per group, each running that group's ranks under its own elastic agent.

A group's ranks form their own torch.distributed world (its own rendezvous and store); a rank that fails takes only
its group down, and that group's agent restarts it (``ft.max_restarts`` times) while the other groups keep stepping
through torchft's quorum. Stop signals the launcher receives are forwarded to every group (each checkpoints at a
step boundary, as a plain job does).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any

from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.api import SignalException

from distrain.errors import RunError
from distrain.ft.replicas import REPLICA_GROUP_ENV, START_STORE_ENV

log = logging.getLogger("distrain.launch")
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
    lighthouse = None
    if not ft.lighthouse:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=ft.min_replicas,
            join_timeout_ms=ft.join_timeout_ms,
            heartbeat_timeout_ms=ft.heartbeat_timeout_ms,
            quorum_tick_ms=ft.quorum_tick_ms,
        )
        rank_args[0]["ft"]["lighthouse"] = lighthouse.address()
    # Where the groups meet once before their first quorum (ReplicaGroups.join): a group whose ranks start faster
    # would otherwise form a quorum alone and train its first steps without the others.
    from torch.distributed import TCPStore

    start_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ[START_STORE_ENV] = f"127.0.0.1:{start_store.port}"
    per_group = nproc_per_node // ft.replica_groups
    context = multiprocessing.get_context("spawn")
    pending: dict[int, tuple[Any, Connection]] = {}
    try:
        for group in range(ft.replica_groups):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_supervise_group,
                args=(group, entrypoint, rank_args, per_group, ft.max_restarts, start_method, writer),
                name=f"replica-group-{group}",
            )
            pending[group] = (process, reader)
        with _forwarded_signals([process for process, _ in pending.values()]):
            for process, _ in pending.values():
                process.start()
            outcomes = _collect(pending)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    return _job_result(outcomes)


def _collect(pending: dict[int, tuple[Any, Connection]]) -> dict[int, tuple[str, Any]]:
    """Each group's outcome as its supervisor sent it, or ("failed", why) when it died without sending one."""
    outcomes: dict[int, tuple[str, Any]] = {}
    pending = dict(pending)
    while pending:
        ready = set(wait([reader for _, reader in pending.values()] + [p.sentinel for p, _ in pending.values()]))
        for group, (process, reader) in list(pending.items()):
            if reader not in ready and process.sentinel not in ready:
                continue
            try:
                outcomes[group] = reader.recv() if reader.poll() else None
            except EOFError:
                outcomes[group] = None
            if outcomes[group] is None:
                if process.is_alive():
                    del outcomes[group]
                    continue
                outcomes[group] = ("failed", f"its supervisor exited with status {process.exitcode}")
            process.join()
            del pending[group]
    return outcomes


def _job_result(outcomes: dict[int, tuple[str, Any]]) -> dict[int, Any]:
    stopped = [value for kind, value in outcomes.values() if kind == "stopped"]
    if stopped:
        raise SignalException(f"stopped by {stopped[0]}", getattr(signal, stopped[0]))
    finished = {group: value for group, (kind, value) in sorted(outcomes.items()) if kind == "ok"}
    for group, (kind, value) in sorted(outcomes.items()):
        if kind == "failed":
            log.warning("replica group %d failed for good (ft.max_restarts reached): %s", group, value)
    if not finished:
        raise RunError(next(value for kind, value in outcomes.values() if kind == "failed"))
    return {0: finished.get(0, next(iter(finished.values())))}


def _supervise_group(
    group: int,
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
