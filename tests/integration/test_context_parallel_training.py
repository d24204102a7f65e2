"""``parallelism=hybrid parallelism.cp=N`` through train.py: every sequence split over the cp ranks (load-balanced)
trains llama_tiny with the losses of one process, alone and composed with dp and tp; bad settings refused."""

import json

import pytest
from helpers import compose_config, run_train

from distrain.config.validate import ConfigError, validate

COMMON = [
    "model=llama_tiny", "data.corpus.max_bytes=200000", "data.seq_len=64", "data.micro_batch_size=4",
    "data.global_batch_size=8", "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=3",
    "checkpoint=none", "logger=none",
]  # fmt: skip
LAYOUTS = {
    "cp2": ["parallelism=hybrid", "parallelism.cp=2", "distributed.nproc_per_node=2"],
    "dp2_cp2": ["parallelism=hybrid", "parallelism.cp=2", "distributed.nproc_per_node=4"],
    "cp2_tp2": ["parallelism=hybrid", "parallelism.cp=2", "parallelism.tp=2", "distributed.nproc_per_node=4"],
}


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    done = run_train([*COMMON, "parallelism=single", "hydra.run.dir=run"], root)
    assert done.returncode == 0, done.stderr[-3000:]
    return metrics(root / "run")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_trains_like_one_process(tmp_path, single, layout):
    done = run_train([*COMMON, *LAYOUTS[layout], "hydra.run.dir=run"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = metrics(tmp_path / "run")
    assert [r["step"] for r in got] == [r["step"] for r in single] == list(range(1, 7))
    # Validation reads eval_batches per data-parallel rank, so with dp=2 it averages over other sequences.
    keys = ("loss",) if layout.startswith("dp2") else ("loss", "val_loss")
    for mine, reference in zip(got, single, strict=True):
        for key in keys:
            if key in reference:
                assert mine[key] == pytest.approx(reference[key], abs=1e-4), (layout, mine["step"], key)
    assert single[-1]["loss"] < single[0]["loss"] - 0.3


@pytest.mark.parametrize(
    "overrides,key,allowed",
    [
        (["data.seq_len=30"], "data.seq_len", "a multiple of 2 x parallelism.cp = 4"),
        (["model=gpt_tiny"], "parallelism.cp", "its spec has no context-parallel attention"),
        (["parallelism.pp=2", "distributed.nproc_per_node=4"], "parallelism.pp", "1 with parallelism.cp > 1"),
        (["parallelism.sequence_parallel=true"], "parallelism.sequence_parallel", "false with parallelism.cp > 1"),
        (["parallelism.cp=0"], "parallelism.cp", ">= 1"),
        (["parallelism.cp=3"], "parallelism.cp", "does not divide the world size 2"),
    ],
)
def test_bad_context_parallel_settings_are_refused_in_one_line(overrides, key, allowed):
    cfg = compose_config([*COMMON, *LAYOUTS["cp2"], *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == key and allowed in str(err.value), str(err.value)
