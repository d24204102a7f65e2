"""Each precision and optimizer option trains a few steps through the real build (1 rank, in-process)."""

import tempfile

import pytest
import torch
from helpers import FAST, compose_config, join, leave, on_ranks, to_plain
from omegaconf import OmegaConf

from distrain.trainer.build import build


def few_steps(cfg_dict, steps):
    env = join(None)
    try:
        run = build(OmegaConf.create(cfg_dict), env, run_dir=tempfile.mkdtemp())
        results = [run.strategy.train_step(run.data.next_step()) for _ in range(steps)]
        return {
            "losses": [r.loss.item() for r in results],
            "norms": [r.grad_norm.item() for r in results],
            "scale": run.strategy.scaler.get_scale() if run.strategy.scaler.is_enabled() else None,
        }
    finally:
        leave()


@pytest.mark.parametrize(
    "overrides",
    [["precision=bf16"], ["precision=fp16"], ["optimizer=sgd"], ["model=mlp"], ["trainer.grad_clip_norm=0"]],
)
def test_option_trains(overrides):
    cfg = to_plain(compose_config([*FAST, "parallelism=single", "optimizer.lr=0.01", *overrides]))
    out = on_ranks(few_steps, 1, cfg, 8)[0]
    assert all(torch.isfinite(torch.tensor(out["losses"])))
    assert out["losses"][-1] < out["losses"][0]
    assert all(n > 0 for n in out["norms"])
    if "precision=fp16" in overrides:
        assert out["scale"] is not None and out["scale"] > 0  # loss scaling is active
    else:
        assert out["scale"] is None


def test_clipping_bounds_the_update():
    # With a tiny clip norm the reported norm is the pre-clip norm, and training still moves slowly.
    cfg = to_plain(compose_config([*FAST, "parallelism=single", "trainer.grad_clip_norm=0.001"]))
    clipped = on_ranks(few_steps, 1, cfg, 4)[0]
    free = on_ranks(few_steps, 1, to_plain(compose_config([*FAST, "parallelism=single"])), 4)[0]
    assert clipped["norms"][0] == pytest.approx(free["norms"][0], rel=1e-5)
    assert clipped["losses"][-1] > free["losses"][-1]
