"""A checkpoint saved under one layout resumes under another with the model, optimizer and data position intact:
the resumed steps give the losses of continuing under the first layout (fsdp on 4 ranks -> hsdp 2 x 2; tensor
tp=2 -> ddp on 2 ranks, with one global batch across the two; Muon under fsdp -> ddp)."""

import json

import pytest
from helpers import FAST, run_train

COMMON = [*FAST, "checkpoint=default", "checkpoint.every_n_steps=3", "trainer.max_steps=6", "trainer.eval_every=0"]
CHANGES = {  # name -> (first layout, second layout)
    "fsdp4_to_hsdp2x2": (
        ["parallelism=fsdp", "distributed.nproc_per_node=4"],
        ["parallelism=hsdp", "parallelism.dp_replicate=2", "parallelism.dp=2", "distributed.nproc_per_node=4"],
    ),
    "tp2_to_ddp2": (
        ["parallelism=tensor", "data.global_batch_size=8", "distributed.nproc_per_node=2"],
        ["parallelism=ddp", "data.global_batch_size=8", "distributed.nproc_per_node=2"],
    ),
    "muon_fsdp2_to_ddp2": (  # Muon's momentum, sharded under FSDP, whole under DDP
        ["optimizer=muon", "parallelism=fsdp", "distributed.nproc_per_node=2"],
        ["optimizer=muon", "parallelism=ddp", "distributed.nproc_per_node=2"],
    ),
}


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records if "loss" in record}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_checkpoint_resumes_under_another_layout_as_if_the_first_had_continued(tmp_path, change):
    first, second = CHANGES[change]
    whole = run_train([*COMMON, *first, "hydra.run.dir=first"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    checkpoint = tmp_path / "first" / "checkpoints" / "step_00000003"
    resumed = run_train([*COMMON, *second, f"checkpoint.resume={checkpoint}", "hydra.run.dir=second"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    expected, got = losses(tmp_path / "first"), losses(tmp_path / "second")
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(expected[step], abs=1e-5), (step, got, expected)
