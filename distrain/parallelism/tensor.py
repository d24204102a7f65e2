"""``parallelism=tensor``: Megatron-style tensor parallelism with DTensor over all ranks.

In every block, q/k/v and the MLP's input projection are split by output columns (``ColwiseParallel``: each rank
computes ``n_heads / ranks`` heads and ``hidden / ranks`` MLP units) and the attention output and MLP output
projections by input rows (``RowwiseParallel``). Embeddings, norms and the output head stay replicated, so the logits
are whole on every rank and the loss is computed as in one process.

Collectives: one all-reduce of activations after each row-parallel projection in forward (two per block), and the
matching ones for input gradients in backward; one all-reduce of the squared gradient norm for clipping. Every rank
reads the same batch (no data parallelism inside pure tensor parallelism).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from distrain.parallelism.base import LocalBackwardStrategy, StrategyContext, scale_to_norm

TP_AXIS = "tp"
BLOCK_PLAN = {
    "attn.wq": ColwiseParallel,
    "attn.wk": ColwiseParallel,
    "attn.wv": ColwiseParallel,
    "attn.wo": RowwiseParallel,
    "mlp.w_in": ColwiseParallel,
    "mlp.w_out": RowwiseParallel,
}


class TensorParallelStrategy(LocalBackwardStrategy):
    """Tensor parallelism of every transformer block over all ranks (a 1-D ``tp`` mesh)."""

    def __init__(self, *, name: str = "tensor") -> None:
        self.name = name

    def wrap(self, model: nn.Module, ctx: StrategyContext) -> nn.Module:
        mesh = init_device_mesh(ctx.env.device.type, (ctx.env.world_size,), mesh_dim_names=(TP_AXIS,))
        for block in model.blocks.values():
            parallelize_module(block, mesh, {path: style() for path, style in BLOCK_PLAN.items()})
        return model

    @property
    def data_parallel(self) -> tuple[int, int]:
        return 0, 1  # every rank reads the same batch

    def clip_gradients(self) -> torch.Tensor:
        """Norm over sharded (DTensor) and replicated gradients alike: each sharded gradient's norm is reduced over
        the mesh by DTensor; replicated gradients are identical on every rank and counted once."""
        self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        squared = torch.zeros((), device=self.device, dtype=torch.float32)
        for grad in grads:
            norm = grad.detach().float().norm()
            squared += (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
        return scale_to_norm(grads, squared, self.ctx.grad_clip_norm)
