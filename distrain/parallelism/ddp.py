"""``parallelism=ddp``: DistributedDataParallel."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrain.parallelism.base import LocalBackwardStrategy, StrategyContext


class DDPStrategy(LocalBackwardStrategy):
    """Replicated parameters; gradients all-reduced (averaged) over all ranks.

    Collectives: a broadcast of parameters from rank 0 when wrapping; during the backward of the last
    micro-batch of each step, one all-reduce per gradient bucket, overlapped with backward. Earlier micro-batches
    run under ``no_sync`` and accumulate locally, so accumulation adds no communication.
    """

    def __init__(self, *, name: str = "ddp", find_unused_parameters: bool) -> None:
        self.name = name
        self.find_unused_parameters = find_unused_parameters

    def wrap(self, model: nn.Module, ctx: StrategyContext) -> nn.Module:
        ddp = DistributedDataParallel(
            model,
            device_ids=[ctx.env.device.index] if ctx.env.device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters,
            **ctx.comm.ddp_kwargs(),
        )
        ctx.comm.register(ddp, on_launch=self.mark_comm_launch)
        return ddp

    def gradient_sync(self, enabled: bool) -> AbstractContextManager[None]:
        return nullcontext() if enabled else self.model.no_sync()
