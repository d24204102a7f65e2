"""Optimizer builders. Each takes ``named_parameters`` (this rank's, after the strategy wrapped or sharded the model)
and ``replicated_over`` (the process group over which every rank holds the same whole parameters, as under DDP;
None: no such group), and builds parameter groups by rule (``distrain.optim.groups``) from the ``roles`` of the
unwrapped model (bound by ``distrain.trainer.build``; None: roles by name and shape only: bias, matrix, vector)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from distrain.optim.capabilities import OptimizerCapabilities
from distrain.optim.groups import GroupRules, canonical_name, param_groups
from distrain.parallelism.dtensor import is_dtensor

if TYPE_CHECKING:
    from distrain.optim.muon import Muon

NamedParameters = Iterable[tuple[str, nn.Parameter]]


def shape_roles(named_parameters: Sequence[tuple[str, nn.Parameter]]) -> dict[str, str]:
    """Roles without a model spec: bias by name, matrix for 2 or more dimensions, vector otherwise."""
    roles = {}
    for name, param in named_parameters:
        canonical = canonical_name(name)
        is_bias = canonical.rsplit(".", 1)[-1] == "bias"
        roles[canonical] = "bias" if is_bias else ("matrix" if param.dim() >= 2 else "vector")
    return roles


def _groups(
    named_parameters: NamedParameters, roles: Mapping[str, str] | None, rules: GroupRules, lr: float
) -> list[dict[str, Any]]:
    named = list(named_parameters)
    return param_groups(named, shape_roles(named) if roles is None else roles, rules, lr)


def _foreach(groups: list[dict[str, Any]]) -> bool | None:
    """False when tensor-parallel DTensors and plain tensors share the optimizer (its fused multi-tensor kernels,
    the default on GPUs, refuse such a mix); None (torch's default) otherwise."""
    kinds = {is_dtensor(p) for group in groups for p in group["params"]}
    return False if len(kinds) > 1 else None


def _implementation(groups: list[dict[str, Any]]) -> dict[str, bool | None]:
    """torch's fused AdamW kernel (one pass over each tensor, what torchtitan uses) where every parameter is a plain
    floating-point tensor on a CPU or CUDA device: 0.8 ms a step against 2.4-3.0 ms for the per-tensor loop torch
    picks on CPUs (nanoGPT's recipe's 0.8M parameters). Sharded and tensor-parallel layouts (DTensors) keep torch's
    own choice (``_foreach``)."""
    params = [p for group in groups for p in group["params"]]
    if all(not is_dtensor(p) and p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
        return {"fused": True}
    return {"foreach": _foreach(groups)}


def adamw(
    named_parameters: NamedParameters,
    *,
    lr: float,
    betas: Sequence[float],
    eps: float,
    weight_decay: float,
    no_decay: Sequence[str] = (),
    lr_multipliers: Mapping[str, float] | None = None,
    roles: Mapping[str, str] | None = None,
    replicated_over: dist.ProcessGroup | None = None,
) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on every parameter but those the ``no_decay`` rules name."""
    del replicated_over  # every rank updates all of its parameters
    groups = _groups(named_parameters, roles, GroupRules(weight_decay, no_decay, lr_multipliers), lr)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **_implementation(groups))


def sgd(
    named_parameters: NamedParameters,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    no_decay: Sequence[str] = (),
    lr_multipliers: Mapping[str, float] | None = None,
    roles: Mapping[str, str] | None = None,
    replicated_over: dist.ProcessGroup | None = None,
) -> torch.optim.SGD:
    """SGD with (optionally Nesterov) momentum and L2 weight decay on all but the ``no_decay`` rules' parameters."""
    del replicated_over
    groups = _groups(named_parameters, roles, GroupRules(weight_decay, no_decay, lr_multipliers), lr)
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, foreach=_foreach(groups))


def muon(
    named_parameters: NamedParameters,
    *,
    lr: float,
    betas: Sequence[float],
    eps: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    bucket_mb: float,
    muon: Sequence[str] = ("matrix",),
    no_decay: Sequence[str] = (),
    lr_multipliers: Mapping[str, float] | None = None,
    roles: Mapping[str, str] | None = None,
    replicated_over: dist.ProcessGroup | None = None,
) -> Muon:
    """Muon for the parameters the ``muon`` rules name, AdamW (``betas``, ``eps``) for the rest, in one optimizer;
    Muon's work is shared over ``replicated_over`` (see ``distrain.optim.muon``)."""
    groups = _groups(named_parameters, roles, GroupRules(weight_decay, no_decay, lr_multipliers, muon), lr)
    from distrain.optim.muon import Muon  # here: it imports DTensor, a second of start-up AdamW does not need

    return Muon(
        groups,
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        bucket_bytes=int(bucket_mb * 2**20),
        replicated_over=replicated_over,
        foreach=_foreach(groups),
    )


adamw.capabilities = OptimizerCapabilities(adaptive=True, moments=2)
sgd.capabilities = OptimizerCapabilities(linear=True, momentum_buffer=True)
muon.capabilities = OptimizerCapabilities(momentum_buffer=True)
