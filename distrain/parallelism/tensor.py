"""``parallelism=tensor``: Megatron-style tensor parallelism with DTensor over all ranks.

In every block, q/k/v and the MLP's input projection are split by output columns (``ColwiseParallel``: each rank
computes ``n_heads / ranks`` heads and ``hidden / ranks`` MLP units) and the attention output and MLP output
projections by input rows (``RowwiseParallel``). By default embeddings, norms and the output head stay replicated, so
the logits are whole on every rank and the loss is computed as in one process.

Options:

- ``sequence_parallel``: between the attention and MLP sub-blocks, the residual stream, its norms and dropout are
  split along the sequence (Korthikanti et al. 2022): each rank holds ``seq_len / ranks`` positions there. The
  row-parallel outputs become reduce-scatters onto the sequence shards and each sub-block starts with an all-gather
  of its normed input, instead of one all-reduce per sub-block: the same bytes, a fraction of the activation memory.
  The final norm runs on sequence shards and the head is column-parallel over the vocabulary.
- ``loss_parallel``: the head is column-parallel and the logits stay split over the vocabulary; the cross-entropy
  runs on the shards (``torch.distributed.tensor.parallel.loss_parallel``: all-reduces of the per-token max and sum
  of exponentials, never the full logits). Otherwise the vocabulary shards are all-gathered before the loss.

Collectives: per block, two all-reduces of activations in forward and two in backward (or, with sequence
parallelism, two all-gathers and two reduce-scatters each way); DTensor's reductions of the gradient norm for
clipping. Every rank reads the same batch (no data parallelism inside pure tensor parallelism).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from distrain.parallelism.base import LocalBackwardStrategy, StrategyContext, scale_to_norm, squared_grad_norm

TP_AXIS = "tp"
SEQUENCE = Shard(1)  # activations are (batch, sequence, features)


def block_plan(sequence_parallel: bool) -> dict[str, object]:
    """The plan for one transformer block; with ``sequence_parallel`` its input and output are sequence shards."""
    plan: dict[str, object] = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=SEQUENCE if sequence_parallel else Replicate()),
        "mlp.w_in": ColwiseParallel(),
        "mlp.w_out": RowwiseParallel(output_layouts=SEQUENCE if sequence_parallel else Replicate()),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(
            input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        plan |= {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(), "attn": gather, "mlp": gather}
    return plan


def parallelize_model(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> nn.Module:
    """Split ``model`` over the 1-D ``mesh`` (in place): every one of ``model.blocks``, and with either option the
    head (column-parallel over the vocabulary). With ``sequence_parallel`` the first block splits its input along
    the sequence (a local slice, no communication) and the final norm runs on sequence shards. Without options
    ``model`` may be a pipeline stage; other parameters stay plain tensors, replicated."""
    for block in model.blocks.values():
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    if sequence_parallel:
        split = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(SEQUENCE,), use_local_output=True
        )
        parallelize_module(next(iter(model.blocks.values())), mesh, split)
        parallelize_module(model.norm, mesh, SequenceParallel())
    if sequence_parallel or loss_parallel:
        head = ColwiseParallel(
            input_layouts=SEQUENCE if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
        parallelize_module(model.head, mesh, head)
    return model


class TensorParallelStrategy(LocalBackwardStrategy):
    """Tensor parallelism of every transformer block over all ranks (a 1-D ``tp`` mesh).

    Args:
        sequence_parallel: norms, dropout and the residual stream split along the sequence (see module doc).
        loss_parallel: cross-entropy on vocabulary-sharded logits, without gathering them.
    """

    def __init__(self, *, name: str = "tensor", sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
        self.name, self.sequence_parallel, self.loss_parallel = name, sequence_parallel, loss_parallel

    def wrap(self, model: nn.Module, ctx: StrategyContext) -> nn.Module:
        mesh = init_device_mesh(ctx.env.device.type, (ctx.env.world_size,), mesh_dim_names=(TP_AXIS,))
        return parallelize_model(
            model, mesh, sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel
        )

    def loss_context(self) -> AbstractContextManager[None]:
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    @property
    def data_parallel(self) -> tuple[int, int]:
        return 0, 1  # every rank reads the same batch

    def clip_gradients(self) -> torch.Tensor:
        """Norm over sharded (DTensor) and replicated gradients alike: each sharded gradient's norm is reduced over
        the mesh by DTensor; replicated gradients are identical on every rank and counted once."""
        self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return scale_to_norm(grads, squared_grad_norm(grads, self.device), self.ctx.grad_clip_norm)
