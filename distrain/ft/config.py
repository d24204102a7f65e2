"""The ``ft`` group's schemas: whether a failure stops the job (``none``) or only its replica group (``torchft``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distrain.launch.ranks import slurm_step


@dataclass(kw_only=True)
class NoReplicaGroupsConfig:
    """One job, one failure domain: a failed rank stops every rank (then requeue or ``distributed.max_restarts``)."""

    name: str = "none"
    replica_groups: int = 1


@dataclass(kw_only=True)
class TorchFTConfig:
    """torchft replica groups: the ranks split into ``replica_groups`` groups that average gradients through torchft's
    Manager; a group that dies is restarted and heals from a live peer while the others keep stepping."""

    _target_: str = "distrain.ft.replicas.ReplicaGroups"
    name: str = "torchft"
    replica_groups: int = 2  # groups the ranks split into evenly; each runs the parallelism layout inside it
    min_replicas: int = 1  # a step commits only when at least this many groups took part
    lighthouse: str | None = None  # an external lighthouse (http://host:port); None: the launcher embeds one
    max_restarts: int = 3  # times the launcher restarts one group's ranks after they fail
    timeout_s: float = 30.0  # cross-group all-reduce, should_commit and healing transfers
    quorum_timeout_s: float = 120.0  # waiting for a quorum (covers a restarting group's start-up)
    join_timeout_ms: int = 1000  # embedded lighthouse: how long a quorum waits for groups that have not joined
    heartbeat_timeout_ms: int = 2000  # embedded lighthouse: silence after which a group counts as dead
    quorum_tick_ms: int = 10  # embedded lighthouse: how often it checks whether a quorum is ready (each step has one)


def has_replica_groups(cfg: Any) -> bool:
    """Whether the config's ``ft`` option runs replica groups (it names a class to build: ``ft=torchft`` or a user's
    own); ``ft=none`` names none."""
    return bool(cfg.ft.get("_target_"))


def replica_group_count(cfg: Any) -> int:
    """How many replica groups the job's ranks split into (1 without groups): the layout's outermost replicas."""
    return int(cfg.ft.get("replica_groups", 1) or 1) if has_replica_groups(cfg) else 1


def launcher_count(cfg: Any) -> int:
    """How many launchers start the job's ranks: under replica groups in a SLURM job, one task per node, each
    starting its node's ``distributed.nproc_per_node`` ranks; otherwise this process alone (or, under torchrun and
    multi-task SLURM jobs without groups, the ranks themselves: ``WORLD_SIZE`` counts them)."""
    return slurm_step()[0] if has_replica_groups(cfg) else 1
