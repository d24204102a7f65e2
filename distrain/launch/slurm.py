"""Checks of a SLURM request at submission time, in the submitting process (a Hydra callback), so a request the
cluster cannot satisfy fails with one line instead of a job that stays pending without explanation."""

from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from distrain.config.validate import ConfigError


def slurm_partitions() -> dict[str, dict[str, Any]]:
    """Every partition with its node count, CPUs per node and whether it is the default (from ``sinfo``)."""
    out = subprocess.run(
        ["sinfo", "-h", "-s", "-o", "%P %F %c"], capture_output=True, text=True, check=True, timeout=30
    )
    partitions = {}
    for line in out.stdout.split("\n"):
        if not line.strip():
            continue
        name, nodes, cpus = line.split()
        partitions[name.rstrip("*")] = {
            "nodes": int(nodes.split("/")[-1]),  # allocated/idle/other/total
            "cpus": int(cpus.rstrip("+")),
            "default": name.endswith("*"),
        }
    return partitions


def check_slurm_request(launcher: DictConfig, partitions: dict[str, dict[str, Any]]) -> None:
    """Raise ``ConfigError`` for a partition that does not exist, more nodes than it has, or more CPUs per node."""
    if launcher.partition is not None:
        if launcher.partition not in partitions:
            raise ConfigError("hydra.launcher.partition", launcher.partition, f"one of {', '.join(partitions)}")
        name = launcher.partition
    else:
        defaults = [p for p, info in partitions.items() if info["default"]]
        if not defaults:
            raise ConfigError("hydra.launcher.partition", None, f"one of {', '.join(partitions)} (no default here)")
        name = defaults[0]
    partition = partitions[name]
    if launcher.nodes > partition["nodes"]:
        raise ConfigError("hydra.launcher.nodes", launcher.nodes, f"at most {partition['nodes']} (partition {name})")
    cpus = launcher.tasks_per_node * (launcher.cpus_per_task or 1)
    if cpus > partition["cpus"]:
        raise ConfigError(
            "hydra.launcher.tasks_per_node",
            launcher.tasks_per_node,
            f"tasks_per_node x cpus_per_task <= {partition['cpus']} CPUs per node (partition {name})",
        )


def check_replica_groups_request(launcher: DictConfig, config: DictConfig) -> None:
    """Under ``ft=torchft`` each node's one task starts that node's ranks and runs whole replica groups on them."""
    ft = config.get("ft")
    if ft is None or not ft.get("_target_"):
        return
    if launcher.tasks_per_node != 1:
        raise ConfigError(
            "hydra.launcher.tasks_per_node", launcher.tasks_per_node, "1 with ft=torchft (the task on each node "
            "starts the node's distributed.nproc_per_node ranks and runs whole replica groups on them)"
        )  # fmt: skip
    if isinstance(ft.get("replica_groups"), int) and ft.replica_groups % launcher.nodes:
        raise ConfigError(
            "ft.replica_groups", ft.replica_groups, f"a multiple of hydra.launcher.nodes={launcher.nodes}: a replica "
            "group runs on the ranks of one node, and every node runs as many groups"
        )  # fmt: skip


class SlurmRequestCheck(Callback):
    """Before a multirun with the submitit SLURM launcher submits anything, check the request against ``sinfo``."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher = config.hydra.launcher
        if not str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
            return
        try:
            if shutil.which("sinfo") is None:
                raise ConfigError(
                    "hydra/launcher",
                    "submitit_slurm",
                    "a machine with SLURM (sinfo not found); hydra/launcher=submitit_local runs the jobs here",
                )
            check_replica_groups_request(launcher, config)
            check_slurm_request(launcher, slurm_partitions())
        except ConfigError as err:
            print(f"distrain: invalid SLURM request: {err}", file=sys.stderr)
            sys.exit(2)
