"""Reliability through train.py: every strategy at world size 1, a finished run resumed, checkpoint directory
locks, a full disk during a save, a rank that stops responding."""

import json

import pytest
from helpers import FAST, run_train

pytestmark = pytest.mark.integration

ONE_RANK = [*FAST, "distributed.nproc_per_node=1", "trainer.max_steps=4", "hydra.run.dir=run"]
# Every strategy and communication option that can run on one rank; all compute the same fp32 math there.
WORLD_SIZE_ONE = {
    "single": ["parallelism=single"],
    "ddp": ["parallelism=ddp"],
    "fsdp": ["parallelism=fsdp"],
    "zero1": ["parallelism=zero", "stage=1"],
    "zero3": ["parallelism=zero", "stage=3"],
    "tensor": ["parallelism=tensor"],
    "pipeline": ["parallelism=pipeline"],
    "interleaved": ["parallelism=pipeline", "parallelism.schedule=interleaved"],
    "hybrid": ["parallelism=hybrid"],
    "ddp_powersgd": ["parallelism=ddp", "comm=powersgd"],
    "ddp_bf16": ["parallelism=ddp", "comm=bf16"],
    "ddp_hierarchical": ["parallelism=ddp", "comm=hierarchical"],
    "ddp_topk": ["parallelism=ddp", "comm=topk"],  # top-k changes the update even on one rank
}


def strict_json(path):
    """The file parsed as standard JSON: NaN, Infinity and -Infinity are refused."""

    def refuse(constant):
        raise ValueError(f"{path} holds {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def single_process_val_loss(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    result = run_train([*ONE_RANK, "parallelism=single"], root)
    assert result.returncode == 0, result.stderr
    return strict_json(root / "run" / "summary.json")["final_val_loss"]


@pytest.mark.parametrize("name", sorted(WORLD_SIZE_ONE))
def test_every_strategy_finishes_on_one_rank_with_a_valid_summary(tmp_path, single_process_val_loss, name):
    """World size 1 (what a one-GPU machine gets by default): the run ends with exit 0 and a summary.json and
    metrics.jsonl that are standard JSON; the dense strategies reach the single process's validation loss."""
    result = run_train([*ONE_RANK, *WORLD_SIZE_ONE[name], "checkpoint=default", "checkpoint.every_n_steps=2"], tmp_path)
    assert result.returncode == 0, result.stderr
    summary = strict_json(tmp_path / "run" / "summary.json")
    assert summary["steps"] == 4 and summary["world_size"] == 1
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda constant: pytest.fail(f"metrics.jsonl holds {constant}"))
    assert all(stats["count"] >= 1 for stats in summary["metrics"].values())
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    if name != "ddp_topk":
        assert summary["final_val_loss"] == pytest.approx(single_process_val_loss, abs=1e-5)
