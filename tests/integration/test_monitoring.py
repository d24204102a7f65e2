"""Monitoring through train.py: the per-step metrics, rank balance and stragglers, Weights & Biases offline runs
(read back from their files), profiler traces."""

import json

import pytest
from helpers import FAST, run_train

from distrain.trackers.console import si_number
from distrain.trackers.wandb_files import read_wandb_run

PHASES = ("data_time_s", "compute_time_s", "comm_time_s", "optimizer_time_s")
STEP_METRICS = {
    "loss",
    "lr",
    "grad_norm",
    "step_time_s",
    "tokens_per_s",
    "samples_per_s",
    *PHASES,
    "mfu",
    "memory_allocated_bytes",
    "memory_peak_bytes",
    "step_time_rank_max_s",
    "busy_time_rank_max_s",
}


def logged(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_step_metrics_are_present_and_add_up(tmp_path):
    """Every metric, with MFU against the configured peak (on CPU there is none unless it is configured)."""
    # Steps of ~0.1 s, so that the loop's milliseconds of bookkeeping and the machine's noise stay small beside them.
    bigger = ["model.d_model=256", "data.micro_batch_size=16", "monitor.peak_flops=1e11"]
    args = [*FAST, *bigger, "trainer.max_steps=12", "trainer.log_every=4", "hydra.run.dir=run"]
    result = run_train(args, tmp_path)
    assert result.returncode == 0, result.stderr
    records = logged(tmp_path / "run")
    assert [r["step"] for r in records] == [4, 8, 12]
    for record in records:
        assert STEP_METRICS <= record.keys(), STEP_METRICS - record.keys()
        assert record["tokens_per_s"] > 0 and record["samples_per_s"] > 0
        assert record["tokens_per_s"] == pytest.approx(record["samples_per_s"] * 32)  # seq_len 32
        assert 0 < record["mfu"] < 1
        assert record["memory_allocated_bytes"] > 50e6  # a CPU rank's RSS
        assert all(record[phase] >= 0 for phase in PHASES)
        assert record["compute_time_s"] > 0 and record["optimizer_time_s"] > 0
        parts = sum(record[phase] for phase in PHASES)
        # The parts leave out only the loop's own bookkeeping (agreement, logging) between steps.
        assert 0.6 * record["step_time_s"] <= parts <= 1.05 * record["step_time_s"], record
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    stats = summary["metrics"]["tokens_per_s"]
    assert stats["min"] <= stats["mean"] <= stats["max"] and stats["count"] == 3 and stats["std"] >= 0
    assert f"tokens/s (mean)  {si_number(stats['mean'])}" in result.stderr  # the end table shows the same mean


def test_a_slow_rank_is_named_as_straggler(tmp_path):
    result = run_train(
        [*FAST, "trainer.max_steps=8", "trainer.log_every=4", "hydra.run.dir=run"],
        tmp_path,
        env={"DISTRAIN_INJECT_DELAY": "1:0.1"},  # rank 1 sleeps 100 ms in every step
    )
    assert result.returncode == 0, result.stderr
    records = logged(tmp_path / "run")
    assert all(r["straggler_rank"] == 1 for r in records)
    assert all(r["straggler_slowdown"] > 0.5 for r in records)
    assert all(r["busy_time_rank_max_s"] - r["busy_time_rank_min_s"] > 0.05 for r in records)
    assert "straggler: rank 1" in result.stderr
    # No monitor.peak_flops: a CPU's peak is unknown, so no MFU (once it was measured at start-up and read 444%).
    assert not any("mfu" in r for r in records) and "mfu: not reported" in result.stderr


def wandb_runs(run_dir):
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def test_wandb_offline_one_run_per_job_grouped_by_sweep_and_resumed(tmp_path):
    """Two jobs of one multirun on 2 ranks each: one offline W&B run per job, holding the metrics and the
    resolved config, grouped by the sweep. Resuming one job in its directory continues the same run id."""
    args = [*FAST, "logger=wandb", "trainer.max_steps=6", "trainer.log_every=2", "checkpoint=default"]
    env = {"WANDB_MODE": None, "WANDB_API_KEY": None, "HOME": str(tmp_path)}  # no credentials: offline by itself
    result = run_train(["-m", *args, "trainer.seed=1,2"], tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    job_dirs = sorted(p.parent for p in tmp_path.glob("multirun/*/*/*/metrics.jsonl"))
    assert len(job_dirs) == 2
    runs = []
    for job_dir in job_dirs:
        (offline,) = wandb_runs(job_dir)  # rank 0 only: one run per job
        run = read_wandb_run(offline)
        assert run["id"] == (job_dir / "wandb_run_id").read_text().strip()
        assert run["config"]["trainer"]["max_steps"] == 6
        assert run["config"]["parallelism"]["name"] == "ddp"
        losses = {row["_step"]: row["loss"] for row in run["history"] if "loss" in row}
        assert losses == {r["step"]: r["loss"] for r in logged(job_dir)}
        assert run["summary"]["final_val_loss"] == json.loads((job_dir / "summary.json").read_text())["final_val_loss"]
        runs.append(run)
    assert runs[0]["id"] != runs[1]["id"] and runs[0]["group"] == runs[1]["group"] != ""
    assert runs[0]["config"]["trainer"]["seed"] == 1 and runs[1]["config"]["trainer"]["seed"] == 2

    resumed = run_train(
        [*args, "trainer.max_steps=8", f"hydra.run.dir={job_dirs[0]}", "checkpoint.resume=auto"], tmp_path, env=env
    )
    assert resumed.returncode == 0, resumed.stderr
    first, second = wandb_runs(job_dirs[0])
    continued = read_wandb_run(second)
    assert continued["id"] == runs[0]["id"]
    assert [row["_step"] for row in continued["history"] if "loss" in row] == [8]


def test_profile_writes_a_trace_per_rank(tmp_path):
    args = [*FAST, "profile=true", "monitor.profile_start_step=2", "monitor.profile_steps=2", "trainer.max_steps=5"]
    result = run_train([*args, "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        trace = json.loads((tmp_path / "run" / "profile" / f"trace_rank{rank}.json").read_text())
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert any(name.startswith("ProfilerStep#") for name in names)
        assert any(name.startswith("aten::") for name in names)
