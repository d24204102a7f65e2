"""Megatron-style tensor-parallel plans for pre-norm decoders, built from the module names a family passes in.

Within each block the projections that open a sub-layer (q/k/v, the MLP's input projections) are split by output
columns (``ColwiseParallel``: each rank computes a share of the heads and hidden units) and those that close it
by input rows (``RowwiseParallel``: one all-reduce of the sub-layer's output, or a reduce-scatter onto sequence
shards with sequence parallelism). With ``sequence_parallel`` the residual stream and the norms hold
``seq_len / ranks`` positions: the first block's input is sliced (no communication), every sub-layer gathers its
normed input, the final norm runs on shards and the head is column-parallel over the vocabulary. With
``loss_parallel`` the head's logits stay split over the vocabulary for the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

SEQUENCE_DIM = 1  # activations are (batch, sequence, features)


@dataclass(frozen=True)
class DecoderNames:
    """A pre-norm decoder's module names, relative to its root (``blocks``) or to one block (the rest)."""

    blocks: str  # the ModuleDict of blocks
    column: Sequence[str]  # projections opening a sub-layer
    row: Sequence[str]  # projections closing one
    norms: Sequence[str]  # norms in front of the sub-layers
    sublayers: Sequence[str]  # the sub-layers those norms feed (attention, MLP)
    final_norm: str
    head: str


def _holds(model: nn.Module, path: str) -> bool:
    try:
        return model.get_submodule(path) is not None
    except AttributeError:  # a pipeline stage without it (set to None) or a path through a removed module
        return False


def decoder_plan(
    model: nn.Module, names: DecoderNames, *, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, object]:
    """The plan for ``model`` (whole, or a pipeline stage holding some blocks and maybe the final norm and head):
    module path -> ``ParallelStyle``."""
    # Imported here: DTensor's import costs most of a second, which a run without tensor parallelism never pays
    # (the model families import this module with their specs, and the launcher imports those).
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    sequence = Shard(SEQUENCE_DIM)
    blocks = model.get_submodule(names.blocks)
    reduced = sequence if sequence_parallel else Replicate()
    plan: dict[str, object] = {}
    for key in blocks:
        prefix = f"{names.blocks}.{key}"
        plan |= {f"{prefix}.{name}": ColwiseParallel() for name in names.column}
        plan |= {f"{prefix}.{name}": RowwiseParallel(output_layouts=reduced) for name in names.row}
        if sequence_parallel:
            gather = PrepareModuleInput(
                input_layouts=(sequence,), desired_input_layouts=(Replicate(),), use_local_output=True
            )
            plan |= {f"{prefix}.{name}": SequenceParallel() for name in names.norms}
            plan |= {f"{prefix}.{name}": gather for name in names.sublayers}
    holds_head = _holds(model, names.head)
    if sequence_parallel:
        first = f"{names.blocks}.{next(iter(blocks))}"
        plan[first] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(sequence,), use_local_output=True
        )
        plan[names.final_norm] = SequenceParallel()
    if holds_head and (sequence_parallel or loss_parallel):
        plan[names.head] = ColwiseParallel(
            input_layouts=sequence if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan
