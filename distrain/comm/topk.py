"""``comm=topk`` on gradients (``feedback=estimate`` or ``residual``): top-k sparsification with feedback of what was
not sent. The default, top-k of each rank's optimizer update (``feedback=update``), builds on this class in
``distrain.comm.topk_update``.

Each rank sends only the ``density`` fraction of entries that matter most, as (value, index) pairs in one
all-gather (fp32 values, int32 indices), which every rank sums in rank order, so all ranks apply identical
gradients. Bytes sent per rank and step: ``(world - 1) * 8k``, against ``2 (world - 1)/world * 4n`` for the dense
all-reduce. A step whose pairs would cost at least the dense all-reduce (``k >= n / world``: a warm-up that starts
near dense) all-reduces the dense vector instead.

Selection waits for the step's last bucket (``GradBucket.is_last``) and runs over all parameters in their
registration order, so what is sent does not depend on how DDP groups parameters into buckets (it rebuilds them
after the first step of every process: a per-bucket choice would make a resumed run diverge). The price is that
the exchange does not overlap backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distrain.comm.checks import check_topk
from distrain.comm.quality import CompressedComm
from distrain.comm.traffic import all_gather_bytes, all_reduce_bytes
from distrain.launch.process_group import DistEnv

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from distrain.config.options import Placement

FEEDBACKS = ("estimate", "residual")  # feedback on gradients; "update" is distrain.comm.topk_update's
MAX_INDEX = 2**31 - 1  # indices travel as int32
Waiting = list[tuple[torch.Tensor, list[str], torch.futures.Future]]


class TopKComm(CompressedComm):
    """Top-k of the gradient with one of two kinds of feedback (``feedback``).

    ``estimate`` (EF21, Richtarik et al. 2021): every rank keeps an estimate of its own gradient that
    all ranks know, and sends the top-k entries of the *change* (fresh gradient minus estimate). All ranks keep the
    mean of the ranks' estimates and apply it, so every entry of the applied gradient is nonzero every step (the
    latest value sent for it). Adam-type optimizers need that: they normalise each entry by its own history, so
    an entry that receives nothing for many steps and then its accumulated sum at once moves far less than under
    dense communication.

    ``residual`` (classic error feedback, Deep Gradient Compression, Lin et al. 2018): each rank adds what it has
    not sent yet (its residual) to the fresh gradient and sends the top-k of the sum. Nothing is lost, only
    delayed, which is exact for SGD (its update is linear in the gradient). ``momentum`` adds DGC's momentum
    correction (with factor masking), for ``optimizer=sgd optimizer.momentum=0``.

    Args:
        density: fraction of the model's gradient entries each rank sends per step, in (0, 1].
        warmup_steps: density decays exponentially from ``warmup_start_density`` to ``density`` over these
            steps (DGC's warm-up); 0 starts at ``density``.
        feedback: ``estimate`` or ``residual`` (``update``: the subclass ``TopKUpdateComm``).
        momentum: momentum correction (``residual`` only).

    Per-rank state (the estimates, or the residual and velocity) lives on the gradient's device, one buffer per
    parameter, and is saved in checkpoints for an exact resume.
    """

    feedbacks = FEEDBACKS

    @classmethod
    def check_config(cls, cfg: DictConfig, placement: Placement) -> list[str]:
        return [*super().check_config(cfg, placement), *check_topk(cfg)]

    def __init__(
        self,
        *,
        density: float,
        warmup_steps: int,
        warmup_start_density: float,
        feedback: str = "estimate",
        momentum: float = 0.0,
        **compressed: Any,
    ) -> None:
        super().__init__(**compressed)
        if feedback not in self.feedbacks:
            raise ValueError(
                f"feedback={feedback!r}: one of {', '.join(self.feedbacks)} (update: topk_update.topk_comm)"
            )
        self.density, self.warmup_steps, self.warmup_start_density = density, warmup_steps, warmup_start_density
        self.feedback, self.momentum = feedback, momentum

    def prepare(self, model: DistributedDataParallel, env: DistEnv) -> None:
        super().prepare(model, env)
        params = [(name, p) for name, p in model.module.named_parameters() if p.requires_grad]
        if sum(p.numel() for _, p in params) > MAX_INDEX:
            raise ValueError(f"comm=topk sends int32 indices: at most {MAX_INDEX} trainable parameters per model")
        self.param_names = {id(p): name for name, p in params}
        self.order = {name: index for index, (name, _) in enumerate(params)}
        self.sizes = {name: p.numel() for name, p in params}

        def buffers() -> dict[str, torch.Tensor]:
            return {name: torch.zeros_like(p, memory_format=torch.contiguous_format) for name, p in params}

        # estimate: this rank's estimate (as every rank knows it) and the ranks' mean, which is applied
        # residual: what this rank has not sent yet, and its velocity under momentum correction
        self.state = {"estimate": buffers(), "mean": buffers()} if self.feedback == "estimate" else {}
        if self.feedback == "residual":
            self.state = {"residual": buffers()} | ({"velocity": buffers()} if self.momentum > 0 else {})
        self._step_tensor = torch.zeros((), dtype=torch.int64)
        self._waiting: Waiting = []

    def density_at(self, step: int) -> float:
        """The density used at optimizer step ``step`` (1-based)."""
        if self.warmup_steps <= 0 or step > self.warmup_steps:
            return self.density
        progress = (step - 1) / self.warmup_steps
        return self.warmup_start_density * (self.density / self.warmup_start_density) ** progress

    def begin_step(self) -> None:
        super().begin_step()
        self._waiting = []

    def state_dict(self) -> dict[str, torch.Tensor]:
        self._step_tensor.fill_(self.step)
        state = {"step": self._step_tensor}
        for kind, tensors in self.state.items():
            state |= {f"{kind}.{name}": tensor for name, tensor in tensors.items()}
        return state

    def average_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        names = [self.param_names[id(p)] for p in bucket.parameters()]
        future: torch.futures.Future[torch.Tensor] = (
            torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        )
        self._waiting.append((buffer, names, future))
        if bucket.is_last():
            self._exchange(self._waiting)
            self._waiting = []
        return future

    def _exchange(self, buckets: Waiting) -> None:
        """Select, send and sum this step's gradient once every bucket is in; completes every bucket's future.
        Collective: one all-gather (or, when that would cost more, one all-reduce) over all ranks."""
        slices = {}
        for buffer, names, _ in buckets:
            offset = 0
            for name in names:
                slices[name] = buffer[offset : offset + self.sizes[name]]
                offset += self.sizes[name]
        names = sorted(slices, key=self.order.__getitem__)
        gradient = torch.cat([slices[name] for name in names])
        total = gradient.numel()
        k = min(total, max(1, math.ceil(self.density_at(self.step) * total)))
        # (W - 1) 8k bytes of pairs against 2 (W - 1)/W 4n for the dense all-reduce: dense is cheaper from k >= n/W
        # (on one rank both are free, and the selection still shapes the update, as it would on many)
        dense = k * self.world_size >= total
        indices, values, commit = self._select(gradient, names, k, everything=dense)
        summed, work = self._send(indices, values / self.world_size, total, dense=dense)

        def combine(done: torch.futures.Future) -> None:
            try:
                done.value()  # re-raises a failed collective
                applied = summed()
                # The same sum on every rank, so every rank decides alike. A non-finite step is applied as it is
                # (the optimizer or the loss scaler skips it) and leaves the state as it was.
                if torch.isfinite(applied).all():
                    commit()
                    applied = self._applied(applied, names)
                offset = 0
                for name in names:
                    size = slices[name].numel()
                    slices[name].copy_(applied[offset : offset + size])
                    offset += size
            except BaseException as error:  # noqa: BLE001 - handed to DDP, which re-raises it in backward
                for _, _, future in buckets:
                    future.set_exception(error)
                return
            for buffer, _, future in buckets:
                future.set_result(buffer)

        work.get_future().then(combine)

    def _select(
        self, gradient: torch.Tensor, names: list[str], k: int, *, everything: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
        """This rank's (indices, values) to send, and a function that updates its state as if they were sent.
        The caller runs it only when the step's summed gradient is finite: a NaN or inf written into an estimate
        or a residual would stay there and poison every later step."""
        if self.feedback == "estimate":
            estimate = self._flat("estimate", names)
            candidate = gradient - estimate  # the change the other ranks have not seen
        else:
            candidate = self._flat("residual", names)
            velocity = self._flat("velocity", names) if self.momentum > 0 else None
            if velocity is not None:
                velocity.mul_(self.momentum).add_(gradient)
                candidate.add_(velocity)
            else:
                candidate.add_(gradient)
        if everything:
            indices = torch.arange(candidate.numel(), device=candidate.device)
        else:
            indices = candidate.abs().topk(k).indices
        values = candidate[indices].float()

        def commit() -> None:
            if self.feedback == "estimate":
                estimate[indices] += values.to(estimate.dtype)
                self._unflat("estimate", names, estimate)
                return
            candidate[indices] = 0  # sent: what stays is the residual for the next step
            self._unflat("residual", names, candidate)
            if velocity is not None:
                velocity[indices] = 0  # momentum factor masking: a sent entry's momentum does not push again
                self._unflat("velocity", names, velocity)

        return indices, values, commit

    def _send(self, indices: torch.Tensor, values: torch.Tensor, total: int, *, dense: bool) -> tuple[Any, Any]:
        """Start summing every rank's ``values`` at its ``indices`` into a dense vector of ``total`` entries.
        Returns (a function giving the sum once the work is done, the work). Collective, asynchronous: one
        all-gather of this rank's (value, index) pairs, or one all-reduce of the dense vector."""
        if dense:
            vector = torch.zeros(total, dtype=values.dtype, device=values.device)
            vector[indices] = values
            self.bytes_sent += all_reduce_bytes(vector.numel() * vector.element_size(), self.world_size)
            return (lambda: vector), dist.all_reduce(vector, async_op=True)
        # Values and indices travel in one message: int32 indices reinterpreted as fp32 bits (no arithmetic).
        message = torch.cat([values, indices.to(torch.int32).view(torch.float32)])
        gathered = [torch.empty_like(message) for _ in range(self.world_size)]
        self.bytes_sent += all_gather_bytes(message.numel() * message.element_size(), self.world_size)
        work = dist.all_gather(gathered, message, async_op=True)
        k = values.numel()

        def summed() -> torch.Tensor:
            vector = torch.zeros(total, dtype=values.dtype, device=values.device)
            for part in gathered:  # in rank order on every rank: identical sums everywhere
                vector.index_add_(0, part[k:].view(torch.int32).long(), part[:k])
            return vector

        return summed, work

    def _applied(self, summed: torch.Tensor, names: list[str]) -> torch.Tensor:
        """The gradient every rank applies: the summed sent values, or under ``estimate`` the ranks' mean
        estimate after adding them."""
        if self.feedback != "estimate":
            return summed
        mean = self._flat("mean", names)
        mean.add_(summed.to(mean.dtype))
        self._unflat("mean", names, mean)
        return mean

    def _flat(self, kind: str, names: list[str]) -> torch.Tensor:
        return flatten([self.state[kind][name] for name in names])

    def _unflat(self, kind: str, names: list[str], flat: torch.Tensor) -> None:
        copy_from_flat([self.state[kind][name] for name in names], flat)


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor holding ``tensors`` one after another."""
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors])


@torch.no_grad()
def copy_from_flat(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` in place (the inverse of ``flatten``)."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
