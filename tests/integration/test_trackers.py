"""TensorBoard, MLflow and W&B at once: each read back with its own reader, holding the run's falling loss under the
names metrics.jsonl uses; a continued job continues the same runs; a tracker that cannot start is one line."""

from __future__ import annotations

import http.server
import importlib.util
import json
import threading

import pytest
from helpers import FAST, compose_config, run_train
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distrain.config.validate import ConfigError, validate_trackers
from distrain.trackers.wandb_files import read_wandb_run

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

TRACKED = [*FAST, "logger=[wandb,tensorboard,mlflow]", "trainer.log_every=2", "checkpoint=default"]
TRACKED += ["checkpoint.every_n_steps=4", "checkpoint.keep_last=0", "hydra.run.dir=run"]
NO_CREDENTIALS = {"WANDB_MODE": None, "WANDB_API_KEY": None}


def logged(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def scalars(run_dir, tag):
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events, {event.step: event.value for event in events.Scalars(tag)}


def mlflow_runs(run_dir):
    """The store's runs of experiment ``distrain``, oldest first, and a client on it."""
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("distrain")
    return client, sorted(client.search_runs([experiment.experiment_id]), key=lambda run: run.info.start_time)


def history(client, run, key="loss"):
    return {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id, key)}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """Two DDP ranks and all three trackers: 10 steps (checkpoints at 4, 8, 10); continued to 12 from the last
    checkpoint (requeue-like: nothing to rewind); then, as after a crash, rerun from step 10 to 14."""
    work = tmp_path_factory.mktemp("trackers")
    env = NO_CREDENTIALS | {"HOME": str(work)}
    first = run_train([*TRACKED, "trainer.max_steps=10"], work, env=env)
    assert first.returncode == 0, first.stderr
    run_dir = work / "run"
    jobs = [{"losses": logged(run_dir), "wandb_runs": sorted((run_dir / "wandb").glob("offline-run-*"))}]
    for resume in ("checkpoint.resume=auto", f"checkpoint.resume={run_dir / 'checkpoints' / 'step_00000010'}"):
        steps = 12 if resume.endswith("auto") else 14
        done = run_train([*TRACKED, f"trainer.max_steps={steps}", resume], work, env=env)
        assert done.returncode == 0, done.stderr
        jobs.append({"losses": logged(run_dir)})
    return run_dir, jobs


def test_every_tracker_holds_the_falling_loss_under_the_same_names(tracked_run):
    run_dir, jobs = tracked_run
    losses = jobs[0]["losses"]
    assert list(losses.values())[-1] < list(losses.values())[0]  # the model learns: each tracker shows a falling loss
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    names = {key for r in records for key, value in r.items() if key != "step" and isinstance(value, (int, float))}

    events, _ = scalars(run_dir, "loss")
    assert set(events.Tags()["scalars"]) == names

    client, (first, rerun) = mlflow_runs(run_dir)  # a metric logged only now and then (a straggler) may be in either
    assert set(first.data.metrics) | set(rerun.data.metrics) == names
    assert {step: loss for step, loss in history(client, first).items() if step <= 10} == losses

    (offline,) = jobs[0]["wandb_runs"]  # rank 0 only: one W&B run for the job
    wandb_history = read_wandb_run(offline)["history"]
    assert {row["_step"]: row["loss"] for row in wandb_history if "loss" in row} == losses
    every_wandb_run = sorted((run_dir / "wandb").glob("offline-run-*"))
    every_wandb_row = [row for run in every_wandb_run for row in read_wandb_run(run)["history"]]
    assert names <= {key for row in every_wandb_row for key in row}


def test_mlflow_holds_params_config_and_summary(tracked_run):
    run_dir, _ = tracked_run
    client, (first, _) = mlflow_runs(run_dir)
    assert first.info.status == "FINISHED"
    assert first.data.params["parallelism.name"] == "ddp" and first.data.params["trainer.log_every"] == "2"
    artifacts = {artifact.path for artifact in client.list_artifacts(first.info.run_id)}
    assert artifacts == {"config.yaml", "config_step10.yaml", "summary.json"}  # the continued job's own config
    (saved,) = (run_dir / "mlflow-artifacts").glob(f"{first.info.run_id}/artifacts/summary.json")
    assert json.loads(saved.read_text())["steps"] == 12  # the continued job's summary


