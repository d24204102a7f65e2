"""PyTorch FSDP2 (``fully_shard``) on each of the model's blocks and on the root, over a mesh's data-parallel axes.

Collectives: before each block's forward (and again before its backward when ``stage=3``) an all-gather of its
parameters; after its backward a reduce-scatter of its gradients (on the last micro-batch of a step only: earlier
micro-batches accumulate unsharded gradients locally; with HSDP's replicas, then an all-reduce across them).
``stage=2`` keeps each block's gathered parameters from forward to backward (ZeRO-2-like: one all-gather per step,
more memory); ``stage=3`` frees them after forward (ZeRO-3). Between steps every rank holds only its shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from distrain.models.spec import spec_of
from distrain.precision.policy import PrecisionPolicy


def shard_blocks_and_root(
    model: nn.Module,
    mesh: DeviceMesh,
    precision: PrecisionPolicy,
    *,
    stage: int,
    cpu_offload: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """``fully_shard`` each of the model's blocks (its spec's units) and then ``model`` itself (its remaining
    parameters) over the 1-D ``mesh``; parameters become DTensors sharded on dim 0. ``model`` may be a pipeline
    stage (any of the blocks). ``ignored_params`` stay as they are (expert-parallel experts: no sharding, no
    gradient reduction by FSDP)."""
    mixed = MixedPrecisionPolicy(
        param_dtype=precision.compute_dtype if precision.uses_autocast else None, reduce_dtype=torch.float32
    )
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    options = {"mp_policy": mixed, "offload_policy": offload, "shard_placement_fn": _shard_placement(mesh)}
    if ignored_params:
        options["ignored_params"] = ignored_params
    for block in spec_of(model).block_modules(model).values():
        fully_shard(block, mesh=mesh, reshard_after_forward=stage == 3, **options)
    # The root's own parameters (embeddings, final norm, head) are used last in forward and first in backward:
    # resharding them after forward would only add an all-gather.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **options)
    return model


def _shard_placement(mesh: DeviceMesh) -> Callable[[nn.Parameter], Shard | None]:
    """Dim 0 (FSDP's default), except for a parameter whose dim 0 is smaller than the ranks sharding it (a mixture
    of experts' stacked experts): split that one on its largest dimension, so no rank is left without a share."""
    ranks = mesh.size(mesh.ndim - 1)  # the sharding axis: the last one (before it, HSDP's replicas)

    def placement(param: nn.Parameter) -> Shard | None:
        if param.dim() >= 2 and param.shape[0] < ranks:
            return Shard(max(range(param.dim()), key=lambda dim: param.shape[dim]))
        return None

    return placement
