"""``parallelism=hybrid parallelism.ep=N`` through train.py: moe_tiny's experts split over N of the data-parallel
ranks (all-to-all dispatch and combine, FSDP2 on the rest) train with the losses of one process, log the all-to-all
bytes, resume from their checkpoint under another layout, and bad settings are refused in one line."""

import json

import pytest
from helpers import compose_config, run_train

from distrain.config.validate import ConfigError, validate

COMMON = [
    "model=moe_tiny", "data.corpus.max_bytes=200000", "data.seq_len=64", "data.micro_batch_size=2",
    "data.global_batch_size=8", "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=0",
    "logger=none",
]  # fmt: skip
NO_CHECKPOINT = ["checkpoint=none"]
LAYOUTS = {
    "ep2": ["parallelism=hybrid", "parallelism.ep=2", "distributed.nproc_per_node=2"],
}
TWO_COPIES = ["parallelism=hybrid", "parallelism.ep=2", "distributed.nproc_per_node=4"]  # dp 4: 2 copies per expert


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    done = run_train([*COMMON, *NO_CHECKPOINT, "parallelism=single", "hydra.run.dir=run"], root)
    assert done.returncode == 0, done.stderr[-3000:]
    return [record["loss"] for record in metrics(root / "run")]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_trains_like_one_process_and_logs_its_traffic(tmp_path, single, layout):
    done = run_train([*COMMON, *NO_CHECKPOINT, *LAYOUTS[layout], "hydra.run.dir=run"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics(tmp_path / "run")
    assert [r["loss"] for r in records] == pytest.approx(single, abs=1e-4)
    assert single[-1] < single[0] - 0.3
    assert all(r["moe_all_to_all_bytes"] > 0 for r in records)  # logged only when the experts are split


def test_two_copies_of_each_expert_train_like_one_process_and_resume_under_fsdp(tmp_path, single):
    """ep 2 on 4 ranks: the ranks holding the same experts reduce their gradients; its checkpoint (expert DTensors
    on the ep axis, FSDP shards of the rest) resumes under fsdp on 2 ranks with the same next losses."""
    saved = [*COMMON, "checkpoint=default", "checkpoint.every_n_steps=3"]
    first = run_train([*saved, *TWO_COPIES, "hydra.run.dir=first"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    expected = {r["step"]: r["loss"] for r in metrics(tmp_path / "first")}
    assert [expected[step] for step in range(1, 7)] == pytest.approx(single, abs=1e-4)
    checkpoint = tmp_path / "first" / "checkpoints" / "step_00000003"
    fsdp = ["parallelism=fsdp", "distributed.nproc_per_node=2", f"checkpoint.resume={checkpoint}"]
    second = run_train([*saved, *fsdp, "hydra.run.dir=second"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    got = {r["step"]: r["loss"] for r in metrics(tmp_path / "second")}
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([expected[s] for s in (4, 5, 6)], abs=1e-5)


@pytest.mark.parametrize(
    "overrides,key,allowed",
    [
        (
            ["parallelism.ep=3", "distributed.nproc_per_node=3", "data.global_batch_size=6"],
            "parallelism.ep",
            "a divisor of the model's 8 experts",
        ),
        (["parallelism.ep=4"], "parallelism.ep", "a divisor of the data-parallel degree dp = 2"),
        (["model=llama_tiny"], "parallelism.ep", "its spec splits no experts"),
        (["parallelism.cp=2", "distributed.nproc_per_node=4"], "parallelism.cp", "1 with parallelism.ep > 1"),
        (["parallelism.ep=0"], "parallelism.ep", ">= 1"),
    ],
)
def test_bad_expert_parallel_settings_are_refused_in_one_line(overrides, key, allowed):
    cfg = compose_config([*COMMON, *NO_CHECKPOINT, *LAYOUTS["ep2"], *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == key and allowed in str(err.value), str(err.value)


# moe_tiny without expert parallelism: FSDP trains it and logs its routing; model parallelism is refused.
MOE_TRAIN = ["model=moe_tiny", "checkpoint=none", "logger=none", "data.corpus.max_bytes=200000", "hydra.run.dir=run"]


def test_fsdp_trains_and_logs_routing_metrics(tmp_path):
    result = run_train([*MOE_TRAIN, "parallelism=fsdp", "trainer.max_steps=8", "trainer.log_every=1"], tmp_path)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert {"moe_load_balance", "moe_z_loss", "moe_max_load"} <= records[-1].keys()
    assert sum(records[-1][f"moe_expert{i}_frac"] for i in range(8)) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "parallelism, reason",
    [("tensor", "has no tensor-parallel plan"), ("pipeline", "adds an auxiliary loss inside its blocks")],
)
def test_model_parallel_strategies_are_refused_before_any_rank_starts(tmp_path, parallelism, reason):
    result = run_train([*MOE_TRAIN, f"parallelism={parallelism}", "trainer.max_steps=2"], tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert reason in line and "moe" in line
