"""``parallelism=hsdp``: FSDP2 over a 2-D (replicate, shard) mesh trains with DDP's losses and holds half of DDP's
model state per rank on 4 ranks (2 copies x 2 shards); its default puts one copy on each node."""

import json

import pytest
from helpers import FAST, REPO, compose_config, run_train

from distrain.config.validate import ConfigError, validate
from distrain.parallelism.layout import Layout

FOUR = [*FAST, "distributed.nproc_per_node=4", "trainer.max_steps=4", "trainer.log_every=1"]


def run(tmp_path, name, *overrides):
    done = run_train([*FOUR, *overrides, f"hydra.run.dir={tmp_path / name}"], cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    measured = summary["model_state_bytes"]["total"]
    # The ZeRO formula's prediction, from the resolved degrees (FSDP over dp, whole copies over replicas).
    assert abs(summary["predicted_model_state_bytes"] / measured - 1) < 0.01, (
        summary["predicted_model_state_bytes"],
        measured,
    )
    return [r["loss"] for r in records if "loss" in r], measured


def test_hsdp_on_2x2_has_ddps_losses_and_half_its_model_state(tmp_path):
    hsdp_losses, hsdp_state = run(
        tmp_path, "hsdp", "parallelism=hsdp", "parallelism.dp_replicate=2", "parallelism.dp=2"
    )
    ddp_losses, ddp_state = run(tmp_path, "ddp", "parallelism=ddp")
    assert len(hsdp_losses) == 4 and max(abs(a - b) for a, b in zip(hsdp_losses, ddp_losses, strict=True)) < 1e-3
    assert abs(hsdp_state / ddp_state - 0.5) < 0.01, (hsdp_state, ddp_state)


def test_the_default_is_one_copy_per_node():
    assert Layout.resolve(dp=-1, tp=1, pp=1, world_size=16, replicate=-1, ranks_per_node=8).replicate == 2
    assert Layout.resolve(dp=-1, tp=1, pp=1, world_size=16, replicate=-1, ranks_per_node=8).dp == 8
    with pytest.raises(ConfigError, match="parallelism.dp.*product is the world size 2"):
        validate(compose_config([*FAST, "parallelism=hsdp", "parallelism.dp_replicate=2", "parallelism.dp=2"]))


def test_two_nodes_with_the_shard_degree_set_plan_in_one_line_or_fit():
    from distrain.planning.dry_run import plan

    two_nodes = [*FAST, "dry_run=true", "target.nodes=2", "target.ranks_per_node=4", "parallelism=hsdp"]
    report = plan(compose_config([*two_nodes, "parallelism.dp=4"]))  # 2 copies (one per node) x 4 shards
    assert report.fits and report.data_parallel == 8
    # The global batch divides over both copies' shards: 16 sequences = micro-batch 1 x 8 ranks x 2 micro-steps.
    batch = plan(
        compose_config([*two_nodes, "parallelism.dp=4", "data.global_batch_size=16", "data.micro_batch_size=1"])
    )
    assert batch.data_parallel == 8 and batch.global_batch_size == 16
    with pytest.raises(ConfigError, match="parallelism.dp_replicate=-1 is not allowed: 1 with dp_mode=replicate"):
        plan(compose_config([*two_nodes, "parallelism.dp_mode=replicate"]))