def test_continued_and_rerun_jobs_keep_one_value_per_step_in_every_tracker(tracked_run):
    """The requeue-like job continues the MLflow run; the rerun from step 10 (the run already held step 12) opens a
    new run linked to it, while TensorBoard purges the old step 12 and metrics.jsonl is rewound."""
    run_dir, jobs = tracked_run
    final = jobs[-1]["losses"]
    assert sorted(final) == [2, 4, 6, 8, 10, 12, 14]
    _, board = scalars(run_dir, "loss")
    assert board == pytest.approx(final, rel=1e-6)  # float32 in event files; one value per step
    client, (first, rerun) = mlflow_runs(run_dir)
    assert history(client, first) == jobs[1]["losses"]  # steps 2..12: the first job and its continuation
    assert rerun.data.tags["distrain.resumed_from_run"] == first.info.run_id
    assert rerun.data.tags["distrain.resumed_at_step"] == "10"
    assert history(client, rerun) == {12: final[12], 14: final[14]}
    summary = json.loads((run_dir / "summary.json").read_text())  # the whole run's, not only the last job's
    assert summary["metrics"]["loss"]["count"] == 7 and summary["first_logged_loss"] == final[2]


def test_a_failing_run_marks_its_tracker_runs_failed(tmp_path):
    args = [*FAST, "logger=[tensorboard,mlflow]", "trainer.max_steps=6", "hydra.run.dir=run"]
    done = run_train(args, tmp_path, env={"DISTRAIN_INJECT_FAULT": "raise:0:3"})
    assert done.returncode == 1
    client, (run,) = mlflow_runs(tmp_path / "run")
    assert run.info.status == "FAILED" and sorted(history(client, run)) == [1, 2, 3]  # the fault follows step 3
    assert sorted(scalars(tmp_path / "run", "loss")[1]) == [1, 2, 3]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:9"], "logger.mlflow.tracking_uri="),
        (["logger=mlflow", "logger.mlflow.tracking_uri=bogus://store"], "logger.mlflow.tracking_uri='bogus://store'"),
        (["logger=tensorboard", "logger.tensorboard.dir={tmp}/afile"], "logger.tensorboard.dir="),
        (["logger=[wandb,mlfow]"], "logger='mlfow' is not allowed: one of jsonl, mlflow, none, tensorboard, wandb"),
        (["logger.project=x"], "each tracker's keys sit under its name: logger.wandb.project"),
        (["logger=mlflow", "logger.mlflow.tags.team=nlp"], "a new tag is added with a plus: +logger.mlflow.tags.team="),
        (["logger=mlflow", "logger.mlflow.tracking_uri=file:///tmp/x"], "MLFLOW_ALLOW_FILE_STORE=true"),
        (["logger=tensorboard", "logger.wandb.project=x"], "select it with logger=wandb"),
    ],
)
def test_a_tracker_that_cannot_start_is_one_line_before_any_rank(overrides, expected, tmp_path):
    (tmp_path / "afile").write_text("")
    overrides = [override.format(tmp=tmp_path) for override in overrides]
    result = run_train([*FAST, *overrides, "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distrain: invalid config: ") and expected in lines[0], lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any rank started


def test_a_missing_tracker_package_names_the_extra(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "mlflow" else real_find_spec(name))
    with pytest.raises(ConfigError) as refused:
        validate_trackers(compose_config(["logger=[tensorboard,mlflow]"]))
    assert str(refused.value) == (
        "logger='mlflow' is not allowed: this tracker needs the mlflow package: pip install 'distrain[trackers]'"
    )


def test_a_tracker_that_fails_to_start_after_its_check_ends_the_job_in_one_line(tmp_path):
    """A web server that is not MLflow passes the reachability check; starting fails on rank 0, every rank learns
    it from rank 0 (no rank left waiting at a collective) and the job ends at once with one line."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        done = run_train([*FAST, "logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri={uri}"], tmp_path)
    finally:
        server.shutdown()
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("distrain: logger.mlflow could not start: API request"), done.stderr
    assert "SIGKILL" not in done.stderr  # no rank had to be killed after the grace period
