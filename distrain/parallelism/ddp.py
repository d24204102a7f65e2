"""``parallelism=ddp``: DistributedDataParallel."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrain.checkpoint.steps import checkpoint_world_size
from distrain.parallelism.base import LocalBackwardStrategy, StrategyContext
from distrain.parallelism.capabilities import Capabilities
from distrain.parallelism.layout import Layout

log = logging.getLogger(__name__)


class DDPStrategy(LocalBackwardStrategy):
    """Replicated parameters; gradients averaged over all ranks by the ``comm`` option's hook.

    Collectives: a broadcast of parameters from rank 0 when wrapping; during the backward of the last
    micro-batch of each step, the comm hook's collectives per gradient bucket (``comm=default``: one ring
    all-reduce), overlapped with backward. Earlier micro-batches run under ``no_sync`` and accumulate locally,
    so accumulation adds no communication. Under ``comm=topk``'s update feedback (``comm.local_steps``) the hook
    sends nothing; instead one all-reduce of a scalar (the clipping norm) after backward, and after the optimizer
    step the exchange of updates (``distrain.comm.topk_update``).
    """

    capabilities = Capabilities(comm_hooks=True, memory_formula="ddp", replica_groups=True)

    @staticmethod
    def resolve_layout(parallelism: Any, world_size: int, ranks_per_node: int | None = None, **_: Any) -> Layout:
        """Every rank data parallel, each holding the whole model."""
        return Layout(dp=world_size)

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
        ctx.comm.register(ddp, ctx.env, ctx.clock, on_launch=self.mark_comm_launch)
        return ddp

    def gradient_sync(self, enabled: bool) -> AbstractContextManager[None]:
        return nullcontext() if enabled else self.model.no_sync()

    def replicas(self) -> dist.ProcessGroup | None:
        # Every rank holds every parameter; but when each rank's optimizer steps on its own gradient
        # (comm.local_steps), their updates differ and an optimizer must not share work (Muon) over them.
        return None if self.ctx.comm.local_steps else dist.group.WORLD

    _with_comm_state = True  # whether checkpoints include the comm option's per-rank state

    def own_optimizer_key(self) -> str:
        # Under comm.local_steps every rank's optimizer has its own state (it stepped on its own gradients).
        return f"optimizer_rank{self.ctx.env.rank}" if self.ctx.comm.local_steps else "optimizer"

    def _state_dict(self) -> dict[str, Any]:
        # Compression state (error feedback) differs per rank: each rank saves it under its own key.
        state = super()._state_dict()
        if self._with_comm_state and (comm_state := self.ctx.comm.state_dict()):
            state[f"comm_rank{self.ctx.env.rank}"] = comm_state
        return state

    def replica_state(self) -> dict[str, Any]:
        # The comm option's state travels under its own key there, when the option needs it (base class).
        self._with_comm_state = False
        try:
            return super().replica_state()
        finally:
            self._with_comm_state = True

    def load_checkpoint(self, path: Path, extra: dict[str, Any]) -> dict[str, Any]:
        """Also restores the comm option's state when the checkpoint has it for this rank and was written by
        the same world size (a residual belongs to one rank's data shard) with the same keys (the same option and
        top-k feedback); otherwise that state starts empty."""
        from distrain.checkpoint.data_only import load_dcp_metadata  # imports DCP: only when resuming

        saved_keys = load_dcp_metadata(path / ".metadata").state_dict_metadata
        # Every key this option keeps must be there: another comm option or top-k feedback saves other keys.
        wanted = {f"comm_rank{self.ctx.env.rank}.{key}" for key in self.ctx.comm.state_dict()}
        restored = checkpoint_world_size(path) == self.ctx.env.world_size and bool(wanted) and wanted <= set(saved_keys)
        if self.ctx.comm.state_dict() and not restored and self.ctx.env.rank == 0:
            log.warning(
                "comm=%s: %s has no compression state for this option and world size (another comm option or "
                "feedback, or another world size saved it); it starts empty",
                self.ctx.comm.name,
                path,
            )
        self._with_comm_state = restored
        try:
            loaded = super().load_checkpoint(path, extra)
        finally:
            self._with_comm_state = True
        self.ctx.comm.on_resume(self.scheduler.last_epoch, restored)
        return loaded
