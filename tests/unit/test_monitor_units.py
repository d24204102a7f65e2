"""Units of monitoring: the GPU peak table, the step split, statistics, W&B mode and run-id choice."""

import re

import pytest
import torch

from distrain.monitor.flops import gpu_peak_flops
from distrain.monitor.timing import Clock, phase_seconds
from distrain.trackers.base import WANDB_ID_FILE, TrackedRun, WandbTracker
from distrain.trackers.reporter import metric_statistics


@pytest.mark.parametrize(
    "name,low_precision,peak",
    [
        ("NVIDIA H100 80GB HBM3", True, 989e12),
        ("NVIDIA H100 PCIe", True, 756e12),
        ("NVIDIA A100-SXM4-80GB", True, 312e12),
        ("NVIDIA A100-SXM4-80GB", False, 19.5e12),
        ("NVIDIA H200", True, 989e12),
        ("Some Future GPU", True, None),
    ],
)
def test_gpu_peak_table_matches_device_names(name, low_precision, peak):
    assert gpu_peak_flops(name, low_precision) == peak


def test_step_split_subtracts_exposed_communication_from_compute():
    marks = {"step_start": 0.0, "data_ready": 0.5, "comm_launch": 2.0, "backward_done": 3.0, "optimizer_done": 3.25}
    split = phase_seconds(Clock(torch.device("cpu")), marks)
    assert split == {"data": 0.5, "compute": 1.5, "comm": 1.0, "optimizer": 0.25}
    del marks["comm_launch"]  # a strategy without a hook: communication stays inside compute
    split = phase_seconds(Clock(torch.device("cpu")), marks)
    assert split["compute"] == 2.5 and split["comm"] != split["comm"]  # NaN


def test_statistics_over_records():
    stats = metric_statistics([{"step": 1, "loss": 2.0, "tag": "x"}, {"step": 2, "loss": 4.0}])
    assert stats == {"loss": {"mean": 3.0, "std": 1.0, "min": 2.0, "max": 4.0, "count": 2}}


def tracker(mode="auto"):
    return WandbTracker(project="p", entity=None, group=None, tags=[], name=None, mode=mode)


