"""Optimizer builders. Each takes ``named_parameters`` (after the strategy wrapped or sharded the model)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def decay_groups(named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, object]]:
    """Two parameter groups: matrices decay, vectors (biases, norm scales) do not; frozen parameters are left out."""
    decay, no_decay = [], []
    for _, param in named_parameters:
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _foreach(groups: list[dict[str, object]]) -> bool | None:
    """False when tensor-parallel DTensors and plain tensors share the optimizer (its fused multi-tensor kernels,
    the default on GPUs, refuse such a mix); None (torch's default) otherwise."""
    kinds = {isinstance(p, DTensor) for group in groups for p in group["params"]}
    return False if len(kinds) > 1 else None


def adamw(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    *,
    lr: float,
    betas: Sequence[float],
    eps: float,
    weight_decay: float,
) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only."""
    groups = decay_groups(named_parameters, weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, foreach=_foreach(groups))


def sgd(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
) -> torch.optim.SGD:
    """SGD with (optionally Nesterov) momentum and L2 weight decay on matrices only."""
    groups = decay_groups(named_parameters, weight_decay)
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, foreach=_foreach(groups))
