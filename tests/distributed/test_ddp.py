"""DDP on real gloo ranks trains exactly like one process on the same samples; accumulation syncs once per step."""

import tempfile

import pytest
import torch
from helpers import FAST, compose_config, cpu_state, join, leave, on_ranks, to_plain
from omegaconf import OmegaConf

from distrain.trainer.build import build

STEPS = 10


def run_configs(cfg_dicts, steps, count_allreduce):
    """On every rank: build each config like train.py does, take ``steps`` optimizer steps, return the results."""
    env = join(None)
    results = []
    try:
        for cfg_dict in cfg_dicts:
            run = build(OmegaConf.create(cfg_dict), env, run_dir=tempfile.mkdtemp())
            losses = [run.strategy.train_step(run.data.next_step()).loss.item() for _ in range(steps)]
            # DDP's gradient all-reduce runs as distrain's communication hook, which counts bucket launches.
            launches = run.strategy.ctx.comm.bucket_launches if count_allreduce else 0
            results.append({"params": cpu_state(run.strategy.model), "allreduce_calls": launches, "losses": losses})
    finally:
        leave()
    return results


def configs(*override_sets):
    return [to_plain(compose_config([*FAST, "comm.bucket_cap_mb=1000", *overrides])) for overrides in override_sets]


@pytest.fixture(scope="module")
def ddp_two_ranks():
    """2 ranks: (a) micro-batch 4, (b) micro-batch 2 x 4 accumulation steps, (c) micro-batch 2, no accumulation."""
    cfgs = configs(
        ["data.micro_batch_size=4"],
        ["data.micro_batch_size=2", "trainer.grad_accum_steps=4"],
        ["data.micro_batch_size=2"],
    )
    return on_ranks(run_configs, 2, cfgs, STEPS, True)


@pytest.fixture(scope="module")
def one_process():
    """1 process, parallelism=single: (a) batch 8, (b) batch 16, (c) batch 4 x 4 accumulation steps."""
    cfgs = configs(
        ["parallelism=single", "data.micro_batch_size=8"],
        ["parallelism=single", "data.micro_batch_size=16"],
        ["parallelism=single", "data.micro_batch_size=4", "trainer.grad_accum_steps=4"],
    )
    return on_ranks(run_configs, 1, cfgs, STEPS, False)[0]


def assert_same_params(a, b, atol=2e-5):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < atol, f"max parameter difference {worst}"


def test_ddp_two_ranks_equals_one_process_with_double_batch(ddp_two_ranks, one_process):
    assert_same_params(ddp_two_ranks[0][0]["params"], one_process[0]["params"])
    assert_same_params(ddp_two_ranks[1][0]["params"], ddp_two_ranks[0][0]["params"])  # ranks stay in sync


def test_parameters_actually_moved(ddp_two_ranks, one_process):
    single_vs_bigger = max(
        (one_process[0]["params"][k] - one_process[1]["params"][k]).abs().max().item() for k in one_process[0]["params"]
    )
    assert single_vs_bigger > 1e-3  # a different batch gives different weights: the equality above is not vacuous


def test_accumulation_equals_the_bigger_batch(ddp_two_ranks, one_process):
    # 2 ranks x micro 2 x accum 4 == 1 rank x 16; and 1 rank x micro 4 x accum 4 == 1 rank x 16.
    assert_same_params(ddp_two_ranks[0][1]["params"], one_process[1]["params"])
    assert_same_params(one_process[2]["params"], one_process[1]["params"])


def test_gradient_allreduce_runs_once_per_optimizer_step(ddp_two_ranks):
    for rank in (0, 1):
        accumulated, plain = ddp_two_ranks[rank][1], ddp_two_ranks[rank][2]
        # One bucket (bucket_cap_mb=1000): exactly one all-reduce per optimizer step, with or without accumulation.
        assert plain["allreduce_calls"] == STEPS
        assert accumulated["allreduce_calls"] == STEPS


def test_logged_losses_agree_between_layouts(ddp_two_ranks, one_process):
    # The mean of the two ranks' local losses is the single process's loss on the union of their samples.
    mean = torch.tensor([ddp_two_ranks[r][0]["losses"] for r in (0, 1)]).mean(0)
    assert torch.allclose(mean, torch.tensor(one_process[0]["losses"]), atol=1e-4)
