"""TensorBoard, MLflow and W&B at once: each read back with its own reader, holding the run's falling loss under the
names metrics.jsonl uses; a continued job continues the same runs; a tracker that cannot start is one line."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import FAST, compose_config, run_train
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distrain.logger.wandb_files import read_wandb_run
from distrain.validate import ConfigError, validate_trackers

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

TRACKED = [*FAST, "logger=[wandb,tensorboard,mlflow]", "trainer.log_every=2", "checkpoint=default"]
NO_CREDENTIALS = {"WANDB_MODE": None, "WANDB_API_KEY": None}


def logged(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def scalars(run_dir, tag):
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events, {event.step: event.value for event in events.Scalars(tag)}


def mlflow_run(run_dir):
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("distrain")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # rank 0 only: one run per job
    return client, runs[0]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """Two DDP ranks, 10 steps, all three trackers; then the job continued to step 14 in the same directory."""
    work = tmp_path_factory.mktemp("trackers")
    env = NO_CREDENTIALS | {"HOME": str(work)}
    first = run_train([*TRACKED, "trainer.max_steps=10", "hydra.run.dir=run"], work, env=env)
    assert first.returncode == 0, first.stderr
    run_dir = work / "run"
    before = {
        "records": logged(run_dir),
        "mlflow_id": (run_dir / "mlflow_run_id").read_text().strip(),
        "wandb_runs": sorted((run_dir / "wandb").glob("offline-run-*")),
    }
    resumed = run_train(
        [*TRACKED, "trainer.max_steps=14", "hydra.run.dir=run", "checkpoint.resume=auto"], work, env=env
    )
    assert resumed.returncode == 0, resumed.stderr
    return run_dir, before


def test_every_tracker_holds_the_falling_loss_under_the_same_names(tracked_run):
    run_dir, before = tracked_run
    records = before["records"]
    losses = {r["step"]: r["loss"] for r in records}
    assert list(losses.values())[-1] < list(losses.values())[0]  # the model learns: each tracker shows a falling loss
    names = {key for r in records for key, value in r.items() if key != "step" and isinstance(value, (int, float))}

    events, board = scalars(run_dir, "loss")
    assert set(events.Tags()["scalars"]) == names
    assert {step: board[step] for step in losses} == pytest.approx(losses, rel=1e-6)  # float32 in event files

    client, run = mlflow_run(run_dir)
    assert run.info.run_id == before["mlflow_id"]
    assert set(run.data.metrics) == names
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert {step: history[step] for step in losses} == losses

    (offline,) = before["wandb_runs"]
    wandb_history = read_wandb_run(offline)["history"]
    assert {row["_step"]: row["loss"] for row in wandb_history if "loss" in row} == losses
    assert names <= {key for row in wandb_history for key in row}


def test_mlflow_holds_params_config_and_summary(tracked_run):
    run_dir, _ = tracked_run
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED"
    assert run.data.params["parallelism.name"] == "ddp" and run.data.params["trainer.log_every"] == "2"
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"config.yaml", "summary.json"}
    (saved,) = (run_dir / "mlflow-artifacts").glob(f"{run.info.run_id}/artifacts/summary.json")
    summary = json.loads(saved.read_text())
    assert summary == json.loads((run_dir / "summary.json").read_text())


def test_a_continued_job_continues_each_trackers_run(tracked_run):
    """The second job (resumed at step 10) logs steps 12 and 14 into the same MLflow run and TensorBoard logdir."""
    run_dir, _ = tracked_run
    steps = [r["step"] for r in logged(run_dir)]
    assert steps == [2, 4, 6, 8, 10, 12, 14]
    client, run = mlflow_run(run_dir)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == steps
    _, board = scalars(run_dir, "loss")
    assert sorted(board) == steps


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:9"], "logger.mlflow.tracking_uri="),
        (["logger=mlflow", "logger.mlflow.tracking_uri=bogus://store"], "logger.mlflow.tracking_uri='bogus://store'"),
        (["logger=tensorboard", "logger.tensorboard.dir={tmp}/afile"], "logger.tensorboard.dir="),
        (["logger=[wandb,mlfow]"], "logger='mlfow' is not allowed: one of jsonl, mlflow, none, tensorboard, wandb"),
        (["logger.project=x"], "each tracker's keys sit under its name"),
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
