"""Model parallelism on 2 gloo ranks: pipeline under GPipe, 1F1B and interleaved 1F1B, and tensor parallelism give
the same losses as one process training the unsplit model and resume exactly from their sharded checkpoints;
balanced stages; bad inputs refused."""

import tempfile

import pytest
from helpers import FAST, compose_config, join, leave, on_ranks, to_plain, train_steps
from omegaconf import OmegaConf

from distrain.config.validate import ConfigError, validate
from distrain.parallelism.pipeline import balanced_split

STEPS = 10
COMMON = [*FAST, "model.n_layers=4", "data.micro_batch_size=4", "trainer.grad_accum_steps=2"]
SCHEDULES = {
    "gpipe": ["parallelism=pipeline", "parallelism.schedule=gpipe"],
    "1f1b": ["parallelism=pipeline", "parallelism.schedule=1f1b"],
    "interleaved": ["parallelism=pipeline", "parallelism.schedule=interleaved", "parallelism.virtual_stages=2"],
    "tensor": ["parallelism=tensor"],
    "tensor_both": ["parallelism=tensor", "parallelism.sequence_parallel=true", "parallelism.loss_parallel=true"],
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


HYBRID = {  # 4 ranks; (overrides, data-parallel degree). The tensor options: tensor_both above, on 2 ranks
    "dp2_tp2": (["parallelism=hybrid", "parallelism.tp=2"], 2),
    "dp2_pp2": (["parallelism=hybrid", "parallelism.pp=2"], 2),
    "dp2_tp2_replicate": (["parallelism=hybrid", "parallelism.tp=2", "parallelism.dp_mode=replicate"], 2),
}  # tp x pp: tests/integration/test_hybrid_3d.py (dp x tp x pp) and check_model's hybrid_tp2_pp2


@pytest.fixture(scope="module")
def hybrid():
    names = list(HYBRID)
    cfgs = [to_plain(compose_config([*COMMON, *HYBRID[n][0]])) for n in names]
    per_rank = on_ranks(train_steps, 4, cfgs, STEPS, 6)
    return {name: [per_rank[rank][i] for rank in range(4)] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def single_with_two_replicas_batch():
    """One process reading what 2 data-parallel ranks read together (the sampler makes these the same samples)."""
    cfg = to_plain(compose_config([*COMMON, "parallelism=single", "data.micro_batch_size=8"]))
    return on_ranks(train_steps, 1, [cfg], STEPS)[0][0]["losses"]


@pytest.mark.parametrize("layout", list(HYBRID))
def test_hybrid_mesh_follows_single_process_training(single, single_with_two_replicas_batch, hybrid, layout):
    """dp x tp and dp x pp on 4 ranks: the mean loss over ranks follows one process with the same global
    batch; tensor and pipeline peers report identical losses."""
    dp = HYBRID[layout][1]
    reference = single_with_two_replicas_batch if dp == 2 else single
    per_rank = [result["losses"] for result in hybrid[layout]]
    mean = [sum(step) / 4 for step in zip(*per_rank, strict=True)]
    worst = max(abs(a - b) for a, b in zip(reference, mean, strict=True))
    assert worst < 1e-5, f"{layout}: max |mean loss - single-process loss| = {worst}"
    assert reference[-1] < reference[0] - 0.3


@pytest.mark.parametrize("layout", list(HYBRID))
def test_hybrid_mesh_resumes_exactly_from_its_sharded_checkpoint(hybrid, layout):
    for rank, result in enumerate(hybrid[layout]):
        assert result["resumed_from_step"] == 6
        assert result["resumed_losses"] == result["losses"][6:], f"{layout} rank {rank}"


def test_replicated_data_parallel_axis_holds_whole_copies(hybrid):
    """dp_mode=replicate keeps each rank's tensor-parallel share whole on both dp ranks; fsdp halves it."""
    for rank in range(4):
        sharded, replicated = hybrid["dp2_tp2"][rank]["memory"], hybrid["dp2_tp2_replicate"][rank]["memory"]
        assert replicated["params"] == 2 * sharded["params"]
        assert replicated["optimizer"] == pytest.approx(2 * sharded["optimizer"], rel=0.01)


def test_recompute_stages_keep_the_losses():
    """Recomputing the first stage's (or every stage's) activations in backward changes memory, not the numbers."""
    cfgs = [
        to_plain(compose_config([*COMMON, *SCHEDULES["1f1b"], *extra]))
        # the new key, then its old name (still read)
        for extra in ([], ["parallelism.recompute_stages=[0]"], ["parallelism.activation_checkpointing=[0,1]"])
    ]
    plain, first, every = on_ranks(train_steps, 2, cfgs, 6)[0]
    assert first["losses"] == plain["losses"] and every["losses"] == plain["losses"]


def busy_and_schedule_seconds(cfg_dicts, steps):
    """Per config: this rank's seconds in forward/backward chunks and in the schedule (steps after the first), and
    the theoretical bubble."""
    from distrain.monitor.timing import pipeline_occupancy
    from distrain.trainer.build import build

    env = join(None)
    try:
        results = []
        for cfg_dict in cfg_dicts:
            run = build(OmegaConf.create(cfg_dict), env, run_dir=tempfile.mkdtemp())
            busy = total = 0.0
            for step in range(steps):
                marks = run.strategy.train_step(run.data.next_step()).marks
                measured = pipeline_occupancy(run.strategy.ctx.clock, marks)
                if step > 0:
                    busy, total = busy + measured["stage_busy"], total + measured["schedule"]
            results.append((busy, total, measured["theoretical_bubble"]))
        return results
    finally:
        leave()


def test_measured_bubble_shrinks_with_micro_batches_as_theory_says():
    """GPipe over 2 stages: with 1 micro-batch each stage idles half of the pipeline's time (theory 1/2), with 8
    about 1/9. Measured as the metrics do (each rank's busy time over the longest rank's schedule time), the
    fractions must order the same way, far apart."""
    base = [*COMMON, "model.d_model=256", "model.max_seq_len=128", "data.micro_batch_size=16"]
    base += ["trainer.grad_accum_steps=1"]
    cfgs = [
        to_plain(compose_config([*base, *SCHEDULES["gpipe"], f"parallelism.pipeline_microbatches={m}"])) for m in (1, 8)
    ]
    per_rank = on_ranks(busy_and_schedule_seconds, 2, cfgs, 6)
    for index, theory in enumerate((1 / 2, 1 / 9)):
        assert all(per_rank[rank][index][2] == pytest.approx(theory) for rank in (0, 1))
    one, eight = (
        [1 - per_rank[rank][index][0] / max(per_rank[r][index][1] for r in (0, 1)) for rank in (0, 1)]
        for index in (0, 1)
    )
    for rank in (0, 1):
        assert one[rank] > 0.35 and one[rank] > eight[rank] + 0.15, (rank, one, eight)


def test_stages_are_balanced_by_parameters():
    # 8 equal blocks, a large embedding on the first stage: the first stage gets fewer blocks.
    assert balanced_split([10] * 8, 2, first_extra=30, last_extra=0) == [0, 3, 8]
    assert balanced_split([10] * 4, 4, first_extra=0, last_extra=0) == [0, 1, 2, 3, 4]
    assert balanced_split([10] * 8, 2, first_extra=0, last_extra=0) == [0, 4, 8]


@pytest.mark.parametrize(
    "overrides,key,allowed",
    [
        (["model.n_layers=1"], "parallelism", "at most 1 stages (the model's blocks)"),
        (["parallelism.pipeline_microbatches=3"], "parallelism.pipeline_microbatches", "a divisor of the 8 sequences"),
        (["parallelism.split_points=[1,2]"], "parallelism.split_points", "1 increasing block indices"),
        (
            ["parallelism.schedule=interleaved", "parallelism.pipeline_microbatches=1"],
            "parallelism.pipeline_microbatches",
            "multiple",
        ),
        (["parallelism=tensor", "model.n_heads=1"], "model.n_heads", "a multiple of the 2 tensor-parallel ranks"),
        (["parallelism=tensor", "model=mlp"], "model", "has no tensor-parallel plan"),
        (["parallelism=hybrid", "parallelism.pp=2", "parallelism.dp=2"], "parallelism.dp", "product is the world"),
        (["parallelism=hybrid", "parallelism.tp=2", "model.n_heads=1"], "model.n_heads", "2 tensor-parallel ranks"),
        (["parallelism=hybrid", "parallelism.pp=2", "model.n_layers=1"], "parallelism", "at most 1 stages"),
        (
            ["parallelism=hybrid", "parallelism.pp=2", "parallelism.pipeline_microbatches=3"],
            "parallelism.pipeline_microbatches",
            "8",
        ),
        (
            ["parallelism=hybrid", "parallelism.pp=2", "parallelism.loss_parallel=true"],
            "parallelism.loss_parallel",
            "pp",
        ),
        (["parallelism=tensor", "parallelism.sequence_parallel=true", "model.max_seq_len=33"], "data.seq_len", "2 "),
        (["parallelism=tensor", "parallelism.loss_parallel=true", "model.vocab_size=257"], "model.vocab_size", "2 "),
    ],
)
def test_bad_model_parallel_settings_are_refused(overrides, key, allowed):
    cfg = compose_config([*COMMON, "parallelism=pipeline", "distributed.nproc_per_node=2", *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == key and allowed in str(err.value)
