"""Top-k of each rank's optimizer update (``comm=topk``'s default ``feedback=update``) on real gloo ranks: identical
parameters on every rank, dense SGD recovered at density 1, a non-finite gradient skipped on every rank, and the
quality guard's report. Exact resume is in test_topk.py (it runs the default feedback)."""

from __future__ import annotations

import tempfile

import pytest
import torch
from helpers import FAST, compose_config, cpu_state, join, leave, on_ranks, to_plain, train_steps
from omegaconf import OmegaConf
from test_nonfinite import poisoned_run

from distrain.trainer.build import build

SPARSE = ["comm=topk", "comm.density=0.05", "comm.sync_every=4", "comm.quality_every=3", "comm.bucket_cap_mb=0.1"]


def trained(cfg_dict, steps):
    """On a joined rank: take ``steps`` optimizer steps; this rank's losses, final parameters (CPU) and reports."""
    env = join(None)
    try:
        return steps_of(env, cfg_dict, steps)
    finally:
        leave()


def trained_each(cfg_dicts, steps):
    env = join(None)
    try:
        return [steps_of(env, cfg_dict, steps) for cfg_dict in cfg_dicts]
    finally:
        leave()


def steps_of(env, cfg_dict, steps):
    run = build(OmegaConf.create(cfg_dict), env, run_dir=tempfile.mkdtemp())
    results = [run.strategy.train_step(run.data.next_step()) for _ in range(steps)]
    return {
        "losses": [result.loss.item() for result in results],
        "params": cpu_state(run.strategy.model),
        "marks": [{k: v for k, v in result.marks.items() if k.startswith("comm_")} for result in results],
    }


def test_every_rank_holds_the_same_parameters_and_sends_a_fraction_of_the_bytes():
    """Ranks read different data and step their own optimizers; after every exchange the parameters they hold
    are bit-identical. Pairs cost 8 bytes each (5% of entries: 0.1 of the dense all-reduce on 2 ranks), a sync step
    (every 4th) all-reduces the whole residual, and guard steps (every 3rd) report an unsent share in [0, 1]."""
    cfg = to_plain(compose_config([*FAST, *SPARSE]))
    ranks = on_ranks(trained, 2, cfg, 6)
    first, second = ranks[0], ranks[1]
    assert first["params"].keys() == second["params"].keys()
    assert all(torch.equal(first["params"][k], second["params"][k]) for k in first["params"])
    assert first["losses"] != second["losses"]  # they did compute different gradients
    ratios = [mark["comm_bytes"] / mark["comm_dense_bytes"] for mark in first["marks"]]
    assert all(0.09 < ratio < 0.11 for i, ratio in enumerate(ratios) if i != 3), ratios
    assert ratios[3] == pytest.approx(1.0)  # step 4 sends the residual whole
    errors = [mark.get("comm_quality", {}).get("grad_compression_error") for mark in first["marks"]]
    assert errors[0] is None and errors[1] is None and 0 < errors[2] < 1 and 0 < errors[5] < 1, errors


def test_at_density_1_plain_sgd_follows_dense_ddp():
    """Every update sent whole: the mean of the ranks' SGD updates is the dense SGD update, so the losses match
    dense DDP (no clipping and no weight decay, which each rank would apply to its own share)."""
    sgd = ["optimizer=sgd", "optimizer.momentum=0", "optimizer.weight_decay=0", "trainer.grad_clip_norm=0"]
    dense, update = on_ranks(
        train_steps,
        2,
        [to_plain(compose_config([*FAST, *sgd, *extra])) for extra in ([], ["comm=topk", "comm.density=1.0"])],
        5,
    )[0]
    assert update["losses"][-1] < update["losses"][0]
    torch.testing.assert_close(torch.tensor(update["losses"]), torch.tensor(dense["losses"]), rtol=1e-5, atol=0)


def test_on_one_rank_training_follows_dense_and_accumulation_changes_nothing():
    """On one rank the gradient is taken at the shared parameters plus everything not yet sent, which is exactly
    where dense training stands: the losses equal dense DDP's, with or without accumulation, while the shared
    parameters (what evaluation and checkpoints see) lag behind."""
    sparse = ["comm=topk", "comm.density=0.05", "comm.sync_every=0"]
    cfgs = [
        to_plain(compose_config([*FAST, *extra]))
        for extra in (
            ["data.micro_batch_size=4"],
            [*sparse, "data.micro_batch_size=4"],
            [*sparse, "data.micro_batch_size=2", "trainer.grad_accum_steps=2"],
        )
    ]
    dense, whole, accumulated = on_ranks(trained_each, 1, cfgs, 6)[0]
    for losses in (whole["losses"], accumulated["losses"]):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(dense["losses"]), rtol=1e-4, atol=0)
    assert not all(torch.equal(whole["params"][k], dense["params"][k]) for k in dense["params"])


@pytest.mark.parametrize("sync_every", [4, 3])
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(sync_every):
    """The clipping norm is shared (an all-reduce of the ranks' squared norms), so a NaN on rank 1 alone makes
    both ranks skip step 3 and the parameters stay finite; only when step 3 is a sync step is the residual pending
    from steps 1-2 still sent whole, so the parameters move."""
    cfg = to_plain(compose_config([*FAST, *SPARSE, f"comm.sync_every={sync_every}", "trainer.on_nonfinite=skip"]))
    per_rank = on_ranks(poisoned_run, 2, cfg, 3, 1, 6)
    for rank in (0, 1):
        history = per_rank[rank]
        assert [h["skipped"] for h in history] == [False, False, True, False, False, False], history
        assert history[2]["unchanged"] == (sync_every != 3) and all(h["finite"] for h in history)


def test_a_checkpoint_of_top_k_updates_resumes_under_another_layout(tmp_path):
    """Each rank's own optimizer state is saved under its own key; fsdp, which keeps one optimizer state, resumes
    from rank 0's, and says so in one line."""
    from helpers import run_train

    fast = [arg for arg in FAST if not arg.startswith("checkpoint=")]
    common = [*fast, "checkpoint.every_n_steps=2", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    first = run_train(
        [*common, "comm=topk", "trainer.max_steps=2", "comm.density=0.05", f"hydra.run.dir={tmp_path / 'a'}"],
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_train(
        [
            *common,
            "parallelism=fsdp",
            "checkpoint.resume=auto",
            "trainer.max_steps=4",
            f"hydra.run.dir={tmp_path / 'b'}",
        ],
        cwd=tmp_path,
    )
    assert second.returncode == 0, second.stderr[-2000:]
    log = (tmp_path / "b" / "train.log").read_text()
    assert "keeps one optimizer state per rank (comm=topk); every rank resumes from rank 0's" in log
