"""Activation checkpointing: chosen transformer blocks keep only their input in forward and recompute the rest in
backward, trading about one extra forward per block for the memory of its activations.

``apply_activation_checkpointing`` runs once on the unwrapped model, before any strategy wraps it. It replaces each
chosen block's ``forward`` by a checkpointed call of the original, without renaming modules or parameters, so
checkpoints, tensor-parallel plans (which address ``attn.wq`` inside each block), FSDP's per-block sharding,
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
    """Make the chosen ones of ``model.blocks`` (a ModuleDict) recompute their activations in backward, in place;
    returns their names. ``mode``: ``none``, ``full`` (every block) or ``selective`` (every ``every``-th block,
    starting with the first)."""
    names = list(model.blocks.keys())
    chosen = [names[i] for i in chosen_blocks(len(names), mode, every)]
    for name in chosen:
        block = model.blocks[name]
        if not getattr(block, "recomputes", False):  # applied once, however often asked (e.g. globally and per stage)
            block.forward = functools.partial(_recomputed, block.forward)
            block.recomputes = True
    return chosen


def saved_activation_bytes(model: nn.Module, inputs: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one forward of ``model`` on ``inputs``, parameters excluded: the
    activation memory activation checkpointing reduces (a device-independent measure; on CUDA the allocator's peak
    shows the same)."""
    parameters = {p.data_ptr() for p in model.parameters()}
    kept = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        if tensor.data_ptr() not in parameters:
            kept += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs).float().sum().backward()
    model.zero_grad(set_to_none=True)
    return kept
