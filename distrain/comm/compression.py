"""Gradient compression as DDP communication hooks: cast (bf16/fp16), PowerSGD, and top-k with error feedback.

Each option changes only how one gradient bucket is averaged over ranks (``average_bucket``); DDP's bucketing,
overlap with backward and ``no_sync`` accumulation are unchanged, so every option composes with gradient
accumulation (the hook sees the step's accumulated gradient once). Top-k lives in ``distrain.comm.topk``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from distrain.comm.checks import check_powersgd
from distrain.comm.quality import CompressedComm
from distrain.comm.traffic import all_reduce_bytes
from distrain.launch.process_group import DistEnv

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from distrain.config.options import Placement

CAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class CastComm(CompressedComm):
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


class PowerSGDComm(CompressedComm):
    """``comm=powersgd``: PyTorch's PowerSGD hook (Vogels et al. 2019). Each gradient matrix M (n x m) is sent
    as two rank-r factors: all-reduce of P = M Q (n x r), orthogonalisation, all-reduce of Q = M^T P (m x r);
    vectors and matrices too small to gain are all-reduced whole. The first ``start_iter`` steps all-reduce
    densely (DDP rebuilds its buckets after the first step, and PowerSGD's memories are kept per bucket).

    After a checkpoint resume the error feedback and warm-start memories start empty (they are keyed by DDP
    bucket, and buckets are rebuilt after the first step of every process), and that first step is dense.
    """

    @classmethod
    def check_config(cls, cfg: DictConfig, placement: Placement) -> list[str]:
        return [*super().check_config(cfg, placement), *check_powersgd(cfg)]

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
        super().prepare(model, env)
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
