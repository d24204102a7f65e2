"""activation_checkpointing with every strategy where it makes sense, on 2 gloo ranks: the losses of the same run
without it (recomputation repeats the same operations in the same order)."""

import pytest
from helpers import FAST, compose_config, on_ranks, to_plain, train_steps

STRATEGIES = {
    "ddp": ["parallelism=ddp"],
    "fsdp": ["parallelism=fsdp", "stage=3"],
    "zero3": ["parallelism=zero", "stage=3"],
    "tensor": ["parallelism=tensor"],
    "pipeline": ["parallelism=pipeline", "model.n_layers=4"],
}


def test_activation_checkpointing_keeps_every_strategys_losses():
    cases = [(name, mode) for name in STRATEGIES for mode in ("none", "full")] + [("ddp", "selective")]
    cfgs = [
        to_plain(compose_config([*FAST, *STRATEGIES[name], f"activation_checkpointing={mode}"])) for name, mode in cases
    ]
    losses = {case: result["losses"] for case, result in zip(cases, on_ranks(train_steps, 2, cfgs, 6)[0], strict=True)}
    for name in STRATEGIES:
        plain = losses[(name, "none")]
        assert plain[-1] < plain[0], name
        for mode in ("full", "selective"):
            if (name, mode) in losses:
                assert losses[(name, mode)] == pytest.approx(plain, rel=1e-6, abs=0), (name, mode)
