"""train.py with Muon under FSDP learns and prints its parameter groups; impossible optimizer settings end in one
line before any rank starts."""

import json

import pytest
from helpers import FAST, compose_config, run_train
from hydra.utils import instantiate

from distrain.models.spec import spec_of


def test_muon_under_fsdp_learns_prints_its_groups_and_sends_each_shard_twice(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*FAST, "model=llama_tiny", "optimizer=muon", "parallelism=fsdp", "trainer.max_steps=30"]
    result = run_train([*overrides, "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert "parameter groups (muon):" in output and "muon, decay  matrix" in output
    groups = {g["group"]: g for g in json.loads((run_dir / "param_groups.json").read_text())}
    assert groups["muon, decay"]["rules"] == ["matrix"] and groups["no_decay"]["rules"] == ["norm"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 1.0
    # On 2 ranks each matrix's other half travels once to its owner and once back: half of every matrix per rank.
    model = instantiate(compose_config(overrides).model)
    roles = spec_of(model).parameter_roles(model)
    matrix_elements = sum(p.numel() for name, p in model.named_parameters() if roles[name] == "matrix")
    assert {r["optimizer_bytes_sent"] for r in records if "loss" in r} == {4 * matrix_elements / 2}


# Globs take characters Hydra's command-line keys do not (*): they come in a YAML file, here a user's own option.
TWO_GLOBS = """defaults:
  - adamw
  - _self_
lr_multipliers:
  "blocks.*": 2.0
  "*.weight": 3.0
"""


@pytest.mark.parametrize(
    "overrides,line",
    [
        (
            ["optimizer=muon", "parallelism=zero", "optimizer.nesterov=false"],
            "optimizer.nesterov=false is not allowed: true with optimizer=muon parallelism=zero (DeepSpeed's Muon)",
        ),
        (["optimizer=two_globs"], "'*.weight' is not allowed: parameter blocks.0.attn_norm.weight is also named by"),
    ],
)
def test_impossible_optimizer_settings_are_one_line(tmp_path, overrides, line):
    (tmp_path / "my_conf" / "optimizer").mkdir(parents=True)
    (tmp_path / "my_conf" / "optimizer" / "two_globs.yaml").write_text(TWO_GLOBS)
    result = run_train(["--config-dir", str(tmp_path / "my_conf"), *FAST, *overrides], tmp_path)
    assert result.returncode != 0
    assert line in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
