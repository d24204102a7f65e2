"""Muon (``optimizer=muon``) on llama_tiny: every layout gives the losses of one process (its distributed
Newton-Schulz is exact), its state resumes bit-exactly from a sharded checkpoint, and it learns; under ZeRO,
DeepSpeed's own Muon does the same."""

import pytest
from helpers import FAST, compose_config, on_ranks, to_plain, train_steps

STEPS = 6
COMMON = [
    *FAST, "model=llama_tiny", "model.n_layers=2", "model.tie_embeddings=false", "optimizer=muon",
    "optimizer.lr=0.01", "scheduler.warmup_steps=2",
]  # fmt: skip
# 8 sequences per step everywhere: data-parallel degree x micro-batch (the sampler deals a global batch to the
# replicas the way one process reads it in one micro-batch).
ONE_REPLICA = ["data.micro_batch_size=8"]
TWO_REPLICAS = ["data.micro_batch_size=4"]
LAYOUTS = {  # name: (ranks, overrides)
    "ddp": (2, ["parallelism=ddp", *TWO_REPLICAS]),
    "fsdp": (2, ["parallelism=fsdp", *TWO_REPLICAS]),
    "tensor": (2, ["parallelism=tensor", *ONE_REPLICA]),
    "pipeline": (2, ["parallelism=pipeline", "parallelism.schedule=1f1b", *ONE_REPLICA]),
    "hsdp": (4, ["parallelism=hsdp", "parallelism.dp_replicate=2", "parallelism.dp=2", "data.micro_batch_size=2"]),
    "fsdp_tp": (4, ["parallelism=hybrid", "parallelism.tp=2", *TWO_REPLICAS]),
}


# DeepSpeed's Muon runs without clipping (it would clip its updates, not gradients): compared unclipped.
UNCLIPPED = ["trainer.grad_clip_norm=0"]
ZERO_LAYOUTS = {
    "zero2": (2, ["parallelism=zero", "parallelism.stage=2", *TWO_REPLICAS, *UNCLIPPED]),
    "zero3": (2, ["parallelism=zero", "parallelism.stage=3", *TWO_REPLICAS, *UNCLIPPED]),
}
RESUMED = ("ddp", "fsdp", "zero2", "zero3")


def losses_on(ranks, overrides, checkpoint_at=None):
    cfg = to_plain(compose_config([*COMMON, *overrides]))
    args = (STEPS, checkpoint_at) if checkpoint_at else (STEPS,)
    return on_ranks(train_steps, ranks, [cfg], *args)


@pytest.fixture(scope="module")
def single():
    return losses_on(1, ["parallelism=single", *ONE_REPLICA])[0][0]["losses"]


@pytest.fixture(scope="module")
def single_unclipped():
    return losses_on(1, ["parallelism=single", *ONE_REPLICA, *UNCLIPPED])[0][0]["losses"]


def follows(reference, layout, ranks, overrides):
    result = losses_on(ranks, overrides, checkpoint_at=3 if layout in RESUMED else None)
    # Each rank reports the loss of its share of the batch: their mean is the batch's (equal shares).
    mean = [sum(step) / ranks for step in zip(*(r[0]["losses"] for r in result.values()), strict=True)]
    worst = max(abs(a - b) for a, b in zip(reference, mean, strict=True))
    assert worst < 1e-3, f"{layout}: max |loss - single-process loss| = {worst}"
    for rank, per_rank in result.items():
        if "resumed_losses" in per_rank[0]:
            resumed, losses = per_rank[0]["resumed_losses"], per_rank[0]["losses"]
            assert resumed == losses[3:], f"rank {rank}: Muon's state did not resume bit-exactly"
    assert reference[-1] < reference[0] - 0.3


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_under_every_layout_follows_one_process(single, layout):
    follows(single, layout, *LAYOUTS[layout])


@pytest.mark.parametrize("layout", list(ZERO_LAYOUTS))
def test_deepspeed_muon_under_zero_follows_one_process(single_unclipped, layout):
    """DeepSpeed's Muon with distrain's scale and decay folded into its groups is distrain's Muon (to the rounding
    of its bf16 Newton-Schulz), and DeepSpeed's checkpoints resume it bit-exactly."""
    follows(single_unclipped, layout, *ZERO_LAYOUTS[layout])
