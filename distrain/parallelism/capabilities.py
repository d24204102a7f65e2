"""What a parallelism strategy can do, declared beside its class (a ``capabilities`` attribute) and asked by the
checks, the planner, the describe line and checkpoint preflight instead of comparing option names.

A strategy of the user's own (``parallelism._target_`` in their package) declares the same attribute; one that
declares none gets ``Capabilities()``: several ranks, DCP checkpoints that reshard, no comm hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig


@dataclass(frozen=True)
class Capabilities:
    """One strategy's answers. Read from its config with ``capabilities_of``, from an instance as an attribute."""

    one_rank: bool = False  # runs exactly one process
    # Composes its degrees on a device mesh (tp, pp, cp, ep, HSDP): its config is hybrid's schema, and the checks of
    # its keys (fsdp_stage, dp_mode, dp, ...) apply.
    device_mesh: bool = False
    comm_hooks: bool = False  # takes a DDP communication hook (the comm group's options other than default)
    checkpoint_format: str = "dcp"  # what its checkpoints hold: "dcp" (torch.distributed.checkpoint), "deepspeed"
    reshards_on_resume: bool = True  # resumes a checkpoint saved by another number of ranks
    async_save: bool = True  # checkpoint.async_save: writes a save in the background while training goes on
    can_skip_step: bool = True  # trainer.on_nonfinite=skip: drops a step's update
    zero_stages: tuple[int, ...] = ()  # the ZeRO stages parallelism.stage takes: how it shards (none: not by stage)
    # The ZeRO paper's model-state formula it follows without a device mesh ("single", "ddp", "zero": by stage), for
    # summary.json's prediction; None: a mesh layout's degrees decide, or the dry run plans it.
    memory_formula: str | None = None
    # The optimizer steps inside DeepSpeed's engine: DeepSpeed's own Muon and clipping, an fp32 master copy of the
    # weights under low precision.
    deepspeed_optimizer: bool = False
    # Runs inside a torchft replica group (ft=torchft): plain tensors whose gradients the groups average, its state
    # handed to a healing group in memory.
    replica_groups: bool = False


def capabilities_of(parallelism: DictConfig | Any) -> Capabilities:
    """The capabilities the strategy ``parallelism._target_`` names declares (a config node; also a saved one)."""
    target = parallelism.get("_target_") if isinstance(parallelism, DictConfig) else None
    if not target:
        return Capabilities()
    try:
        strategy = get_object(str(target))
    except Exception:  # noqa: BLE001 - an unimportable target is refused by validation, with its own line
        return Capabilities()
    return declared(strategy)


def declared(strategy: object) -> Capabilities:
    """A strategy's (class, factory or instance) declared capabilities, or the defaults."""
    found = getattr(strategy, "capabilities", None)
    return found if isinstance(found, Capabilities) else Capabilities()
