"""Each option's own checks. The ``_target_`` of a config group's option (a class or function, distrain's or one
in the user's package) may declare ``check_config(cfg, placement) -> list[str]``: validation calls it once, in
the launching process before any rank starts, after the checks every option shares. It raises
``distrain.config.checks.ConfigError`` for a value it cannot take and returns warning lines for the rest.

A target that cannot be imported is refused here in one line naming the key, before any rank tries to build it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig

from distrain.config.checks import ConfigError
from distrain.parallelism.layout import ranks_per_node_in_group

# A model family checks itself through its ModelSpec (``spec.check_config``), a tracker through its ``check``.
# ft first: it checks that its groups divide the job's ranks before the options acting inside a group are checked.
GROUPS = ("ft", "parallelism", "comm", "optimizer", "precision")
JOB_WIDE_GROUP = "ft"  # the option whose checks see the whole job; the others see one replica group's ranks


@dataclass(frozen=True)
class Placement:
    """Where the job runs, as its checks see it: the world size, the ranks per node, the device type, and whether
    this is a dry run planning for another machine (checks about this machine are then skipped)."""

    world_size: int
    ranks_per_node: int
    device_type: str
    planning: bool = False
    replica_groups: int = 1  # ft=torchft: the ranks split into this many groups, each running the layout

    def inside_group(self) -> Placement:
        """What one replica group's ranks are: the placement the parallelism and comm options act in (each group
        runs its own layout; the groups' own checks see the whole job). The job itself without groups."""
        if self.replica_groups <= 1 or self.world_size % self.replica_groups:
            return self
        groups = self.replica_groups
        local = ranks_per_node_in_group(self.world_size, self.ranks_per_node, groups)
        return Placement(self.world_size // groups, local, self.device_type, self.planning)


def option_of(cfg: DictConfig, group: str) -> Any | None:
    """The class or function ``<group>._target_`` names (None when the group has no target)."""
    node = cfg.get(group)
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if not target:
        return None
    try:
        return get_object(str(target))
    except Exception as err:  # noqa: BLE001 - whatever the import raised, the user's fix is the target
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise ConfigError(f"{group}._target_", target, f"an importable class or function ({reason})") from None


def own_checks(cfg: DictConfig, placement: Placement) -> list[str]:
    """Run every selected option's ``check_config``; return their warning lines."""
    notes: list[str] = []
    for group in GROUPS:
        check_config = getattr(option_of(cfg, group), "check_config", None)
        if callable(check_config):
            seen = placement if group == JOB_WIDE_GROUP else placement.inside_group()
            notes.extend(check_config(cfg, seen) or ())
    return notes