def test_wandb_is_offline_without_credentials_and_online_with_them(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert tracker().resolved_mode() == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password secret\n")
    (tmp_path / ".netrc").chmod(0o600)  # netrc refuses a password file others can read
    assert tracker().resolved_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert tracker().resolved_mode() == "disabled"
    assert tracker("offline").resolved_mode() == "offline"


def test_a_tracker_run_id_is_kept_in_the_run_directory(tmp_path):
    old_run = tmp_path / "old"
    (old_run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (old_run / WANDB_ID_FILE).write_text("abc123\n")
    new_run = tmp_path / "new"
    new_run.mkdir()
    resumed = TrackedRun(new_run, "new", None, {}, str(old_run / "checkpoints" / "step_00000010"), 10)
    assert resumed.recorded_id(WANDB_ID_FILE) == "abc123"
    assert TrackedRun(new_run, "new", None, {}).recorded_id(WANDB_ID_FILE) is None
    (new_run / WANDB_ID_FILE).write_text("def456\n")  # this directory's own id first (a requeued job)
    assert resumed.recorded_id(WANDB_ID_FILE) == "def456"


def test_a_relative_mlflow_store_is_made_absolute_for_the_saved_config(tmp_path, monkeypatch):
    from distrain.trackers.mlflow_tracker import absolute_tracking_uri

    monkeypatch.chdir(tmp_path)
    assert absolute_tracking_uri("sqlite:///runs/m.db") == f"sqlite:///{tmp_path / 'runs' / 'm.db'}"
    assert absolute_tracking_uri("mlruns") == str(tmp_path / "mlruns")
    for kept in ("sqlite:////srv/m.db", "http://tracking:5000", "file:///srv/mlruns", None):
        assert absolute_tracking_uri(kept) == kept


def test_each_tracker_makes_its_own_relative_paths_absolute_in_the_saved_config(tmp_path, monkeypatch):
    from helpers import FAST, compose_config

    from distrain.config.validate import make_paths_absolute

    overrides = [*FAST, "logger=[jsonl,tensorboard,mlflow]", "logger.jsonl.path=runs.jsonl"]
    overrides += ["logger.tensorboard.dir=tb", "logger.mlflow.tracking_uri=sqlite:///m.db"]
    cfg = compose_config(overrides)
    monkeypatch.chdir(tmp_path)
    make_paths_absolute(cfg)
    assert cfg.logger.jsonl.path == str(tmp_path / "runs.jsonl")
    assert cfg.logger.tensorboard.dir == str(tmp_path / "tb")
    assert cfg.logger.mlflow.tracking_uri == f"sqlite:///{tmp_path / 'm.db'}"


def test_a_console_line_survives_missing_and_non_finite_metrics():
    from distrain.trackers.console import step_line

    line = step_line({"step": 3, "loss": float("nan"), "lr": None, "mfu": 0.25, "step_time_s": float("inf")}, 10)
    assert line == "step 3/10 | loss nan | mfu 25.0%"
    full = {"step": 10, "loss": 4.6227, "lr": 1.65e-3, "grad_norm": 4.08, "tokens_per_s": 15313.0, "step_time_s": 0.13}
    assert step_line(full, 200) == "step 10/200 | loss 4.623 | lr 1.65e-03 | grad 4.08 | 15.3k tok/s | eta 0:00:24"


def test_the_summary_table_says_no_validation_apart_from_a_diverged_one():
    """A run stopped before its first validation has no validation loss ('-'); a diverged one shows nan."""
    from distrain.trackers.console import summary_table

    summary = {"steps": 5, "stopped_by": "SIGTERM", "layout": "zero stage 3", "world_size": 2, "precision": "bf16"}

    def rows(final_val_loss):
        table = summary_table(summary | {"final_val_loss": final_val_loss, "final_train_loss": 3.5}, "/runs/a")
        return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in table.splitlines()[1:])

    assert rows(None)["val loss"] == "-" and rows(float("nan"))["val loss"] == "nan"
    summary |= {"layout": "ddp", "comm": "topk"}
    assert rows(None)["layout"] == "ddp with comm=topk on 2 ranks, bf16"
    summary |= {"layout": "zero stage 3", "comm": "default"}
    assert rows(None)["layout"] == "zero stage 3 on 2 ranks, bf16" and rows(None)["steps"] == "5 (stopped by SIGTERM)"


@pytest.mark.parametrize(
    "overrides, world_size, expected",
    [
        (["parallelism=ddp"], 2, "ddp"),
        (["parallelism=zero", "parallelism.stage=3"], 2, "zero stage 3"),
        (["parallelism=hsdp", "parallelism.dp_replicate=2", "parallelism.dp=2"], 4,
         "hsdp (dp_replicate 2 x dp 2, fsdp stage 3)"),
        (["parallelism=fsdp", "parallelism.fsdp_stage=2"], 4, "fsdp (dp 4, fsdp stage 2)"),
        (["parallelism=hybrid", "parallelism.dp=2", "parallelism.tp=2", "parallelism.dp_mode=replicate"], 4,
         "hybrid (dp 2 x tp 2, dp replicated)"),
        (["parallelism=hybrid", "parallelism.ep=2"], 4, "hybrid (dp 4; ep 2 of dp, fsdp stage 3)"),
        (["parallelism=pipeline"], 2, "pipeline (pp 2)"),
        (["parallelism=hybrid", "parallelism.cp=2"], 2, "hybrid (cp 2, fsdp stage 3)"),
    ],
)  # fmt: skip
def test_the_layout_line_names_the_degrees_whose_product_is_the_world_and_how_dp_holds_the_model(
    overrides, world_size, expected
):
    """The summary's layout line, from the one layout every strategy's config resolves to."""
    from helpers import compose_config

    from distrain.parallelism.describe import layout_description
    from distrain.parallelism.layout import layout_of

    cfg = compose_config(overrides)
    layout = layout_of(cfg.parallelism, world_size, ranks_per_node=world_size)
    assert layout.world_size == world_size
    assert layout_description(cfg.parallelism, layout) == expected
