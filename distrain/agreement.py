"""What all ranks agree on at the end of every optimizer step: stop for a signal, a failed rank, whether an
emergency checkpoint is safe, whether an asynchronous checkpoint is written everywhere.

One all-reduce (MAX) of six integers per step, on a dedicated gloo group with CPU tensors, so it never queues
behind the strategy's collectives on the default group, and a rank that failed can wait for it with a short
timeout: if a healthy peer is stuck in a collective the failed rank never joined, the failed rank gives up
after ``failure_timeout_s`` instead of hanging, and no emergency checkpoint is written.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distrain.dist import PeerFailedError
from distrain.preemption import StopRequest

__all__ = ["AgreementTimeout", "PeerFailedError", "StepAgreement", "Verdict"]

log = logging.getLogger(__name__)


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

    def __init__(self, *, stop: StopRequest | None, timeout_s: float, failure_timeout_s: float) -> None:
        self.stop = stop
        self.failure_timeout = datetime.timedelta(seconds=failure_timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def agree(self, *, step: int, failed: bool, consistent: bool, async_save_written: bool = True) -> Verdict:
        """Collective on the agreement group. ``step`` is the optimizer steps this rank completed; ``consistent``
        is False when this rank failed in the middle of applying an update.

        Raises ``AgreementTimeout`` on a failed rank whose peers do not arrive within ``failure_timeout_s``.
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
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if failed:
            try:
                work.wait(timeout=self.failure_timeout)
            except RuntimeError as err:
                raise AgreementTimeout(
                    f"peers did not reach the step boundary within {self.failure_timeout.total_seconds():.0f} s"
                ) from err
        else:
            work.wait()
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
