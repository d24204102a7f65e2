"""``comm=hierarchical``: two-level gradient all-reduce for clusters where links inside a node are much faster
than links between nodes.

Per bucket: reduce (sum) to the node's leader inside each node; all-reduce (ring) among the node leaders only;
broadcast from the leader inside each node. Only one rank per node sends across nodes, and it sends the
gradient of a world of ``nodes`` ranks instead of ``world`` ranks.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distrain.comm.checks import check_hierarchical
from distrain.comm.ddp_comm import DDPComm
from distrain.comm.traffic import all_reduce_bytes, broadcast_bytes, reduce_bytes
from distrain.launch.process_group import DistEnv

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from distrain.config.options import Placement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeLayout:
    """Ranks numbered node by node: node ``rank // ranks_per_node``, leader = the node's first rank."""

    world_size: int
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def leaders(self) -> list[int]:
        return [node * self.ranks_per_node for node in range(self.nodes)]

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


@dataclass(frozen=True)
class HierarchyGroups:
    """This rank's node group and the leaders' group (None on ranks that are not leaders)."""

    layout: NodeLayout
    rank: int
    node: dist.ProcessGroup
    leaders: dist.ProcessGroup | None

    @property
    def leader(self) -> int:
        return self.layout.node_ranks(self.layout.node_of(self.rank))[0]


def node_name() -> str:
    """The node this process runs on: SLURM's node name (several slurmd can share one host), else the host."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def detect_layout(world_size: int, ranks_per_node: int | None, env: DistEnv) -> NodeLayout:
    """The node layout: ``ranks_per_node`` when given (one machine acting as several nodes, for tests), else the
    launcher's LOCAL_WORLD_SIZE (torchrun, or SLURM's tasks per node through submitit), checked against every
    rank's node name (collective: one all_gather_object)."""
    layout = NodeLayout(world_size, ranks_per_node or env.local_world_size)
    if world_size % layout.ranks_per_node:
        raise ValueError(f"comm=hierarchical: {layout.ranks_per_node} ranks per node do not divide {world_size} ranks")
    if ranks_per_node is None:
        names: list[str] = [""] * world_size
        dist.all_gather_object(names, node_name())
        for rank, name in enumerate(names):
            if name != names[layout.node_ranks(layout.node_of(rank))[0]]:
                raise ValueError(
                    f"comm=hierarchical: rank {rank} runs on {name}, not with its node's leader; ranks must be "
                    f"numbered node by node with {layout.ranks_per_node} per node (set comm.ranks_per_node)"
                )
        where = ", ".join(names[leader] for leader in layout.leaders())
    else:
        where = f"comm.ranks_per_node={ranks_per_node}"
    log.info("hierarchical all-reduce: %d nodes x %d ranks per node (%s)", layout.nodes, layout.ranks_per_node, where)
    return layout


def build_groups(layout: NodeLayout, rank: int) -> HierarchyGroups:
    """Collective over all ranks: every rank creates every node group and the leaders' group, in one order."""
    node_groups = [dist.new_group(layout.node_ranks(node)) for node in range(layout.nodes)]
    leaders = dist.new_group(layout.leaders())
    return HierarchyGroups(
        layout=layout,
        rank=rank,
        node=node_groups[layout.node_of(rank)],
        leaders=leaders if rank in layout.leaders() else None,
    )


def hierarchical_all_reduce(tensor: torch.Tensor, groups: HierarchyGroups) -> None:
    """Sum ``tensor`` over all ranks in place, in two levels (blocking). Collectives: reduce on the node group,
    all-reduce on the leaders' group (leaders only), broadcast on the node group."""
    layout = groups.layout
    if layout.ranks_per_node > 1:
        dist.reduce(tensor, dst=groups.leader, group=groups.node)
    if groups.leaders is not None and layout.nodes > 1:
        dist.all_reduce(tensor, group=groups.leaders)
    if layout.ranks_per_node > 1:
        dist.broadcast(tensor, src=groups.leader, group=groups.node)


def hierarchical_bytes(nbytes: int, groups: HierarchyGroups) -> int:
    """Bytes this rank sends for one ``hierarchical_all_reduce`` of ``nbytes`` (``distrain.comm.traffic``)."""
    layout, is_leader = groups.layout, groups.rank == groups.leader
    sent = reduce_bytes(nbytes, layout.ranks_per_node, is_leader)
    sent += broadcast_bytes(nbytes, layout.ranks_per_node, groups.rank - groups.leader)
    return sent + (all_reduce_bytes(nbytes, layout.nodes) if is_leader else 0)


class HierarchicalComm(DDPComm):
    """Buckets averaged by ``hierarchical_all_reduce``, one bucket after another on a worker thread
    (``DDPComm.in_order``), so backward keeps computing meanwhile.

    Args:
        ranks_per_node: ranks per node; None takes the launcher's (LOCAL_WORLD_SIZE) and checks it against the
            ranks' node names. Set it to make one machine act as several nodes (e.g. 4 ranks as 2 x 2).
    """

    @classmethod
    def check_config(cls, cfg: DictConfig, placement: Placement) -> list[str]:
        return [*super().check_config(cfg, placement), *check_hierarchical(cfg, placement.world_size)]

    def __init__(self, *, ranks_per_node: int | None, **ddp: object) -> None:
        super().__init__(**ddp)
        self.ranks_per_node = ranks_per_node

    def prepare(self, model: DistributedDataParallel, env: DistEnv) -> None:
        layout = detect_layout(self.world_size, self.ranks_per_node, env)
        self.groups = build_groups(layout, self.rank)

    def average_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        self.bytes_sent += hierarchical_bytes(buffer.numel() * buffer.element_size(), self.groups)

        def average() -> torch.Tensor:
            hierarchical_all_reduce(buffer.div_(self.world_size), self.groups)
            return buffer

        return self.in_order(average)
