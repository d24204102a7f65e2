"""A NaN gradient on one rank is skipped on every rank (on_nonfinite=skip) or stops training (stop), and the
weights never become NaN."""

import math
import tempfile

from helpers import FAST, compose_config, cpu_state, join, leave, on_ranks, to_plain
from omegaconf import OmegaConf

from distrain.parallelism.base import NonFiniteGradientError
from distrain.trainer.build import build


def poisoned_run(cfg_dict, poison_step, poison_rank, steps):
    env = join(None)
    try:
        run = build(OmegaConf.create(cfg_dict), env, run_dir=tempfile.mkdtemp())
        model = run.strategy.model
        current = {"step": 0}

        def poison(grad):  # a NaN gradient on one rank at one step, before DDP all-reduces it
            bad = current["step"] == poison_step and env.rank == poison_rank
            return grad * math.nan if bad else grad

        getattr(model, "module", model).head.weight.register_hook(poison)
        history = []
        for step in range(1, steps + 1):
            current["step"] = step
            before = cpu_state(model)
            try:
                result = run.strategy.train_step(run.data.next_step())
            except NonFiniteGradientError:
                after = cpu_state(model)
                return {"raised_at": step, "unchanged": all(before[k].equal(after[k]) for k in before)}
            after = cpu_state(model)
            history.append(
                {
                    "skipped": result.skipped,
                    "unchanged": all(before[k].equal(after[k]) for k in before),
                    "finite": all(v.isfinite().all() for v in after.values()),
                    "loss_finite": math.isfinite(result.loss.item()),
                }
            )
        return history
    finally:
        leave()


def test_skip_drops_the_update_on_every_rank_and_training_continues():
    cfg = to_plain(compose_config([*FAST, "trainer.on_nonfinite=skip"]))
    per_rank = on_ranks(poisoned_run, 2, cfg, 3, 1, 6)
    for rank in (0, 1):
        history = per_rank[rank]
        assert [h["skipped"] for h in history] == [False, False, True, False, False, False]
        assert history[2]["unchanged"]  # step 3 left the weights exactly as they were
        assert not any(h["unchanged"] for i, h in enumerate(history) if i != 2)
        assert all(h["finite"] and h["loss_finite"] for h in history)


def test_stop_raises_before_the_update():
    cfg = to_plain(compose_config([*FAST, "parallelism=single"]))  # default on_nonfinite=stop
    result = on_ranks(poisoned_run, 1, cfg, 2, 0, 4)[0]
    assert result == {"raised_at": 2, "unchanged": True}
