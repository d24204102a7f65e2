"""ZeRO 1/2/3 (real DeepSpeed engine) and FSDP2 stages 2/3 on 2 gloo ranks: same losses as DDP in fp32, measured
model-state memory close to the ZeRO formulas, sharded checkpoints that resume exactly."""

import pytest
from helpers import FAST, compose_config, on_ranks, to_plain, train_steps

from distrain.planning.dry_run import plan

STEPS = 20
STRATEGIES = {
    "ddp": ["parallelism=ddp"],
    "zero1": ["parallelism=zero", "stage=1"],
    "zero2": ["parallelism=zero", "stage=2"],
    "zero3": ["parallelism=zero", "stage=3"],
    "fsdp2": ["parallelism=fsdp", "stage=2"],
    "fsdp3": ["parallelism=fsdp", "stage=3"],
}


@pytest.fixture(scope="module")
def runs():
    """Each strategy, 2 ranks, fp32, AdamW, accumulation 2, clipping on; checkpoint after step 12 and resume."""
    names = list(STRATEGIES)
    common = [*FAST, "trainer.grad_accum_steps=2", "data.micro_batch_size=2", "checkpoint.keep_last=0"]
    cfgs = [to_plain(compose_config([*common, *STRATEGIES[name]])) for name in names]
    per_rank = on_ranks(train_steps, 2, cfgs, STEPS, 12)
    return {name: [per_rank[rank][i] for rank in (0, 1)] for i, name in enumerate(names)}


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "ddp"])
def test_follows_the_ddp_loss_trajectory(runs, name):
    ddp, other = runs["ddp"][0]["losses"], runs[name][0]["losses"]
    worst = max(abs(a - b) for a, b in zip(ddp, other, strict=True))
    assert worst < 1e-4, f"{name}: max |loss - ddp loss| over {STEPS} steps = {worst}"
    assert other[-1] < other[0] - 0.3  # and it trains


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_resume_from_sharded_checkpoint_is_exact(runs, name):
    for rank in (0, 1):
        result = runs[name][rank]
        assert result["resumed_from_step"] == 12
        assert result["resumed_losses"] == result["losses"][12:], f"{name} rank {rank}"


def test_memory_shrinks_as_the_formulas_say(runs):
    total = {name: runs[name][0]["memory"]["total"] for name in STRATEGIES}
    ddp = total["ddp"]
    # Bytes per parameter, fp32 AdamW, N = 2: DDP 4 + 4 + 8 = 16. DeepSpeed keeps an fp32 master copy even in
    # fp32 (optimizer 12 per parameter) and, in 0.19, stage 1 like stage 2 keeps only its gradient partition
    # once reduced: ZeRO-1/2 = 4 + (4 + 12) / 2, ZeRO-3 = 20 / 2. FSDP shards all 16 bytes: 16 / 2.
    expected = {"zero1": 12 / 16, "zero2": 12 / 16, "zero3": 10 / 16, "fsdp2": 0.5, "fsdp3": 0.5}
    for name, ratio in expected.items():
        assert total[name] / ddp == pytest.approx(ratio, rel=0.05), (name, total[name], ddp)
    for rank in (0, 1):
        assert runs["fsdp3"][rank]["memory"]["params"] < 0.6 * runs["ddp"][rank]["memory"]["params"]


def test_dry_run_predicts_measured_model_state_within_20_percent(runs):
    """``dry_run=true`` plans these same jobs in one process (fake process group, meta model); its model-state
    prediction (parameters + gradients + optimizer state) must be within 20% of what each real rank measured."""
    common = [*FAST, "trainer.grad_accum_steps=2", "data.micro_batch_size=2"]
    target = ["target.nodes=1", "target.ranks_per_node=2", "target.device=cpu"]
    for name, overrides in STRATEGIES.items():
        (predicted,) = plan(compose_config([*common, *overrides, *target])).ranks
        for rank in (0, 1):
            measured = runs[name][rank]["memory"]["total"]
            assert predicted.model_state == pytest.approx(measured, rel=0.2), (name, rank, predicted, measured)
