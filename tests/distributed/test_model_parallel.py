"""Model parallelism on 2 gloo ranks: pipeline under GPipe, 1F1B and interleaved 1F1B, and tensor parallelism give
the same losses as one process training the unsplit model and resume exactly from their sharded checkpoints;
balanced stages; bad inputs refused."""

import pytest
from helpers import FAST, compose_config, on_ranks, to_plain, train_steps

from distrain.parallelism.pipeline import balanced_split
from distrain.validate import ConfigError, validate

pytestmark = pytest.mark.distributed

STEPS = 10
COMMON = [*FAST, "model.n_layers=4", "data.micro_batch_size=4", "trainer.grad_accum_steps=2"]
SCHEDULES = {
    "gpipe": ["parallelism=pipeline", "parallelism.schedule=gpipe"],
    "1f1b": ["parallelism=pipeline", "parallelism.schedule=1f1b"],
    "interleaved": ["parallelism=pipeline", "parallelism.schedule=interleaved", "parallelism.virtual_stages=2"],
    "tensor": ["parallelism=tensor"],
}


@pytest.fixture(scope="module")
def single():
    cfg = to_plain(compose_config([*COMMON, "parallelism=single"]))
    return on_ranks(train_steps, 1, [cfg], STEPS)[0][0]["losses"]


@pytest.fixture(scope="module")
def pipelined():
    names = list(SCHEDULES)
    cfgs = [to_plain(compose_config([*COMMON, *SCHEDULES[n]])) for n in names]
    per_rank = on_ranks(train_steps, 2, cfgs, STEPS, 6)
    return {name: [per_rank[rank][i] for rank in (0, 1)] for i, name in enumerate(names)}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_model_parallel_follows_single_process_training(single, pipelined, schedule):
    for rank in (0, 1):  # pipeline: the last stage's loss, broadcast to every stage
        losses = pipelined[schedule][rank]["losses"]
        worst = max(abs(a - b) for a, b in zip(single, losses, strict=True))
        assert worst < 1e-5, f"{schedule} rank {rank}: max |loss - single-process loss| = {worst}"
    assert single[-1] < single[0] - 0.3


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_model_parallel_resumes_exactly_from_its_sharded_checkpoint(pipelined, schedule):
    for rank in (0, 1):
        result = pipelined[schedule][rank]
        assert result["resumed_from_step"] == 6
        assert result["resumed_losses"] == result["losses"][6:]


def test_stages_are_balanced_by_parameters():
    # 8 equal blocks, a large embedding on the first stage: the first stage gets fewer blocks.
    assert balanced_split([10] * 8, 2, first_extra=30, last_extra=0) == [0, 3, 8]
    assert balanced_split([10] * 4, 4, first_extra=0, last_extra=0) == [0, 1, 2, 3, 4]
    assert balanced_split([10] * 8, 2, first_extra=0, last_extra=0) == [0, 4, 8]


@pytest.mark.parametrize(
    "overrides,key,allowed",
    [
        (["parallelism.schedule=zigzag"], "parallelism.schedule", "one of gpipe, 1f1b, interleaved"),
        (["model.n_layers=1"], "parallelism", "at most model.n_layers (1) stages"),
        (["parallelism.microbatches=3"], "parallelism.microbatches", "a divisor of the 8 sequences"),
        (["parallelism.split_points=[1,2]"], "parallelism.split_points", "1 increasing block indices"),
        (["parallelism.schedule=interleaved", "parallelism.microbatches=1"], "parallelism.microbatches", "multiple"),
        (["parallelism=tensor", "model.n_heads=1"], "model.n_heads", "a multiple of the 2 tensor-parallel ranks"),
        (["parallelism=tensor", "model=mlp"], "model", "a model with attention"),
    ],
)
def test_bad_model_parallel_settings_are_refused(overrides, key, allowed):
    cfg = compose_config([*COMMON, "parallelism=pipeline", "distributed.nproc_per_node=2", *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == key and allowed in str(err.value)
