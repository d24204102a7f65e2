"""ZeRO's communication buffers are sized to the model unless set: a ZeRO-2 run of the default model holds
gradient buckets of about its parameter bytes (DeepSpeed's 5e8-element default held 2 GB), measured while backward
fills them and reported in summary.json beside parameters, gradients and optimizer state."""

from __future__ import annotations

import json

import pytest
from helpers import run_train

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

ZERO = ["parallelism=zero", "trainer.max_steps=2", "logger=none", "checkpoint=none", "hydra.run.dir=run"]


def finished(tmp_path, *overrides):
    done = run_train([*ZERO, *overrides], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    settings = json.loads((tmp_path / "run" / "deepspeed_config.json").read_text())["zero_optimization"]
    return summary, settings


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_buffers_are_sized_to_the_default_model_and_planned(stage, tmp_path):
    summary, settings = finished(tmp_path, f"stage={stage}")
    param_bytes = summary["model_parameters"] * 4  # fp32
    assert settings["reduce_bucket_size"] >= summary["model_parameters"]
    buffers = summary["model_state_bytes"]["buffers"]
    assert 0 < buffers <= 4 * param_bytes, summary["model_state_bytes"]
    planned = run_train([*ZERO, f"stage={stage}", "dry_run=true", "hydra.run.dir=plan"], tmp_path)
    assert planned.returncode == 0, planned.stderr
    (rank,) = json.loads((tmp_path / "plan" / "dry_run.json").read_text())["ranks"]
    assert abs(rank["buffers"] / buffers - 1) < 0.01, (rank["buffers"], buffers)  # the dry run counts the bucket


def test_a_set_bucket_size_is_used_and_its_buffer_measured(tmp_path):
    summary, settings = finished(tmp_path, "stage=2", "parallelism.reduce_bucket_size=100000000")
    assert settings["reduce_bucket_size"] == 100_000_000
    assert summary["model_state_bytes"]["buffers"] >= 100_000_000 * 4  # one fp32 bucket, held during backward
