"""Activation checkpointing: chosen transformer blocks keep only their input in forward and recompute the rest in
backward, trading about one extra forward per block for the memory of its activations.

``apply_activation_checkpointing`` runs once on the unwrapped model, before any strategy wraps it. It replaces each
chosen block's ``forward`` by a checkpointed call of the original, without renaming modules or parameters, so
checkpoints, tensor-parallel plans (which address modules inside each block), FSDP's per-block sharding,
DeepSpeed's per-module hooks and pipeline stages see the same model. The order torchtitan documents (tensor
parallelism, then activation checkpointing, then FSDP) holds by construction: the recomputation happens inside
the block, after FSDP has gathered its parameters for backward and with the tensor-parallel submodules' own hooks
running again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from distrain.models.spec import spec_of

MODES = ("none", "full", "selective")


def chosen_blocks(num_blocks: int, mode: str, every: int) -> list[int]:
    """Indices of the blocks to recompute: none, all, or blocks 0, every, 2 * every, ... (``selective``)."""
    if mode == "none":
        return []
    if mode == "full":
        return list(range(num_blocks))
    return list(range(0, num_blocks, every))


def _recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing is kept for backward anyway
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> list[str]:
    """Make the chosen ones of the model's blocks (its spec's units: the whole model when the spec names no
    blocks) recompute their activations in backward, in place; returns their module paths. ``mode``: ``none``,
    ``full`` (every block) or ``selective`` (every ``every``-th block, starting with the first)."""
    spec = spec_of(model)
    units, names = spec.units(model), spec.unit_names(model)
    chosen = chosen_blocks(len(units), mode, every)
    for index in chosen:
        block = units[index]
        if not getattr(block, "recomputes", False):  # applied once, however often asked (e.g. globally and per stage)
            block.forward = functools.partial(_recomputed, block.forward)
            block.recomputes = True
    return [names[index] for index in chosen]


def saved_activation_bytes(
    model: nn.Module,
    inputs: torch.Tensor,
    *,
    loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    backward: bool = True,
) -> int:
    """Bytes autograd keeps for backward during one forward of ``model`` on ``inputs`` (and ``loss`` of its output),
    parameters excluded: the activation memory activation checkpointing reduces. Each kept tensor counts once, with
    the whole tensor it is a view of; a DTensor counts its local shard. Works on the meta device (shapes only), which
    is how a dry run estimates activations of models too large for this machine. ``backward``: also run backward
    (and clear the gradients), as a training step would."""
    from torch.distributed.tensor import DTensor

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    # The local views stay referenced while counting: a discarded temporary's id could be reused by an activation,
    # which would then be skipped as if it were a parameter (measured: two plans of one layout differed by 0.3%).
    local_views = [local(p) for p in model.parameters()]
    parameters = {id(p) for p in model.parameters()} | {id(view) for view in local_views}
    kept: dict[int, tuple[torch.Tensor, int]] = {}  # holding the tensor keeps its id unique while counting

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if not parameters.intersection((id(tensor), id(base))):
            shard = local(base)
            kept[id(base)] = (base, shard.numel() * shard.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(inputs)
        out = loss(out) if loss is not None else out.float().sum()
    if backward:
        out.backward()
        model.zero_grad(set_to_none=True)
    return sum(nbytes for _, nbytes in kept.values())
