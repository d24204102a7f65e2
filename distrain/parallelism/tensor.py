"""Megatron-style tensor parallelism with DTensor on a mesh's ``tp`` axis (``parallelism=tensor``: every rank;
``parallelism.tp`` of any mesh layout).

The model's spec gives the plan, keyed to its own module names (``distrain.models.tensor_plans`` for the built-in
decoders): in every block, q/k/v and the MLP's input projections are split by output columns (``ColwiseParallel``:
each rank computes ``n_heads / ranks`` heads and ``hidden / ranks`` MLP units) and the attention output and MLP
output projections by input rows (``RowwiseParallel``). By default embeddings, norms and the output head stay
replicated, so the logits are whole on every rank and the loss is computed as in one process.

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

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from distrain.models.spec import spec_of


def parallelize_model(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> nn.Module:
    """Split ``model`` over the 1-D ``mesh`` (in place) by its spec's tensor-parallel plan: every block, and with
    either option the head (column-parallel over the vocabulary) and, with ``sequence_parallel``, the first block's
    input (a local slice along the sequence, no communication) and the final norm. Without options ``model`` may be
    a pipeline stage; parameters outside the plan stay plain tensors, replicated."""
    plan = spec_of(model).tensor_plan_for(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    return parallelize_module(model, mesh, plan)
