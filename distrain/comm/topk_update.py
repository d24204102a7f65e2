"""``comm=topk comm.feedback=update`` (the default): top-k of each rank's optimizer *update*, with error feedback.

No gradient is averaged. Each rank's optimizer steps on the rank's own gradient, so an adaptive optimizer's
per-entry normalisation sees a dense gradient every step; what travels is the update it produced. Each rank adds
that update to what it has not sent yet (its residual) and sends the top-k entries of the sum as (value, index)
pairs in one all-gather; every rank adds the mean of all sent values to the shared parameters, summed in rank
order, so the ranks hold identical parameters after every step. Error feedback is exact here for any optimizer:
an update enters the parameters linearly, so what is not sent is only delayed (on gradients it is exact for SGD
only; docs/communication.md).

The gradient is taken at the rank's own view of the model, the shared parameters plus its residual
(``gradient_point``): the rank's optimizer sees the effect of its own unsent updates and stops pushing in a
direction it has already taken (without this the residual overshoots). Every ``sync_every`` steps the residuals
are all-reduced whole, so the shared model then holds every update and each rank's view equals it.

The strategy clips with the root-mean-square of the ranks' local gradient norms (one scalar all-reduce) and the
threshold divided by sqrt(world size), Deep Gradient Compression's local clipping; it keeps the optimizer's
state per rank (in checkpoints too), and calls ``finish_update`` after the optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distrain.comm.topk import TopKComm, copy_from_flat, flatten
from distrain.comm.traffic import all_reduce_bytes
from distrain.launch.process_group import DistEnv


def topk_comm(*, feedback: str = "update", sync_every: int = 0, **options: Any) -> TopKComm:
    """The ``comm=topk`` option for ``feedback``: top-k of the update (``TopKUpdateComm``) or of the gradient."""
    if feedback == "update":
        return TopKUpdateComm(sync_every=sync_every, **options)
    return TopKComm(feedback=feedback, **options)


topk_comm.check_config = TopKComm.check_config  # both classes take the same keys


class TopKUpdateComm(TopKComm):
    """Top-k of each rank's update with error feedback (module docstring).

    Args:
        sync_every: all-reduce the whole residual every this many optimizer steps (0: never); it is also sent
            whole at steps the loop evaluates or checkpoints after, and the last (``set_schedule``), so
            evaluations, checkpoints and the final model hold every update.
        The others as ``TopKComm`` (``momentum`` must be 0).

    Per-rank state: the residual (``pending``: one buffer per parameter, on the parameter's device; saved in
    checkpoints, under keys of its own, so a gradient residual from ``feedback=residual`` is never read as one).
    The quality guard reports, every ``quality_every`` steps, the share of the ranks' updates since the last check
    (plus what was pending then) that the shared parameters have not received yet (``grad_compression_error``).
    """

    local_steps = True
    feedbacks = ("update",)
    guard_measures = "the shared parameters lack part of the ranks' recent updates"

    def __init__(self, *, sync_every: int, **options: Any) -> None:
        super().__init__(feedback="update", **options)
        self.sync_every = sync_every

    def prepare(self, model: DistributedDataParallel, env: DistEnv) -> None:
        super().prepare(model, env)
        self.params = [(name, p) for name, p in model.module.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in self.params]
        self.state = {"pending": {name: torch.zeros_like(p) for name, p in self.params}}  # unsent updates
        self._shared: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None  # the guard's sampled entries, as flat positions

    def checking(self) -> bool:
        return False  # the gradient guard does not apply: each rank applies its own gradient

    def average_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """No collective: the bucket keeps this rank's gradient, for this rank's optimizer."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    @contextmanager
    def gradient_point(self) -> Iterator[None]:
        """Forward and backward run at the shared parameters plus this rank's residual; on exit the shared
        parameters are restored from a copy (subtracting again would round differently on each rank)."""
        self._shared = self._flat_params()
        try:
            with torch.no_grad():
                for name, p in self.params:
                    p.add_(self.state["pending"][name])
            yield
        finally:
            self._write_params(self._shared)

    @torch.no_grad()
    def finish_update(self, *, stepped: bool = True) -> dict[str, Any]:
        """Send this step's top-k of (update + residual) and set every rank's parameters to the shared ones plus
        the mean sent. ``stepped=False``: the step was skipped (the same decision on every rank). Collective: one
        all-gather of (value, index) pairs (a dense all-reduce on a sync step, before an evaluation or a
        checkpoint, at the run's last step, or when that is cheaper), and on guard steps one reduce to rank 0 on
        the guard's group. The report has ``update_dropped`` True when the mean was not finite: no rank applies
        it. A skipped or dropped step that should send everything still sends what was pending before it."""
        if self._shared is None:
            raise RuntimeError("finish_update without gradient_point: the shared parameters were not kept")
        shared, self._shared = self._shared, None
        pending = self._flat("pending", self.names)
        report: dict[str, Any] = {}
        applied = False
        if stepped:
            update = self._flat_params() - shared
            report = self._guard(pending)
            applied = self._send_and_apply(pending + update, shared)
            if applied:
                self._extend_window(update)
        if not applied and self._sends_whole():
            self._send_and_apply(pending, shared)
        self._write_params(shared)
        return report | {
            "comm_bytes": self.bytes_sent,
            "comm_dense_bytes": self.dense_bytes,
            "comm_intervals": self.intervals,
            "comm_after_backward": self.intervals[-1:] if self.intervals else [],
            "update_dropped": stepped and not applied,
        }

    def _sends_whole(self) -> bool:
        """Whether this step sends the whole residual: a sync step, one the loop evaluates or checkpoints after,
        or the last (the same answer on every rank)."""
        return (self.sync_every > 0 and self.step % self.sync_every == 0) or self.is_exact_step(self.step)

    def _send_and_apply(self, candidate: torch.Tensor, shared: torch.Tensor) -> bool:
        """Exchange ``candidate`` (see ``_exchange_candidate``); if the mean is finite (the same on every rank),
        keep what was not sent as the residual, add the mean to ``shared`` and return True."""
        launched = self.clock.mark()
        mean, sent = self._exchange_candidate(candidate)
        self.intervals.append((launched, self.clock.mark()))
        if not bool(torch.isfinite(mean).all()):
            return False
        candidate[sent] = 0
        self._unflat("pending", self.names, candidate)
        shared += mean.to(shared.dtype)
        return True

    def _exchange_candidate(self, candidate: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The mean over ranks of what each sends, and which entries of ``candidate`` this rank sent (a slice or
        indices). Collective: an all-gather of the top-k pairs, or an all-reduce of the whole vector."""
        total = candidate.numel()
        k = min(total, max(1, math.ceil(self.density_at(self.step) * total)))
        if k * self.world_size >= total or self._sends_whole():
            vector = candidate.float() / self.world_size
            self.bytes_sent += all_reduce_bytes(vector.numel() * vector.element_size(), self.world_size)
            dist.all_reduce(vector)
            return vector, slice(None)
        indices = candidate.abs().topk(k).indices
        summed, work = self._send(indices, candidate[indices].float() / self.world_size, total, dense=False)
        work.wait()
        return summed(), indices

    def _guard(self, pending: torch.Tensor) -> dict[str, Any]:
        """On guard steps: ||pending now|| / ||pending at the last check + updates applied since||, summed over
        ranks at the sampled entries (collective: one reduce to rank 0)."""
        if self.quality_every <= 0 or not self.registered:
            return {}
        if self._positions is None:
            self._start_window(pending)
        if self.step % self.quality_every != 0:
            return {}
        parts = torch.stack([pending[self._positions].float(), self._due])
        dist.reduce(parts, dst=0, op=dist.ReduceOp.SUM, group=self._group)
        self._due = pending[self._positions].float()
        if self.rank != 0:
            return {}
        pending_norm, due = parts[0].norm().item(), parts[1].norm().item()
        error = pending_norm / due if due > 0 else (0.0 if pending_norm == 0 and due == 0 else math.nan)
        self._note(error)
        return {"comm_quality": {"grad_compression_error": error}}

    def _extend_window(self, update: torch.Tensor) -> None:
        """Count an applied step's update in the guard's window."""
        if self._positions is not None:
            self._due += update[self._positions].float()

    def _start_window(self, pending: torch.Tensor) -> None:
        """The sampled entries as flat positions; the window starts with what is pending (nonzero after a resume)."""
        offsets, offset = {}, 0
        for _, p in self.params:
            offsets[id(p)], offset = offset, offset + p.numel()
        positions = [offsets[key] + index.to(pending.device) for key, (_, index) in self._sampled.items()]
        self._positions = torch.cat(positions)
        self._due = pending[self._positions].float()

    def _flat_params(self) -> torch.Tensor:
        return flatten([p for _, p in self.params])

    def _write_params(self, flat: torch.Tensor) -> None:
        copy_from_flat([p for _, p in self.params], flat)
