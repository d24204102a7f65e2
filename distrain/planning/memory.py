"""Model-state memory per rank: measured from the tensors a rank holds, and predicted by the ZeRO formulas.

Measured bytes count each distinct storage once (gradient bucket views, flat buffers and views into them are not
double counted); sharded tensors (DTensor, DeepSpeed partitions) count only their local shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from omegaconf import DictConfig
from torch import nn

from distrain.optim.capabilities import optimizer_capabilities
from distrain.parallelism.capabilities import capabilities_of
from distrain.parallelism.dtensor import is_dtensor
from distrain.parallelism.layout import Layout


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes this rank holds for parameters, gradients and optimizer state (including fp32 master copies).

    ``buffers`` (communication buckets and other scratch space a strategy keeps) is reported but is not model
    state, so it is not part of ``total``.
    """

    params: int
    grads: int
    optimizer: int
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return asdict(self) | {"total": self.total}


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class StorageCounter:
    """Sums storage bytes over tensors, counting each storage once across all categories."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()

    def bytes(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None or not isinstance(tensor, torch.Tensor):
                continue
            tensor = local(tensor)
            if tensor.device.type == "meta" or tensor.numel() == 0:
                continue
            key = _storage_key(tensor)
            if key[0] != 0 and key not in self.seen:
                self.seen.add(key)
                total += key[1]
        return total


def reachable_tensors(
    root: object, *, skip: tuple[type, ...] = (), max_depth: int = 4
) -> list[tuple[str, torch.Tensor]]:
    """Tensors reachable from ``root`` through attributes, lists, tuples and dicts, with the path that found them.

    Used to account for what an opaque optimizer (DeepSpeed's ZeRO optimizers) holds. Objects of the ``skip``
    types are not entered; each object is visited once.
    """
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    frontier: list[tuple[str, object, int]] = [("", root, 0)]
    while frontier:
        path, obj, depth = frontier.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append((path, obj))
            continue
        if depth >= max_depth or isinstance(obj, skip):
            continue
        if isinstance(obj, dict):
            children = [(f"{path}[{key!r}]", value) for key, value in obj.items()]
        elif isinstance(obj, (list, tuple)):
            children = [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            children = [(f"{path}.{key}", value) for key, value in vars(obj).items()]
        else:
            continue
        frontier.extend((child_path, child, depth + 1) for child_path, child in children)
    return found


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def measure_torch_model_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> ModelStateBytes:
    """Parameters, their ``.grad`` and the optimizer's state tensors, as held on this rank right now."""
    counter = StorageCounter()
    params = list(model.parameters())
    return ModelStateBytes(
        params=counter.bytes(params),
        grads=counter.bytes(p.grad for p in params),
        optimizer=counter.bytes(optimizer_state_tensors(optimizer)),
    )


def optimizer_state_bytes_per_param(optimizer: DictConfig) -> int:
    """fp32 optimizer-state bytes per parameter, as the optimizer declares them (AdamW: two moments; SGD and Muon:
    one buffer while momentum > 0)."""
    return optimizer_capabilities(optimizer).state_bytes_per_param(optimizer)


def predicted_model_state(
    *,
    strategy: str,
    stage: int | None,
    num_params: int,
    world_size: int,
    optimizer_bytes: int,
    low_precision: bool,
    master_copy: bool,
) -> ModelStateBytes:
    """Per-rank parameter, gradient and optimizer-state bytes predicted by Rajbhandari et al. (2019), generalised
    over the optimizer.

    ``low_precision``: 2-byte parameters and gradients (DeepSpeed bf16/fp16), else 4-byte. ``master_copy``: the
    optimizer also keeps a 4-byte fp32 copy of the parameters (DeepSpeed always does, also in fp32; torch-native
    strategies train the fp32 parameters directly). Mixed-precision Adam under DeepSpeed is 2 + 2 + (8 + 4) = 16
    bytes per parameter, fp32 Adam under DDP/FSDP 4 + 4 + 8 = 16, fp32 Adam under DeepSpeed 4 + 4 + 12 = 20.
    DeepSpeed's stage 1 runs stage 2's code and, like it, keeps only its partition of the reduced gradients (the
    paper's stage 1 keeps them whole; ``benchmarks/memory_by_strategy.py`` measures stage 1 = stage 2). FSDP stages
    2 and 3 both shard all three at rest; stage 2 only keeps parameters gathered between forward and backward.
    """
    psi, n = num_params, world_size
    param_b, grad_b = (2, 2) if low_precision else (4, 4)
    opt_b = optimizer_bytes + (4 if master_copy else 0)
    # (parameters, gradients, optimizer state) as (replicated, partitioned) per-parameter bytes
    layouts = {
        ("zero", 1): ((param_b, 0), (0, grad_b), (0, opt_b)),
        ("zero", 2): ((param_b, 0), (0, grad_b), (0, opt_b)),
        ("zero", 3): ((0, param_b), (0, grad_b), (0, opt_b)),
        ("fsdp", 2): ((0, param_b), (0, grad_b), (0, opt_b)),
        ("fsdp", 3): ((0, param_b), (0, grad_b), (0, opt_b)),
    }
    replicated = ((param_b, 0), (grad_b, 0), (opt_b, 0))
    params, grads, optimizer = (
        int(whole * psi + part * psi / n) for whole, part in layouts.get((strategy, stage), replicated)
    )
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer)


def memory_formula_of(cfg: DictConfig, layout: Layout) -> tuple[str, int, int | None] | None:
    """The ZeRO formulas' name for a data-parallel layout, the ranks it shards (or replicates) over and its stage:
    the strategy's declared formula when it has no mesh (single, ddp, zero), else ``fsdp`` over the resolved dp when
    dp shards (replicas hold copies), ``ddp`` when it replicates; None for model-parallel layouts, which
    ``dry_run=true`` plans."""
    if layout.model_parallel:
        return None
    formula = capabilities_of(cfg.parallelism).memory_formula
    if formula:
        return (formula, layout.world_size, layout.sharding_stage)
    if layout.dp_holds != "shard":
        return ("ddp", layout.world_size, None)
    return ("fsdp", layout.dp, layout.sharding_stage)


def predicted_model_state_bytes(**layout: object) -> int:
    """``predicted_model_state(...).total``: the per-rank model-state bytes of the ZeRO formulas."""
    return predicted_model_state(**layout).total


def predicted_state_for_summary(cfg: DictConfig, layout: Layout, num_params: int) -> int | None:
    """summary.json's ``predicted_model_state_bytes``: the ZeRO formulas for a data-parallel layout, None for a
    model-parallel one (``dry_run=true`` plans those)."""
    formula = memory_formula_of(cfg, layout)
    if formula is None:
        return None
    name, ranks, stage = formula
    zero = capabilities_of(
        cfg.parallelism
    ).deepspeed_optimizer  # DeepSpeed keeps an fp32 master copy of low-precision weights
    return predicted_model_state_bytes(
        strategy=name,
        stage=stage,
        num_params=num_params,
        world_size=ranks,
        optimizer_bytes=optimizer_state_bytes_per_param(cfg.optimizer),
        low_precision=zero and cfg.precision.compute_dtype != "float32",
        master_copy=zero,
    )
