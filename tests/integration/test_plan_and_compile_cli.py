"""train.py dry_run=true and compile=true end to end: exit codes, what is printed and what is written."""

import json

import pytest
from helpers import FAST, run_train

TARGET_64 = ["target.nodes=8", "target.ranks_per_node=8", "target.device=cuda", "model=gpt_small"]


def test_dry_run_of_a_64_gpu_job_exits_0_with_a_memory_table_and_starts_no_rank(tmp_path):
    overrides = ["parallelism=hybrid", "parallelism.tp=2", "parallelism.pp=2", *TARGET_64]
    result = run_train(["dry_run=true", *overrides], cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "on 64 ranks (8 node(s) x 8 cuda): configuration valid" in result.stdout
    assert "pipeline rank 0" in result.stdout and "pipeline rank 1" in result.stdout
    assert "fits: yes" in result.stdout
    [report_path] = (tmp_path / "outputs").rglob("dry_run.json")
    report = json.loads(report_path.read_text())
    assert report["target"]["world_size"] == 64 and report["data_parallel"] == 16 and report["fits"]
    assert len(report["ranks"]) == 2 and all(row["total"] > 0 for row in report["ranks"])
    assert not list((tmp_path / "outputs").rglob("metrics.jsonl"))


def test_dry_run_exits_1_with_one_line_when_a_rank_does_not_fit(tmp_path):
    overrides = ["target.nodes=1", "target.ranks_per_node=2", "target.device=cuda", "target.device_memory_gib=0.1"]
    result = run_train(["dry_run=true", "model=gpt_small", *overrides], cwd=tmp_path, timeout=180)
    assert result.returncode == 1
    assert "fits: NO" in result.stdout
    assert result.stderr.strip().splitlines() == [
        "distrain: dry run: every rank: 0.52 GiB predicted, more than the 0.1 GiB per device (target.device_memory_gib)"
    ]


@pytest.mark.parametrize("override", ["model.n_heads=3", "parallelism=zero stage=4", "comm=topk comm.density=2"])
def test_dry_run_and_the_real_launch_print_the_same_error(tmp_path, override):
    dry = run_train([*FAST, "dry_run=true", *override.split()], cwd=tmp_path, timeout=120)
    real = run_train([*FAST, *override.split()], cwd=tmp_path, timeout=120)
    assert dry.returncode == real.returncode == 2
    assert dry.stderr == real.stderr and len(dry.stderr.strip().splitlines()) == 1
    assert dry.stderr.startswith("distrain: invalid config: ")


def test_compile_with_a_strategy_that_cannot_compile_warns_and_trains_eagerly(tmp_path):
    args = [*FAST, "compile=true", "parallelism=pipeline", "trainer.max_steps=2"]
    result = run_train(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "compile=true ignored with parallelism=pipeline, running eagerly" in result.stdout + result.stderr
    [summary_path] = (tmp_path / "outputs").rglob("summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 2 and "compile" not in summary
