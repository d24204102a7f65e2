"""``data.global_batch_size``: the accumulation is derived from it and the layout's data-parallel degree, so moving
the same 4 ranks from ddp to hybrid tp=2 keeps the training (equal losses), and the run says what it chose."""

import json

import pytest
from helpers import FAST, compose_config, run_train

from distrain.config.validate import validate

COMMON = [*FAST, "data.global_batch_size=16", "trainer.max_steps=4", "distributed.nproc_per_node=4"]
LAYOUTS = {  # layout -> (overrides, derived accumulation, data-parallel degree)
    "ddp": (["parallelism=ddp"], 1, 4),
    "hybrid_tp2": (["parallelism=hybrid", "parallelism.tp=2"], 2, 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_accumulation_is_derived_from_the_layout(layout):
    overrides, accumulation, _ = LAYOUTS[layout]
    cfg = compose_config([*COMMON, *overrides])
    validate(cfg)
    assert cfg.trainer.grad_accum_steps == accumulation


def test_a_layout_change_keeps_the_training_and_the_run_states_its_batch(tmp_path):
    losses, summaries = {}, {}
    for name, (overrides, _, _) in LAYOUTS.items():
        done = run_train([*COMMON, *overrides, f"hydra.run.dir={name}"], tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        run_dir = tmp_path / name
        losses[name] = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        summaries[name] = json.loads((run_dir / "summary.json").read_text())
        log = (run_dir / "train.log").read_text()
        _, accumulation, data_parallel = LAYOUTS[name]
        line = (
            f"global batch 16 sequences = micro-batch 4 x accumulation {accumulation} x data-parallel {data_parallel}"
        )
        assert line in log, log[-2000:]
        assert {key: summaries[name][key] for key in ("global_batch_size", "grad_accum_steps", "data_parallel")} == {
            "global_batch_size": 16,
            "grad_accum_steps": accumulation,
            "data_parallel": data_parallel,
        }
    assert len(losses["ddp"]) == 4
    worst = max(abs(a - b) for a, b in zip(losses["ddp"], losses["hybrid_tp2"], strict=True))
    assert worst < 1e-5, (losses, worst)
