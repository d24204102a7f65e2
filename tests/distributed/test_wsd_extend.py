"""A warm-up-stable-decay run saved in its stable phase and resumed with a larger ``trainer.max_steps`` continues
exactly as a run planned that long from the start: the same learning rate and the same loss at every step."""

import tempfile

import torch
from helpers import FAST, compose_config, join, leave, on_ranks, to_plain

WSD = [*FAST, "scheduler.decay=wsd", "scheduler.warmup_steps=2", "scheduler.decay_fraction=0.25"]


def extended_and_planned(short_cfg, long_cfg, save_at):
    """(lr, loss) per step of: the short plan to ``save_at``, saved, resumed under the long plan to its end; and of
    the long plan from the start."""
    from omegaconf import OmegaConf

    from distrain.checkpoint.checkpointer import Checkpointer
    from distrain.trainer.build import build
    from distrain.trainer.loop import TrainState, loop_state, restore_loop_state

    env = join(None)
    try:
        run_dir = tempfile.mkdtemp()
        short = build(OmegaConf.create(short_cfg), env, run_dir)
        state = TrainState()
        for step in range(1, save_at + 1):
            short.strategy.train_step(short.data.next_step())
            state.step = step
        saved = short.checkpointer.save(save_at, short.strategy, loop_state(state, short.data))
        del short
        long_cfg = OmegaConf.create(long_cfg)
        extended, state = build(long_cfg, env, run_dir), TrainState()
        restore_loop_state(
            Checkpointer.load(saved, extended.strategy, loop_state(state, extended.data)), state, extended.data
        )
        planned = build(long_cfg, env, tempfile.mkdtemp())
        curves = {"extended": [], "planned": []}
        for step in range(1, long_cfg.trainer.max_steps + 1):
            lr = planned.strategy.current_lr()
            loss = planned.strategy.train_step(planned.data.next_step()).loss.item()
            curves["planned"].append((lr, loss))
            if step > save_at:
                lr = extended.strategy.current_lr()
                curves["extended"].append((lr, extended.strategy.train_step(extended.data.next_step()).loss.item()))
        return curves
    finally:
        leave()


def test_wsd_run_extended_from_its_stable_phase_matches_the_longer_plan():
    short = to_plain(compose_config([*WSD, "trainer.max_steps=12"]))
    long = to_plain(compose_config([*WSD, "trainer.max_steps=20"]))
    curves = on_ranks(extended_and_planned, 1, short, long, 6)[0]
    assert curves["extended"] == curves["planned"][6:]
    lrs = [lr for lr, _ in curves["planned"]]
    assert lrs[2:15] == [lrs[2]] * 13 and lrs[-1] < lrs[14]  # stable until the last 5 of 20 steps, then decays
    torch.testing.assert_close(lrs[6], 3e-3)
