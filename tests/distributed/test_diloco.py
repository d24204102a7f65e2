"""comm=diloco on 2 real gloo ranks: nothing travels between syncs, a sync sends one all-reduce of the pseudo-gradient
(or less, compressed) and leaves every rank with the same outer model, streaming fragments sync in turn, and a
checkpoint taken between syncs resumes bit for bit."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from helpers import join, leave, on_ranks, train_steps
from omegaconf import OmegaConf
from test_comm import configs

from distrain.comm.traffic import all_gather_bytes, all_reduce_bytes
from distrain.trainer.build import build

pytestmark = pytest.mark.distributed


def sync_trace(cfg_dicts):
    """Per step: this rank's bytes sent, and whether every rank holds the same parameters after the step."""
    env = join(None)
    try:
        (cfg_dict,) = cfg_dicts
        cfg = OmegaConf.create(cfg_dict)
        run_dir = [tempfile.mkdtemp() if env.rank == 0 else ""]
        dist.broadcast_object_list(run_dir)
        run = build(cfg, env, run_dir=run_dir[0])
        params = [p for p in run.strategy.model.module.parameters() if p.requires_grad]
        trace = []
        for _ in range(cfg.trainer.max_steps):
            result = run.strategy.train_step(run.data.next_step())
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            gathered = [torch.empty_like(flat) for _ in range(env.world_size)]
            dist.all_gather(gathered, flat)
            trace.append((result.marks["comm_bytes"], all(torch.equal(gathered[0], g) for g in gathered)))
        return {
            "trace": trace,
            "numel": flat.numel(),
            "fragments": [sum(p.numel() for p in g) for g in run.strategy.ctx.comm.groups],
        }
    finally:
        leave()


DILOCO = ["comm=diloco", "trainer.max_steps=8"]


def test_ranks_send_nothing_between_syncs_and_share_the_outer_model_after_one():
    result = on_ranks(sync_trace, 2, configs([*DILOCO, "comm.sync_every=4"]))[0]
    dense = all_reduce_bytes(result["numel"] * 4, 2)
    assert [sent for sent, _ in result["trace"]] == [0, 0, 0, dense, 0, 0, 0, dense]
    assert [same for _, same in result["trace"]] == [False, False, False, True, False, False, False, True]


def test_streaming_fragments_sync_in_turn():
    result = on_ranks(sync_trace, 2, configs([*DILOCO, "comm.sync_every=4", "comm.fragments=2"]))[0]
    first, second = (all_reduce_bytes(n * 4, 2) for n in result["fragments"])
    # The last step syncs every fragment: the final model is the outer one.
    assert [sent for sent, _ in result["trace"]] == [0, first, 0, second, 0, first, 0, first + second]
    # Between the last step's full sync, each fragment trains on locally after its own sync: ranks differ.
    assert [same for _, same in result["trace"]] == [False] * 7 + [True]


def test_compressed_pseudo_gradients_send_less_and_still_agree():
    topk = on_ranks(
        sync_trace, 2, configs([*DILOCO, "comm.sync_every=4", "comm.compression=topk", "comm.density=0.05"])
    )[0]
    k = -(-topk["numel"] * 5 // 100)
    assert topk["trace"][3] == (all_gather_bytes(k * 8, 2), True)
    powersgd = on_ranks(
        sync_trace, 2, configs([*DILOCO, "comm.sync_every=4", "comm.compression=powersgd", "comm.rank=2"])
    )[0]
    sent, same = powersgd["trace"][3]
    assert 0 < sent < all_reduce_bytes(powersgd["numel"] * 4, 2) / 4 and same


@pytest.mark.parametrize("compression", ["none", "topk", "powersgd"])
def test_a_checkpoint_between_syncs_resumes_exactly(compression):
    """Saved after step 6 of cycles of 4: the resumed run's steps 7-12 cross the sync at step 8, which reads every
    rank's own parameters, the outer model, its momentum and (compressed) the residuals and factors."""
    overrides = ["comm=diloco", "comm.sync_every=4", f"comm.compression={compression}", "checkpoint=default"]
    (result,) = on_ranks(train_steps, 2, configs([*overrides, "comm.density=0.1"]), 12, 6)[0]
    assert result["resumed_from_step"] == 6
    assert result["resumed_losses"] == result["losses"][6:]


def outer_steps_against_torch_sgd(_):
    """DiLoCo's outer step on one rank against torch's SGD with Nesterov momentum fed the pseudo-gradient."""
    from types import SimpleNamespace

    from distrain.comm.diloco import DiLoCoComm
    from distrain.monitor.timing import Clock

    join(None)
    try:
        comm = DiLoCoComm(
            sync_every=1, outer_lr=0.7, outer_momentum=0.9, nesterov=True, fragments=1, compression="none",
            density=1.0, rank=1, name="diloco", bucket_cap_mb=25, gradient_as_bucket_view=True, static_graph=False,
        )  # fmt: skip
        model = torch.nn.Linear(4, 3)
        comm.world_size, comm.rank, comm.clock = 1, 0, Clock(torch.device("cpu"))
        comm.prepare(SimpleNamespace(module=model), None)
        reference = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):
            with torch.no_grad():  # an inner step moved this rank's parameters
                for param in model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator))
            for ref, param in zip(reference, model.parameters(), strict=True):
                ref.grad = (ref - param).detach()  # the pseudo-gradient: outer minus local
            sgd.step()
            comm.begin_step()  # sync_every=1: every step is an outer step
            assert not comm.finish_update()["update_dropped"]
            for ref, param in zip(reference, model.parameters(), strict=True):
                torch.testing.assert_close(param.detach(), ref.detach(), rtol=1e-6, atol=1e-6)
        return True
    finally:
        leave()


def test_the_outer_step_is_nesterov_sgd_on_the_pseudo_gradient():
    assert on_ranks(outer_steps_against_torch_sgd, 1, None)[0]
