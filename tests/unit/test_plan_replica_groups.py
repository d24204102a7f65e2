"""The dry run under ft=torchft plans one replica group's ranks: each group shards the model over its own ranks,
and the groups multiply the data-parallel degree (the global batch)."""

import pytest
from helpers import compose_config

from distrain.config.checks import ConfigError
from distrain.planning.dry_run import plan

COMMON = ["data=synthetic", "target.device=cuda", "model=llama_tiny", "parallelism=fsdp", "target.nodes=1"]
HELD = ("params", "grads", "optimizer", "gathered")


def test_groups_of_fsdp_ranks_hold_the_shards_of_their_own_group_size():
    grouped = plan(compose_config([*COMMON, "target.ranks_per_node=4", "ft=torchft", "ft.replica_groups=2"]))
    two = plan(compose_config([*COMMON, "target.ranks_per_node=2"]))
    four = plan(compose_config([*COMMON, "target.ranks_per_node=4"]))
    assert [getattr(grouped.ranks[0], key) for key in HELD] == [getattr(two.ranks[0], key) for key in HELD]
    assert grouped.ranks[0].params > four.ranks[0].params
    assert grouped.data_parallel == four.data_parallel == 4
    assert grouped.global_batch_size == four.global_batch_size


def test_a_plan_across_nodes_runs_whole_groups_on_each_node():
    across = [*COMMON[:-1], "target.nodes=2", "target.ranks_per_node=4", "ft=torchft"]
    one_per_node = plan(compose_config([*across, "ft.replica_groups=2"]))
    four = plan(compose_config([*COMMON, "target.ranks_per_node=4"]))
    assert [getattr(one_per_node.ranks[0], key) for key in HELD] == [getattr(four.ranks[0], key) for key in HELD]
    assert one_per_node.data_parallel == 8
    with pytest.raises(ConfigError, match="ft.replica_groups=1 is not allowed: a multiple of the job's 2 nodes"):
        plan(compose_config([*across, "ft.replica_groups=1"]))


def test_an_hsdp_group_on_a_node_of_its_own_shards_over_the_whole_node():
    """A group never spans nodes: one group per 8-rank node is hsdp over 8 ranks of one node (dp_replicate 1)."""
    hsdp = [*COMMON[:-1], "parallelism=hsdp", "target.ranks_per_node=8"]
    grouped = plan(compose_config([*hsdp, "target.nodes=2", "ft=torchft", "ft.replica_groups=2"]))
    one_node = plan(compose_config([*hsdp, "target.nodes=1"]))
    assert [getattr(grouped.ranks[0], key) for key in HELD] == [getattr(one_node.ranks[0], key) for key in HELD]
