"""parallelism=hybrid in three dimensions through train.py: 8 ranks as dp 2 x tp 2 x pp 2 train like one process
with the same global batch, and resume from their sharded checkpoint to the same end."""

import json

import pytest
from helpers import FAST, run_train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

THREE_D = ["parallelism=hybrid", "parallelism.tp=2", "parallelism.pp=2", "distributed.nproc_per_node=8"]
COMMON = [*FAST, "checkpoint=default", "checkpoint.every_n_steps=4", "trainer.max_steps=8", "trainer.eval_every=4"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_three_dimensional_mesh_trains_like_one_process_and_resumes(tmp_path):
    three_d = run_train([*COMMON, *THREE_D, "hydra.run.dir=three_d"], tmp_path, timeout=600)
    assert three_d.returncode == 0, three_d.stderr[-3000:]
    # One process reading the 2 data-parallel ranks' sequences together.
    single = run_train([*COMMON, "parallelism=single", "data.micro_batch_size=8", "hydra.run.dir=single"], tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    got, expected = metrics(tmp_path / "three_d"), metrics(tmp_path / "single")
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for mine, reference in zip(got, expected, strict=True):
        for key in ("loss", "val_loss"):
            if key in reference:
                assert mine[key] == pytest.approx(reference[key], abs=1e-5), (mine["step"], key)

    checkpoint = tmp_path / "three_d" / "checkpoints" / "step_00000004"
    resumed = run_train(
        [*COMMON, *THREE_D, "hydra.run.dir=resumed", f"checkpoint.resume={checkpoint}"], tmp_path, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = {r["step"]: r["loss"] for r in metrics(tmp_path / "resumed")}
    assert min(after) == 5
    assert after == {r["step"]: r["loss"] for r in got if r["step"] > 4}
