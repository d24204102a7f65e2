"""Gradient norms and clipping shared by the strategies: over DTensors on several meshes, over each rank's share,
or over ranks that step on their own gradients."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from distrain.parallelism.dtensor import full_value


def squared_grad_norm(grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared L2 norms of ``grads`` as one fp32 scalar on ``device``. A sharded gradient (DTensor: FSDP
    or tensor-parallel) counts with its full norm (DTensor reduces it over its mesh: one all-reduce each); a plain
    gradient counts as this rank's copy. Replicated plain gradients are thus counted once per rank that holds them,
    and the caller sums over ranks holding different parameters (pipeline stages)."""
    squared = torch.zeros((), device=device, dtype=torch.float32)
    for grad in grads:
        norm = grad.detach().float().norm()
        squared += full_value(norm) ** 2
    return squared


def clip_grad_norm_across_meshes(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) for gradients that are DTensors on different meshes (FSDP's on the
    dp mesh, the experts' on the ep mesh), which the torch function refuses (its stack and foreach multiply need one
    mesh). Expert parallelism calls it after the experts' gradient sync. Returns the total norm before clipping, a
    plain 0-dim tensor on the gradients' device.

    Collectives: one all_reduce per mesh (each group's norm from its shards, over that mesh). Replicas of the same
    expert shard hold equal gradients after the sync, so the ep mesh's norm counts each expert once.
    """
    groups: dict[object, list[nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    if not groups:
        return torch.zeros(())
    norms = []
    for params in groups.values():
        norm = get_total_norm([param.grad for param in params])
        norms.append(full_value(norm))
    total = torch.stack(norms).norm()
    for params in groups.values():
        clip_grads_with_norm_(params, max_norm, total)
    return total


def scale_to_norm(grads: Sequence[torch.Tensor], squared_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Clip ``grads`` in place to a global L2 norm of ``max_norm`` (0: no clipping) given their summed squared norm
    over every rank's share; returns the norm before clipping."""
    norm = squared_norm.sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale)
    return norm


def clip_local_gradients(parameters: Iterable[nn.Parameter], max_norm: float, world_size: int) -> torch.Tensor:
    """Clipping when each rank steps on its own gradient (``comm.local_steps``): the norm is the root-mean-square
    of the ranks' gradient norms, the same on every rank (one all-reduce of a scalar on the default group), so all
    ranks scale alike and agree on a non-finite norm; the threshold is ``max_norm / sqrt(world_size)`` (Deep
    Gradient Compression's local clipping: a rank's gradient is noisier than the mean). Returns that norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squared = get_total_norm(grads).float() ** 2
    dist.all_reduce(squared)
    return scale_to_norm(grads, squared / world_size, max_norm / world_size**0.5).detach()
