"""ft=torchft in a SLURM job, as each task sees it: one task per node starts that node's ranks and runs whole replica
groups on them, so the job's ranks are tasks x distributed.nproc_per_node; a task per rank is refused in one line."""

import socket
import threading
import time

import pytest
from helpers import FAST, compose_config
from omegaconf import OmegaConf

from distrain.config.checks import ConfigError
from distrain.config.validate import validate
from distrain.errors import RunError
from distrain.ft.coordination import JobCoordination, Launchers, groups_of
from distrain.ft.launch import _job_result

GROUPS = [*FAST, "ft=torchft"]


def slurm_step(monkeypatch, tasks, nodes, index=0):
    """The variables srun sets in each task of a step."""
    for key, value in {"SLURM_PROCID": index, "SLURM_STEP_NUM_TASKS": tasks, "SLURM_STEP_NUM_NODES": nodes}.items():
        monkeypatch.setenv(key, str(value))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    with pytest.raises(ConfigError, match="hydra.launcher.tasks_per_node='4 tasks on 2 nodes' is not allowed: 1 with"):
        validate(compose_config([*GROUPS, "ft.replica_groups=4", "distributed.nproc_per_node=1"]))


def test_each_node_runs_a_consecutive_share_of_the_groups():
    assert [list(groups_of(Launchers(index, 2, "n1", 1), 4)) for index in (0, 1)] == [[0, 1], [2, 3]]
    assert list(groups_of(Launchers(0, 1, "127.0.0.1", 0), 2)) == [0, 1]


def ft_settings(**overrides):
    settings = {"lighthouse": "http://127.0.0.1:1", "quorum_timeout_s": 2.0, "timeout_s": 1.0, **overrides}
    return OmegaConf.create(settings)  # an external lighthouse: the store alone is exercised


def test_the_first_node_keeps_the_store_up_until_every_node_is_done():
    """Two nodes' launchers on one store: the second reads the lighthouse from the first; the first waits for the
    second without a deadline while nobody has finished the run, then at most ft.timeout_s once someone has."""
    port = free_port()
    first = JobCoordination(Launchers(0, 2, "127.0.0.1", port), ft_settings()).__enter__()
    second = JobCoordination(Launchers(1, 2, "127.0.0.1", port), ft_settings(lighthouse=None)).__enter__()
    assert second.lighthouse == "http://127.0.0.1:1" and not first.run_finished()
    ending = threading.Thread(target=first.__exit__, args=(None, None, None))
    ending.start()
    ending.join(timeout=3 * first.ft.timeout_s)
    assert ending.is_alive()  # nobody finished: the second node may still be training
    second.announce_finished()
    assert first.run_finished() and second.run_finished()
    ending.join(timeout=3 * first.ft.timeout_s)
    assert not ending.is_alive()  # finished: ft.timeout_s of grace, then the lighthouse goes


def test_a_node_whose_first_node_never_served_the_store_stops_in_one_line():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RunError, match="the first node's task did not serve the replica groups' store at 127.0.0.1"):
        JobCoordination(Launchers(1, 2, "127.0.0.1", port), ft_settings(quorum_timeout_s=1.0)).__enter__()
    assert time.monotonic() - started < 30


def test_a_node_whose_groups_were_stopped_after_another_finished_the_run_succeeds():
    cut = {2: ("cut", "another group had finished the run"), 3: ("failed", "its supervisor exited with status 1")}
    assert _job_result(cut, finished_elsewhere=True) == {}
    with pytest.raises(RunError, match="its supervisor exited with status 1"):
        _job_result(cut, finished_elsewhere=False)
    with pytest.raises(RunError, match="no replica group finished the run"):
        _job_result({2: cut[2]}, finished_elsewhere=False)
