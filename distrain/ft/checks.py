"""``ft=torchft``'s own checks, run once in the launching process before any rank or group starts."""

from __future__ import annotations

import importlib.util
import socket
from urllib.parse import urlsplit

from hydra.utils import instantiate
from omegaconf import DictConfig

from distrain.config.checks import ConfigError, at_least, check, positive
from distrain.config.options import Placement, option_of
from distrain.launch.ranks import inside_launcher, slurm_step
from distrain.parallelism.capabilities import capabilities_of

INSTALL = "pip install -e '.[ft]' (torchft==0.2.0)"
# The layouts a group runs: those whose every rank ends its backward with the gradients of its own parameters
# (a pipeline, even of one stage, runs its schedule instead: pp=-1 is refused too).
RUNS_INSIDE = "ddp, fsdp, hsdp, tensor or a mesh layout without pipeline stages (parallelism.pp=1)"


def check_replica_groups(cfg: DictConfig, placement: Placement) -> list[str]:
    """torchft installed; groups that divide the ranks; a layout and comm option a group can run; the lighthouse."""
    try:
        installed = importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        installed = False
    if not installed:
        raise ConfigError("ft", "torchft", f"none, or install torchft first: {INSTALL}")
    groups = cfg.ft.replica_groups
    check(cfg, "ft.replica_groups", at_least(1), "an integer >= 1")
    if placement.world_size % groups:
        raise ConfigError(
            "ft.replica_groups",
            groups,
            f"a divisor of the job's {placement.world_size} ranks (nodes x ranks per node): the ranks "
            "split evenly into the groups",
        )
    check(
        cfg,
        "ft.min_replicas",
        lambda v: isinstance(v, int) and 1 <= v <= groups,
        f"an integer in 1..ft.replica_groups ({groups})",
    )
    check(cfg, "ft.max_restarts", at_least(0), "an integer >= 0")
    for key in (
        "ft.timeout_s",
        "ft.quorum_timeout_s",
        "ft.join_timeout_ms",
        "ft.heartbeat_timeout_ms",
        "ft.quorum_tick_ms",
    ):
        check(cfg, key, positive, "a number > 0")
    if not capabilities_of(cfg.parallelism).replica_groups or int(cfg.parallelism.get("pp", 1)) != 1:
        raise ConfigError(
            "parallelism",
            cfg.parallelism.name,
            f"{RUNS_INSIDE} with ft=torchft (each replica group runs it on its own ranks, and torchft's Manager "
            "averages the gradients across the groups); or ft=none",
        )
    if _steps_locally(cfg) and not _syncs_groups(cfg):
        raise ConfigError(
            "comm",
            cfg.comm.name,
            "an option that all-reduces gradients every step with ft=torchft (default, bf16, fp16, powersgd, "
            "hierarchical: it averages inside each group, the groups then average densely), or diloco (the groups "
            "are its workers); this one steps each rank on its own gradient inside a group",
        )
    if inside_launcher() and not placement.planning:
        raise ConfigError(
            "ft",
            "torchft",
            "started by python train.py itself, on one machine or as one SLURM task per node (it starts each node's "
            "process sets, one per replica group), not under torchrun or as one SLURM task per rank",
        )
    tasks, nodes = slurm_step()
    if tasks != nodes and not placement.planning:
        raise ConfigError(
            "hydra.launcher.tasks_per_node", f"{tasks} tasks on {nodes} nodes", "1 with ft=torchft (the task on each "
            "node starts the node's distributed.nproc_per_node ranks and runs whole replica groups on them)"
        )  # fmt: skip
    _check_groups_per_node(groups, placement)
    if cfg.ft.lighthouse and not placement.planning:
        problem = lighthouse_problem(cfg.ft.lighthouse)
        if problem:
            raise ConfigError("ft.lighthouse", cfg.ft.lighthouse, f"a reachable torchft lighthouse: {problem}")
    return []


def _check_groups_per_node(groups: int, placement: Placement) -> None:
    """Each node (each SLURM task, each dry run's target node) runs whole groups, the same number of them."""
    nodes = placement.world_size // placement.ranks_per_node
    if groups % nodes:
        raise ConfigError(
            "ft.replica_groups", groups, f"a multiple of the job's {nodes} nodes: a replica group runs on the ranks "
            "of one node, and every node runs as many groups"
        )  # fmt: skip


def _steps_locally(cfg: DictConfig) -> bool:
    """Whether the comm option steps each rank on its own gradient (an option built from its settings: top-k does
    with update feedback). One that cannot be built is left to its own check, which runs after ft's."""
    try:
        return bool(getattr(instantiate(cfg.comm), "local_steps", False))
    except Exception:  # noqa: BLE001 - whatever the settings raised, the comm option's check names it
        return False


def _syncs_groups(cfg: DictConfig) -> bool:
    """Whether the comm option syncs the replica groups itself (DiLoCo: the groups are its workers)."""
    return bool(getattr(option_of(cfg, "comm"), "syncs_replica_groups", False))


def lighthouse_problem(address: str, timeout_s: float = 3.0) -> str | None:
    """Why ``address`` (http://host:port) is not a lighthouse this machine can reach, or None."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        return "an address http://host:port"
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return None
    except OSError as err:
        return f"{parts.hostname}:{port} does not answer ({err.strerror or err})"
