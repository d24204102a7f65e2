"""One layout object for every strategy: the parallel degrees of a run and how its data-parallel ranks hold the
model, resolved once from the ``parallelism`` config for the world size. Validation, the strategy, the dry-run
planner, the describe line, the memory prediction and checkpoint preflight all read it.

Each strategy says how its config resolves (``resolve_layout(parallelism, world_size, ranks_per_node)`` on its class
or factory); ``layout_of`` asks the strategy ``parallelism._target_`` names. One of the user's own that declares
none is data parallel over every rank, replicated (as DDP).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig


@dataclass(frozen=True)
class Layout:
    """The parallel degrees of one run, the same object for every strategy: ``replicate`` copies of a group of
    ``dp`` data-parallel ranks (HSDP when both exceed 1), ``tp``, ``pp`` and ``cp``, whose product is the world size;
    ``ep`` splits the dp axis. How the dp ranks hold the model: ``dp_holds`` "shard" (FSDP2, ZeRO) or "replicate"
    (DDP, FSDP2's replicate mode), and the ``sharding_stage`` (ZeRO 1-3, FSDP 2-3; None when replicated). In config
    one of ``dp``, ``tp``, ``pp`` may be -1, "the rest of the world size"; ``dp_replicate=-1`` means "one per node".
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    replicate: int = 1
    cp: int = 1
    ep: int = 1  # expert-parallel ranks: a split of the dp axis (ep divides dp)
    dp_holds: str = "replicate"
    sharding_stage: int | None = None

    @classmethod
    def resolve(
        cls,
        *,
        dp: int,
        tp: int,
        pp: int,
        world_size: int,
        replicate: int = 1,
        ranks_per_node: int | None = None,
        cp: int = 1,
        ep: int = 1,
        dp_holds: str = "shard",
        sharding_stage: int | None = None,
    ) -> Layout:
        """The degrees for ``world_size`` ranks: one of ``dp``, ``tp``, ``pp`` may be -1, the rest of the world size
        (the ``fsdp`` preset leaves dp, ``tensor`` tp, ``pipeline`` pp); ``ranks_per_node`` resolves
        ``replicate=-1``. ValueError names the mismatch."""
        free = [name for name, degree in (("dp", dp), ("tp", tp), ("pp", pp)) if degree == -1]
        if len(free) > 1:
            raise ValueError(f"only one of dp, tp, pp may be -1 (the rest of the world size), not {' and '.join(free)}")
        model_copy = max(tp, 1) * max(pp, 1) * cp  # the ranks that hold one copy of the model and read one batch
        if replicate == -1:  # one copy per node, or per model copy when one spans several nodes
            replicate = max(1, world_size // max(ranks_per_node or world_size, model_copy))
        fixed = replicate * max(dp, 1) * model_copy
        if free:
            if world_size % fixed:
                product = " x ".join(n for n in ("dp_replicate", "dp", "cp", "tp", "pp") if n != free[0])
                raise ValueError(f"{product} = {fixed} does not divide the world size {world_size}")
            dp, tp, pp = (world_size // fixed if degree == -1 else degree for degree in (dp, tp, pp))
            model_copy = tp * pp * cp
        if replicate * dp * model_copy != world_size:
            raise ValueError(
                f"dp_replicate x dp x cp x tp x pp = {replicate} x {dp} x {cp} x {tp} x {pp} = "
                f"{replicate * dp * model_copy}, not the world size {world_size}"
            )
        if dp % ep:
            raise ValueError(f"ep = {ep} does not divide the data-parallel degree dp = {dp} (experts split over dp)")
        return cls(
            pp=pp, dp=dp, tp=tp, replicate=replicate, cp=cp, ep=ep, dp_holds=dp_holds, sharding_stage=sharding_stage
        )

    @property
    def data_parallel(self) -> int:
        """Ranks reading different data: the replicas times the ranks sharding each."""
        return self.replicate * self.dp

    @property
    def world_size(self) -> int:
        """The ranks of the layout: the product of its degrees (ep splits dp, so it is no factor)."""
        return self.replicate * self.dp * self.cp * self.tp * self.pp

    @property
    def model_parallel(self) -> bool:
        """Whether one copy of the model spans several ranks (tensor, pipeline, context or expert parallelism)."""
        return self.tp * self.pp * self.cp * self.ep > 1


def ranks_per_node_in_group(world_size: int, ranks_per_node: int, replica_groups: int) -> int:
    """A replica group's ranks on one node: all of them, since a group never spans nodes (several groups may share
    a node)."""
    return max(1, min(ranks_per_node, world_size // replica_groups))


def layout_of(
    parallelism: DictConfig,
    world_size: int,
    ranks_per_node: int | None = None,
    *,
    with_experts: bool = True,
    replica_groups: int = 1,
) -> Layout:
    """The layout the strategy ``parallelism._target_`` resolves ``parallelism`` to on ``world_size`` ranks
    (``ranks_per_node`` resolves ``dp_replicate=-1``; without ``with_experts`` ep is left at 1, for checks that name
    it themselves). ``replica_groups`` (ft=torchft) split the ranks first: the strategy resolves inside one group,
    and the groups are the layout's outermost replicas. ValueError names degrees that do not fit the world size.
    No collective."""
    if replica_groups > 1:
        if world_size % replica_groups:
            raise ValueError(f"{replica_groups} replica groups do not divide the world size {world_size}")
        inside = layout_of(
            parallelism,
            world_size // replica_groups,
            ranks_per_node_in_group(world_size, ranks_per_node, replica_groups) if ranks_per_node else None,
            with_experts=with_experts,
        )
        return replace(inside, replicate=inside.replicate * replica_groups)
    try:
        strategy: Any = get_object(str(parallelism.get("_target_")))
    except Exception:  # noqa: BLE001 - an unimportable target is refused by validation, with its own line
        strategy = None
    resolve = getattr(strategy, "resolve_layout", None)
    if resolve is None:
        return Layout(dp=world_size)
    if with_experts:  # the documented signature; only the mesh layout's own checks leave ep out
        return resolve(parallelism, world_size, ranks_per_node)
    return resolve(parallelism, world_size, ranks_per_node, with_experts=False)
