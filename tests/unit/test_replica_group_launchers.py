"""ft=torchft in a SLURM job, as each task sees it: one task per node starts that node's ranks and runs whole replica
groups on them, so the job's ranks are tasks x distributed.nproc_per_node; a task per rank is refused in one line."""

import pytest
from helpers import FAST, compose_config

from distrain.config.checks import ConfigError
from distrain.config.validate import validate
from distrain.ft.coordination import Launchers, groups_of

GROUPS = [*FAST, "ft=torchft"]


def slurm_step(monkeypatch, tasks, nodes, index=0):
    for key, value in {"SLURM_PROCID": index, "SLURM_NTASKS": tasks, "SLURM_JOB_NUM_NODES": nodes}.items():
        monkeypatch.setenv(key, str(value))


def test_a_task_per_node_counts_every_nodes_ranks(monkeypatch):
    slurm_step(monkeypatch, tasks=2, nodes=2)
    plan = validate(compose_config([*GROUPS, "ft.replica_groups=4", "distributed.nproc_per_node=2"]))
    assert plan.world_size == 4 and plan.nproc_per_node == 2
    with pytest.raises(ConfigError, match="ft.replica_groups=3 is not allowed: a divisor of the job's 4 ranks"):
        validate(compose_config([*GROUPS, "ft.replica_groups=3", "distributed.nproc_per_node=2"]))
    with pytest.raises(ConfigError, match="ft.replica_groups=1 is not allowed: a multiple of the job's 2 nodes"):
        validate(compose_config([*GROUPS, "ft.replica_groups=1", "distributed.nproc_per_node=2"]))


def test_a_task_per_rank_is_refused(monkeypatch):
    slurm_step(monkeypatch, tasks=4, nodes=2)
    with pytest.raises(ConfigError, match="hydra.launcher.tasks_per_node=2 is not allowed: 1 with ft=torchft"):
        validate(compose_config([*GROUPS, "ft.replica_groups=4", "distributed.nproc_per_node=1"]))


def test_each_node_runs_a_consecutive_share_of_the_groups():
    assert [list(groups_of(Launchers(index, 2, "n1", 1), 4)) for index in (0, 1)] == [[0, 1], [2, 3]]
    assert list(groups_of(Launchers(0, 1, "127.0.0.1", 0), 2)) == [0, 1]
