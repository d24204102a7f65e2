"""train.py end to end in a subprocess: run directory, multirun, torchrun, a crashing rank, the default run."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import FAST, REPO, run_train

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s"}
SUMMARY_KEYS = {
    "final_train_loss",
    "final_val_loss",
    "steps",
    "world_size",
    "parallelism",
    "layout",
    "comm",
    "optimizer",
    "wall_time_s",
    "peak_memory_bytes_per_rank",
}


def run_dirs(root):
    return sorted(p.parent.parent for p in root.rglob(".hydra/config.yaml"))


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_run_dir(run_dir, steps, world_size):
    records = read_metrics(run_dir)
    assert records and all(METRIC_KEYS <= r.keys() for r in records if "loss" in r)
    assert records[-1]["step"] == steps
    assert all(r["tokens_per_s"] > 0 for r in records if "loss" in r)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["steps"] == steps and summary["world_size"] == world_size
    assert len(summary["peak_memory_bytes_per_rank"]) == world_size
    assert all(m > 0 for m in summary["peak_memory_bytes_per_rank"])
    return records, summary


def test_one_run_one_directory_with_metrics_summary_config_and_checkpoints(tmp_path):
    result = run_train([*FAST, "checkpoint=default", "checkpoint.every_n_steps=10", "trainer.max_steps=30"], tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = run_dirs(tmp_path)
    records, summary = check_run_dir(run_dir, steps=30, world_size=2)
    assert summary["parallelism"] == "ddp" and (summary["comm"], summary["optimizer"]) == ("default", "adamw")
    assert summary["final_train_loss"] < records[0]["loss"] - 0.5
    assert (run_dir / ".hydra" / "config.yaml").read_text().count("max_steps: 30") == 1
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000020", "step_00000030"]  # keep_last=2, written atomically (no .tmp left)


def test_multirun_gives_one_directory_per_job(tmp_path):
    result = run_train(["-m", *FAST, "trainer.max_steps=5", "trainer.seed=1,2"], tmp_path)
    assert result.returncode == 0, result.stderr
    dirs = run_dirs(tmp_path)
    assert [d.name for d in dirs] == ["0", "1"]
    assert all(d.parent.parent.parent.name == "multirun" for d in dirs)
    losses = [check_run_dir(d, steps=5, world_size=2)[1]["final_train_loss"] for d in dirs]
    assert losses[0] != losses[1]  # the seeds really differed
    assert not (tmp_path / "outputs").exists()


def test_torchrun_gives_one_directory(tmp_path):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    result = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", str(REPO / "train.py"), *FAST, "trainer.max_steps=5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (run_dir,) = run_dirs(tmp_path)
    check_run_dir(run_dir, steps=5, world_size=2)
    assert len(list((tmp_path / "outputs").glob("*/*"))) == 1


def test_a_crashing_rank_fails_the_job_with_its_error(tmp_path):
    result = run_train(
        [*FAST, "trainer.max_steps=50"], tmp_path, env={"DISTRAIN_INJECT_FAULT": "raise:1:3"}, timeout=180
    )
    assert result.returncode == 1
    assert "injected fault on rank 1 after step 3" in result.stderr
    assert "rank      : 1" in result.stderr


@pytest.mark.slow
def test_default_training_learns(tmp_path):
    """`python train.py` exactly as the README says: 200 steps of the default GPT on 2 CPU ranks."""
    result = run_train([], tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr
    (run_dir,) = run_dirs(tmp_path)
    records, summary = check_run_dir(run_dir, steps=200, world_size=2)
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1  # the default logger, offline without a login
    assert summary["final_train_loss"] < 0.6 * records[0]["loss"]
    assert summary["final_val_loss"] < 0.7 * records[0]["loss"]
    print(f"default run: first logged loss {records[0]['loss']:.3f} -> final {summary['final_train_loss']:.3f}")
    check_console(result.stdout + result.stderr, run_dir, summary)


def check_console(printed, run_dir, summary):
    """One short line of the main numbers per logged step, a small table naming the run directory at the end, no
    line over 200 characters (the full summary is in summary.json, not on the console)."""
    lines = printed.splitlines()
    assert len(max(lines, key=len)) <= 200, max(lines, key=len)
    step_lines = [line for line in lines if " | loss " in line]
    assert [line.split("step ")[1].split(" |")[0] for line in step_lines] == [f"{n}/200" for n in range(10, 201, 10)]
    for field in ("lr ", "grad ", " tok/s", "mem ", "eta "):
        assert all(field in line for line in step_lines), field
    assert not any("mfu" in line for line in step_lines)  # a CPU's peak FLOP/s is unknown (monitor.peak_flops)
    table = lines[lines.index(next(line for line in lines if "run summary" in line)) :]
    rows = {row.split("  ")[1].strip(): row.split("  ", 2)[2].strip() for row in table[1:] if row.startswith("  ")}
    assert rows["run directory"] == str(run_dir.resolve()) and rows["steps"] == "200"
    assert rows["val loss"] == f"{summary['final_val_loss']:.4g}"
    assert rows["layout"] == f"ddp on {summary['world_size']} ranks, fp32" and summary["layout"] == "ddp"


def test_entry_point_is_a_thin_shim_that_spawned_ranks_can_rerun():
    """train.py only hands the composed config to the package (issue: a thin entry point), and a spawned rank, which
    re-runs the script as ``__mp_main__``, must not start Hydra doing so."""
    rerun = "import runpy; runpy.run_path('train.py', run_name='__mp_main__')"
    out = subprocess.run([sys.executable, "-c", rerun], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout, out.stderr
    assert len((REPO / "train.py").read_text().splitlines()) < 80


@pytest.mark.parametrize("sweep", sorted(p.stem for p in (REPO / "multirun_sweeps").glob("*.yaml")))
def test_ready_sweeps_compose(tmp_path, sweep):
    config = ["--config-dir", str(REPO / "multirun_sweeps"), "--config-name", sweep]
    result = run_train([*config, "--cfg", "hydra"], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    params = result.stdout.split("sweeper:")[1].split("launcher:")[0]
    assert "params:" in params and "," in params  # a real sweep: at least one key with several values


def losses_by_step(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    common = [*FAST, "trainer.max_steps=8", "checkpoint.every_n_steps=4", "checkpoint.keep_last=0"]
    first = run_train([*common, "hydra.run.dir=first"], tmp_path)
    assert first.returncode == 0, first.stderr
    checkpoints = tmp_path / "first" / "checkpoints"
    shard = sorted((checkpoints / "step_00000008").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated, as by a crash mid-copy
    (checkpoints / "step_00000012.tmp").mkdir()  # an interrupted save: never complete, never chosen
    resumed = run_train(
        [
            *FAST,
            "trainer.max_steps=10",
            "hydra.run.dir=second",
            f"checkpoint.dir={checkpoints}",
            "checkpoint.resume=auto",
        ],
        tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "skipping checkpoint" in resumed.stderr and "step_00000008" in resumed.stderr
    assert "resumed from" in resumed.stderr and "step_00000004" in resumed.stderr
    assert sorted(losses_by_step(tmp_path / "second")) == [5, 6, 7, 8, 9, 10]
    assert losses_by_step(tmp_path / "second")[5] == losses_by_step(tmp_path / "first")[5]


@pytest.mark.parametrize(
    "signal_name,to_every_process", [("SIGTERM", False), ("SIGUSR1", False), ("SIGUSR1", True), ("SIGINT", True)]
)
def test_stop_signal_checkpoints_at_a_step_boundary_and_exits_for_requeue(tmp_path, signal_name, to_every_process):
    """To train.py, which forwards it to its ranks; or to every process of the run, as SLURM's ``--signal`` and
    ``scancel --signal`` send it, and Ctrl-C in a terminal sends SIGINT (the launcher, the fork server its CPU ranks
    fork from, the ranks)."""
    import signal
    import time

    args = [*FAST, "trainer.max_steps=100000", "hydra.run.dir=run", "checkpoint.keep_last=0"]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=to_every_process,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.2)
    if to_every_process:
        os.killpg(proc.pid, getattr(signal, signal_name))
    else:
        proc.send_signal(getattr(signal, signal_name))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert f"stopped by {signal_name}" in stderr
    # the hint continues the run in its own directory, so its summary and metrics cover the whole run
    assert f"continue with checkpoint.resume=auto hydra.run.dir={(tmp_path / 'run').resolve()} " in stderr, stderr
    assert stderr.count(f"on {signal_name}; checkpoint saved") == 1 and "death signal" not in stderr, stderr
    # The ranks exit by themselves once checkpointed, not when the launcher's shutdown timeout SIGKILLs them.
    assert "forcefully exiting" not in stderr, stderr
    (checkpoint,) = sorted((tmp_path / "run" / "checkpoints").iterdir())
    stopped_at = int(checkpoint.name.split("_")[1])
    assert stopped_at >= 5 and (checkpoint / "manifest.json").is_file()
    assert read_metrics(tmp_path / "run")[-1]["step"] == stopped_at  # it stopped right after the checkpointed step
    resumed = run_train(
        [*FAST, f"trainer.max_steps={stopped_at + 3}", "hydra.run.dir=again", f"checkpoint.resume={checkpoint}"],
        tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(losses_by_step(tmp_path / "again")) == [stopped_at + 1, stopped_at + 2, stopped_at + 3]


def test_optuna_sweep_minimises_the_returned_validation_loss(tmp_path):
    """train.py returns the final validation loss; the Optuna sweeper reports the best of its trials."""
    import yaml

    config = ["--config-dir", str(REPO / "multirun_sweeps"), "--config-name", "optuna_lr"]
    trials = ["hydra.sweeper.n_trials=2", "trainer.max_steps=4", "hydra.sweep.dir=sweep"]
    result = run_train(["-m", *config, *trials, *FAST], tmp_path)
    assert result.returncode == 0, result.stderr
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())["best_value"]
    val_losses = [json.loads((tmp_path / "sweep" / job / "summary.json").read_text())["final_val_loss"] for job in "01"]
    assert best == min(val_losses)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("optimizer.lr=-1", "optimizer.lr=-1.0 is not allowed: a learning rate > 0"),  # validation's
        ("trainer.max_step=5", "trainer.max_step=5 is not allowed: no such key"),  # composition's (Hydra's)
        # the checkpoint directory's, as the launch prepares it
        ("checkpoint.dir=/proc/nope", "checkpoint.dir='/proc/nope' is not allowed: a directory this job can create"),
    ],
)
def test_a_refused_value_is_one_line_exit_2_and_no_run(tmp_path, override, needle):
    """What train.py does with any refusal (tests/unit/test_config_keys.py has every key's and combination's words):
    one line naming the key, the value and what is allowed, exit 2, no traceback, and no run started."""
    result = run_train([override], cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"distrain: invalid config: {needle}"] or needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not list(tmp_path.rglob("metrics.jsonl"))
