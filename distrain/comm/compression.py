"""Gradient compression as DDP communication hooks: cast (bf16/fp16), PowerSGD, and top-k with error feedback.

Each option changes only how one gradient bucket is averaged over ranks (``average_bucket``); DDP's bucketing,
overlap with backward and ``no_sync`` accumulation are unchanged, so every option composes with gradient
accumulation (the hook sees the step's accumulated gradient once).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from distrain.comm.ddp_comm import DDPComm
from distrain.comm.traffic import all_gather_bytes, all_reduce_bytes
from distrain.dist import DistEnv

CAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class CastComm(DDPComm):
    """``comm=bf16`` / ``comm=fp16``: each bucket is divided by world size, cast to 16 bits, all-reduced (ring,
    sum) in 16 bits and cast back into the fp32 buffer. Half the bytes; gradients lose mantissa bits (bf16) or
    range (fp16: the division before the sum keeps it from overflowing)."""

    def __init__(self, *, dtype: str, **ddp: object) -> None:
        super().__init__(**ddp)
        self.dtype = CAST_DTYPES[dtype]

    def average_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        self.bytes_sent += all_reduce_bytes(buffer.numel() * self.dtype.itemsize, self.world_size)
        hook = default_hooks.bf16_compress_hook if self.dtype == torch.bfloat16 else default_hooks.fp16_compress_hook
        return hook(None, bucket)


class PowerSGDComm(DDPComm):
    """``comm=powersgd``: PyTorch's PowerSGD hook (Vogels et al. 2019). Each gradient matrix M (n x m) is sent
    as two rank-r factors: all-reduce of P = M Q (n x r), orthogonalisation, all-reduce of Q = M^T P (m x r);
    vectors and matrices too small to gain are all-reduced whole. The first ``start_iter`` steps all-reduce
    densely (DDP rebuilds its buckets after the first step, and PowerSGD's memories are kept per bucket).

    After a checkpoint resume the error feedback and warm-start memories start empty (they are keyed by DDP
    bucket, and buckets are rebuilt after the first step of every process), and that first step is dense.
    """

    def __init__(
        self,
        *,
        rank: int,
        start_iter: int,
        min_compression_rate: float,
        error_feedback: bool,
        warm_start: bool,
        **ddp: object,
    ) -> None:
        super().__init__(**ddp)
        self.matrix_rank, self.start_iter, self.min_compression_rate = rank, start_iter, min_compression_rate
        self.error_feedback, self.warm_start = error_feedback, warm_start
        self._dense_until_step = 0

    def prepare(self, model: DistributedDataParallel, env: DistEnv) -> None:
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=self.matrix_rank,
            start_powerSGD_iter=self.start_iter,
            min_compression_rate=self.min_compression_rate,
            use_error_feedback=self.error_feedback,
            warm_start=self.warm_start,
            random_seed=0,
        )

    def on_resume(self, step: int, restored: bool) -> None:
        super().on_resume(step, restored)
        self.state.iter = step
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self._dense_until_step = step + 1  # the resumed process's first step uses the pre-rebuild buckets

    def average_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if self.step <= self._dense_until_step and self.state.iter >= self.start_iter:
            self.state.maybe_increase_iter(bucket)
            return super().average_bucket(bucket)
        self.bytes_sent += (
            self._bytes(bucket)
            if self.state.iter >= self.start_iter
            else all_reduce_bytes(buffer.numel() * buffer.element_size(), self.world_size)
        )
        if dist.get_backend() == "nccl":  # NCCL orders the chained collectives on its stream
            return powerSGD_hook.powerSGD_hook(self.state, bucket)
        return self.in_order(lambda: powerSGD_hook.powerSGD_hook(self.state, bucket).wait())

    def _bytes(self, bucket: dist.GradBucket) -> int:
        """The three all-reduces PowerSGD runs for this bucket: uncompressed tensors, all P's, all Q's."""
        uncompressed = factors_p = factors_q = 0
        for grad in bucket.gradients():
            n, m = grad.view(grad.shape[0], -1).shape
            r = min(n, m, self.matrix_rank)
            if grad.ndim > 1 and (n + m) * r * self.min_compression_rate < n * m:
                factors_p, factors_q = factors_p + n * r, factors_q + m * r
            else:
                uncompressed += grad.numel()
        size = bucket.buffer().element_size()
        return sum(all_reduce_bytes(count * size, self.world_size) for count in (uncompressed, factors_p, factors_q))


class TopKComm(DDPComm):
    """``comm=topk``: top-k sparsification with error feedback (Deep Gradient Compression, Lin et al. 2018).

    Each rank adds its residual (what it did not send before) to the fresh gradient, picks the ``density``
    fraction of entries largest in magnitude over the whole model, and keeps the rest as the residual. Ranks then
    exchange only those (value, index) pairs: one all-gather of ``k`` fp32 values and ``k`` int32 indices per rank,
    which every rank sums (in rank order, so all ranks get identical gradients) into the buckets. Bytes sent per
    rank and step: ``(world - 1) * 8k`` against ``2 (world - 1)/world * 4n`` for the dense all-reduce.

    The selection waits for the step's last bucket (``GradBucket.is_last``) and runs over all parameters in their
    registration order, so what is sent does not depend on how DDP groups parameters into buckets (it rebuilds
    them after the first step of every process: a per-bucket choice would make a resumed run diverge). The price
    is that the exchange no longer overlaps backward; on the default model one selection over the whole model
    also trained better than a per-layer one (README).

    Args:
        density: fraction of the model's gradient entries sent per step, in (0, 1]; 1.0 sends everything
            (equals dense DDP).
        warmup_steps: density decays exponentially from ``warmup_start_density`` to ``density`` over these
            steps (DGC's warm-up); 0 starts at ``density``.
        momentum: momentum correction (DGC): the compressor keeps a momentum buffer per parameter and
            accumulates velocity instead of gradient, zeroing both where entries were sent. Use it with plain SGD
            (``optimizer=sgd optimizer.momentum=0``), since the momentum moves from the optimizer into the hook.

    The residual and momentum live on the gradient's device, one buffer per parameter, and are saved in
    checkpoints for an exact resume.
    """

    def __init__(
        self, *, density: float, warmup_steps: int, warmup_start_density: float, momentum: float, **ddp: object
    ) -> None:
        super().__init__(**ddp)
        self.density, self.warmup_steps, self.warmup_start_density = density, warmup_steps, warmup_start_density
        self.momentum = momentum

    def prepare(self, model: DistributedDataParallel, env: DistEnv) -> None:
        params = [(name, p) for name, p in model.module.named_parameters() if p.requires_grad]
        self.param_names = {id(p): name for name, p in params}
        self.order = {name: index for index, (name, _) in enumerate(params)}
        self.residual = {name: torch.zeros_like(p, memory_format=torch.contiguous_format) for name, p in params}
        self.velocity = {name: torch.zeros_like(p) for name, p in params} if self.momentum > 0 else {}
        self._step_tensor = torch.zeros((), dtype=torch.int64)
        self._waiting: list[tuple[torch.Tensor, list[str], torch.futures.Future]] = []

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
        state |= {f"residual.{name}": tensor for name, tensor in self.residual.items()}
        state |= {f"velocity.{name}": tensor for name, tensor in self.velocity.items()}
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

    def _exchange(self, buckets: list[tuple[torch.Tensor, list[str], torch.futures.Future]]) -> None:
        """Select, send and sum this step's gradient once every bucket is in; completes every bucket's future.
        Collective: one all-gather over all ranks."""
        slices = {}
        for buffer, names, _ in buckets:
            offset = 0
            for name in names:
                size = self.residual[name].numel()
                slices[name] = buffer[offset : offset + size]
                offset += size
        names = sorted(slices, key=self.order.__getitem__)
        gradient = torch.cat([slices[name] for name in names])
        accumulated = self._flat(self.residual, names)
        if self.momentum > 0:
            velocity = self._flat(self.velocity, names)
            velocity.mul_(self.momentum).add_(gradient)
            accumulated.add_(velocity)
        else:
            accumulated.add_(gradient)
        total = accumulated.numel()
        k = min(total, max(1, math.ceil(self.density_at(self.step) * total)))
        indices = torch.arange(total, device=accumulated.device) if k == total else accumulated.abs().topk(k).indices
        values = accumulated[indices].float() / self.world_size
        accumulated[indices] = 0  # sent: what stays is the residual for the next step
        self._unflat(self.residual, names, accumulated)
        if self.momentum > 0:
            velocity[indices] = 0  # momentum factor masking: a sent entry's momentum does not push again
            self._unflat(self.velocity, names, velocity)

        # Values and indices travel in one message: int32 indices reinterpreted as fp32 bits (no arithmetic).
        message = torch.cat([values, indices.to(torch.int32).view(torch.float32)])
        gathered = [torch.empty_like(message) for _ in range(self.world_size)]
        self.bytes_sent += all_gather_bytes(message.numel() * message.element_size(), self.world_size)
        work = dist.all_gather(gathered, message, async_op=True)

        def combine(done: torch.futures.Future) -> None:
            try:
                done.value()  # re-raises a failed all-gather
                summed = torch.zeros_like(gradient)
                for part in gathered:
                    summed.index_add_(0, part[k:].view(torch.int32).long(), part[:k].to(summed.dtype))
                offset = 0
                for name in names:
                    size = slices[name].numel()
                    slices[name].copy_(summed[offset : offset + size])
                    offset += size
            except BaseException as error:  # noqa: BLE001 - handed to DDP, which re-raises it in backward
                for _, _, future in buckets:
                    future.set_exception(error)
                return
            for buffer, _, future in buckets:
                future.set_result(buffer)

        work.get_future().then(combine)

    @staticmethod
    def _flat(store: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
        return torch.cat([store[name].reshape(-1) for name in names])

    @staticmethod
    def _unflat(store: dict[str, torch.Tensor], names: list[str], flat: torch.Tensor) -> None:
        offset = 0
        for name in names:
            tensor = store[name]
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
