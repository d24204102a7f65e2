"""What all ranks agree on at the end of every optimizer step: stop for a signal, a failed rank, whether an
emergency checkpoint is safe, whether an asynchronous checkpoint is written everywhere.

One all-reduce (MAX) of six integers per step (none in a world of one: its own flags are the verdict), on a
dedicated gloo group with CPU tensors, so it never queues behind the strategy's collectives on the default group,
and a rank that failed can wait for it with a short timeout: if a healthy peer is stuck in a collective the
failed rank never joined, the failed rank gives up after ``failure_timeout_s`` instead of hanging, and no emergency
checkpoint is written.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from distrain.errors import UnresponsiveRankError
from distrain.launch.process_group import PeerFailedError, is_peer_failure
from distrain.trainer.preemption import StopRequest

if TYPE_CHECKING:
    from distrain.ft.replicas import AgreedStop

__all__ = ["AgreementTimeout", "PeerFailedError", "StepAgreement", "Verdict"]

log = logging.getLogger(__name__)


_ARRIVALS_KEY = "distrain/step_boundary_arrivals"


class AgreementTimeout(RuntimeError):
    """A failed rank's peers did not reach the step boundary in time (one of them is blocked elsewhere)."""


@dataclass(frozen=True)
class Verdict:
    """What every rank learned at one step boundary (identical on all ranks)."""

    stop: bool  # some rank received SIGTERM/SIGUSR1
    failed_rank: int | None  # the highest-numbered rank that reported an exception
    consistent: bool  # every rank is at the same completed step with no half-applied update
    step: int  # the highest step any rank completed
    async_save_written: bool  # every rank finished writing its part of the pending asynchronous checkpoint


class StepAgreement:
    """Per-step agreement on a gloo group created once here (collective: every rank constructs it)."""

    def __init__(self, *, stop: StopRequest | AgreedStop | None, timeout_s: float, failure_timeout_s: float) -> None:
        self.stop = stop
        self.timeout_s = timeout_s
        self.failure_timeout = datetime.timedelta(seconds=failure_timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        # Each rank counts its arrivals at step boundaries in the rendezvous store (served by the launcher, so it
        # answers even when a rank is stopped): whoever is behind when a boundary times out stopped responding.
        self.store = dist.distributed_c10d._get_default_store()
        self.arrivals = 0
        self.world_size = dist.get_world_size()
        self.identity = (os.getpid(), socket.gethostname())

    def agree(
        self,
        *,
        step: int,
        failed: bool,
        consistent: bool,
        async_save_written: bool = True,
        failed_waiting: bool = False,
    ) -> Verdict:
        """Collective on the agreement group (local in a world of one). ``step`` is the optimizer steps this rank
        completed; ``consistent`` is False when this rank failed in the middle of applying an update.

        Raises ``AgreementTimeout`` on a failed rank whose peers do not arrive within ``failure_timeout_s``, and
        ``UnresponsiveRankError`` when the boundary times out on a rank that was only waiting for peers (healthy, or
        ``failed_waiting``: its own failure was a collective timing out) and some peer has not arrived.
        """
        rank = dist.get_rank()
        flags = torch.tensor(
            [
                1 if self.stop is not None and self.stop.signal_name else 0,
                rank + 1 if failed else 0,
                0 if consistent else 1,
                step,
                -step,
                0 if async_save_written else 1,
            ],
            dtype=torch.int64,
        )
        self.arrivals += 1
        if self.world_size > 1:  # alone, this rank's flags are the verdict: no store round trip, no all-reduce
            self._reduce(flags, rank=rank, step=step, failed=failed, failed_waiting=failed_waiting)
        stop, failed_plus_one, inconsistent, max_step, neg_min_step, unwritten = flags.tolist()
        if stop and self.stop is not None and self.stop.signal_name is None:
            self.stop.signal_name = "a signal to another rank"
        return Verdict(
            stop=bool(stop),
            failed_rank=failed_plus_one - 1 if failed_plus_one else None,
            consistent=not inconsistent and max_step == -neg_min_step,
            step=max_step,
            async_save_written=not unwritten,
        )

    def _reduce(self, flags: torch.Tensor, *, rank: int, step: int, failed: bool, failed_waiting: bool) -> None:
        """The all-reduce (MAX) of ``flags`` in place, this rank's arrival recorded in the store first."""
        self.store.set(f"{_ARRIVALS_KEY}/{rank}", json.dumps([self.arrivals, step, *self.identity]))
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        try:
            work.wait(timeout=self.failure_timeout) if failed else work.wait()
        except RuntimeError as err:
            if is_peer_failure(err):  # a peer died: the launcher reports it; nobody is left to stop
                raise
            if not failed or failed_waiting:  # else peers may be blocked in a collective this rank left
                self._stop_unresponsive_ranks()
            if not failed:
                raise
            raise AgreementTimeout(
                f"peers did not reach the step boundary within {self.failure_timeout.total_seconds():.0f} s"
            ) from err

    def _stop_unresponsive_ranks(self) -> None:
        """After a step boundary timed out: find the ranks that have not arrived as often as this one, SIGKILL those
        on this host (stopped or spinning, they would not react to the launcher's SIGTERM for its 30 s grace) and
        raise ``UnresponsiveRankError`` naming them. Returns when every peer has arrived (they are not the cause)."""
        behind = []
        for peer in range(dist.get_world_size()):
            key = f"{_ARRIVALS_KEY}/{peer}"
            arrival = json.loads(self.store.get(key)) if self.store.check([key]) else [0, 0, 0, ""]
            if arrival[0] < self.arrivals:
                behind.append((peer, *arrival[1:]))
        if not behind:
            return
        for _, _, pid, host in behind:
            if host == socket.gethostname() and pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        names = ", ".join(
            f"rank {peer} (pid {pid} on {host}, last at the end of step {peer_step})"
            for peer, peer_step, pid, host in behind
        )
        raise UnresponsiveRankError(
            f"{names} stopped responding: no collective for distributed.timeout_s={self.timeout_s:g} s (stopped, "
            "deadlocked or looping); "
            "ended it and the job; the last complete checkpoint is intact (resume with checkpoint.resume=auto)"
        )
