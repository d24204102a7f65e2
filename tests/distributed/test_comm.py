"""Communication hooks on real gloo ranks: bytes on the wire, hierarchical all-reduce, top-k with error feedback,
every hook with gradient accumulation and checkpoint resume.

Bytes are checked against what gloo really writes to its sockets: ``wchar`` in ``/proc/self/io`` counts every byte
this process passes to write/send, and during a collective nothing else in the process writes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import FAST, compose_config, join, leave, on_ranks, to_plain, train_steps
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrain.comm.compression import CastComm, PowerSGDComm
from distrain.comm.ddp_comm import DDPComm
from distrain.comm.hierarchical import (
    HierarchicalComm,
    NodeLayout,
    build_groups,
    hierarchical_all_reduce,
    hierarchical_bytes,
)
from distrain.comm.topk import TopKComm
from distrain.comm.traffic import all_gather_bytes, all_reduce_bytes, broadcast_bytes, reduce_bytes
from distrain.monitor.timing import Clock

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io"),
]


def socket_bytes_written() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["wchar"])


def measure(fn) -> int:
    dist.barrier()
    before = socket_bytes_written()
    fn()
    return socket_bytes_written() - before


# ----------------------------------------------------------------------------------- traffic model vs gloo


def collective_bytes():
    env = join(None)
    try:
        n, world = 250_000, env.world_size
        nbytes = n * 4
        cases = {
            "all_reduce": (lambda: dist.all_reduce(torch.ones(n)), all_reduce_bytes(nbytes, world)),
            "all_gather": (
                lambda: dist.all_gather([torch.empty(n) for _ in range(world)], torch.ones(n)),
                all_gather_bytes(nbytes, world),
            ),
            "reduce": (lambda: dist.reduce(torch.ones(n), dst=0), reduce_bytes(nbytes, world, env.rank == 0)),
            "broadcast": (lambda: dist.broadcast(torch.ones(n), src=0), broadcast_bytes(nbytes, world, env.rank)),
        }
        return {name: (measure(fn), predicted) for name, (fn, predicted) in cases.items()}
    finally:
        leave()


@pytest.mark.parametrize("world", [2, 4])
def test_traffic_model_matches_bytes_gloo_writes(world):
    for rank, cases in on_ranks(collective_bytes, world).items():
        for name, (measured, predicted) in cases.items():
            # gloo adds a few hundred bytes of headers per message
            assert predicted <= measured <= predicted + 4096, (world, rank, name, measured, predicted)


# ------------------------------------------------------------------------------------- hook bytes on the wire


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


DDP_ARGS = {"name": "x", "bucket_cap_mb": 0.05, "gradient_as_bucket_view": True, "static_graph": False}
GUARD = {"quality_every": 0, "quality_threshold": 0.9}  # the quality guard off, unless a test turns it on


def topk(density, feedback="estimate", **guard):
    return TopKComm(
        density=density, warmup_steps=0, warmup_start_density=1.0, feedback=feedback, **(GUARD | guard), **DDP_ARGS
    )


COMMS = {
    "default": lambda: DDPComm(**DDP_ARGS),
    "bf16": lambda: CastComm(dtype="bfloat16", **GUARD, **DDP_ARGS),
    "powersgd": lambda: PowerSGDComm(
        rank=2, start_iter=2, min_compression_rate=2.0, error_feedback=True, warm_start=True, **GUARD, **DDP_ARGS
    ),
    "topk": lambda: topk(0.01),
    "topk_dense": lambda: topk(0.6),  # (value, index) pairs would cost more than the dense all-reduce
    "hierarchical": lambda: HierarchicalComm(ranks_per_node=2, **DDP_ARGS),
}


def hook_bytes(names):
    """Per comm option: (socket bytes written during each step's backward, bytes the hook reported)."""
    env = join(None)
    try:
        results = {}
        for name in names:
            comm = COMMS[name]()
            model = DistributedDataParallel(tiny_model(), **comm.ddp_kwargs())
            comm.register(model, env, Clock(torch.device("cpu")))
            steps = []
            for step in range(4):
                comm.begin_step()
                x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step * 10 + env.rank))
                written = measure(lambda model=model, x=x: model(x).square().mean().backward())
                steps.append((written, comm.bytes_sent, comm.dense_bytes))
                model.zero_grad()
            results[name] = steps
        return results
    finally:
        leave()


def test_hooks_report_the_bytes_they_really_send_and_compression_sends_less():
    results = on_ranks(hook_bytes, 2, ["default", "bf16", "powersgd", "topk", "topk_dense"])
    for rank, by_comm in results.items():
        for name, steps in by_comm.items():
            for step, (written, reported, _) in enumerate(steps):
                # gloo adds a few hundred bytes of headers per message (several messages per bucket)
                assert reported <= written <= reported + 16384, (rank, name, step, written, reported)
        dense = by_comm["default"][-1][0]
        assert by_comm["bf16"][-1][0] < 0.55 * dense
        assert by_comm["powersgd"][-1][0] < 0.2 * dense  # after start_iter: low-rank factors only
        assert by_comm["powersgd"][0][0] > 0.95 * dense  # before start_iter: dense
        # top-k 1% on 2 ranks: 8 bytes per sent entry against 4 per entry for the dense all-reduce
        assert by_comm["topk"][-1][0] < 0.05 * dense
        # 60% on 2 ranks would send 1.2x dense as pairs: it all-reduces the dense vector instead
        assert by_comm["topk_dense"][-1][1] == by_comm["default"][-1][1]


def test_hierarchical_hook_reports_the_bytes_it_really_sends():
    results = on_ranks(hook_bytes, 4, ["default", "hierarchical"])
    for rank, by_comm in results.items():
        for name, steps in by_comm.items():
            for written, reported, _ in steps:
                assert reported <= written <= reported + 16384, (rank, name, written, reported)


# ----------------------------------------------------------------------------------------- hierarchical


def hierarchical_vs_flat(ranks_per_node):
    env = join(None)
    try:
        groups = build_groups(NodeLayout(env.world_size, ranks_per_node), env.rank)
        generator = torch.Generator().manual_seed(env.rank)
        # Integers are summed exactly in any order, so both algorithms must agree bit for bit.
        integers = torch.randint(-1000, 1000, (10_001,), generator=generator).float()
        floats = torch.randn(10_001, generator=generator)
        out = {}
        for name, tensor in (("integers", integers), ("floats", floats)):
            flat, two_level = tensor.clone(), tensor.clone()
            dist.all_reduce(flat)
            hierarchical_all_reduce(two_level, groups)
            out[name] = (flat, two_level)
        out["bytes"] = hierarchical_bytes(4, groups)
        return out
    finally:
        leave()


def test_hierarchical_all_reduce_equals_flat_all_reduce_on_4_ranks_as_2_nodes_of_2():
    results = on_ranks(hierarchical_vs_flat, 4, 2)
    for rank, out in results.items():
        flat, two_level = out["integers"]
        assert torch.equal(flat, two_level), rank
        flat, two_level = out["floats"]
        torch.testing.assert_close(two_level, flat, rtol=1e-6, atol=1e-6)
        assert torch.equal(two_level, results[0]["floats"][1])  # every rank ends with the same bits
    # Only the leaders (0 and 2) send across nodes; non-leaders only reduce to their leader.
    assert results[1]["bytes"] == results[3]["bytes"] == 4
    assert results[0]["bytes"] == results[2]["bytes"] == 2 + 4 + 4  # reduce share, broadcast, leaders' all-reduce


# ---------------------------------------------------------------------------- through train.py's build


STEPS = 8


def configs(*override_sets):
    return [to_plain(compose_config([*FAST, "comm.bucket_cap_mb=0.1", *overrides])) for overrides in override_sets]


def losses_of(results):
    return [result["losses"] for result in results]


ACCUMULATION_CASES = {
    "default": (["comm=default"], 1e-5),
    "bf16": (["comm=bf16"], 1e-5),
    "fp16": (["comm=fp16"], 1e-5),
    "powersgd": (["comm=powersgd", "comm.start_iter=2"], 1e-4),
    "hierarchical": (["comm=hierarchical", "comm.ranks_per_node=1"], 1e-5),
}


def test_every_hook_works_with_gradient_accumulation():
    """Micro-batch 4 in one step, and 2 micro-batches of 2 accumulated, follow the same global losses under every
    hook (ranks read different samples in the two layouts, so the mean over ranks is compared)."""
    cfgs = []
    for overrides, _ in ACCUMULATION_CASES.values():
        cfgs += configs(
            overrides + ["data.micro_batch_size=4"],
            overrides + ["data.micro_batch_size=2", "trainer.grad_accum_steps=2"],
        )
    per_rank = on_ranks(train_steps, 2, cfgs, STEPS)
    global_losses = [torch.tensor([r[i]["losses"] for r in per_rank.values()]).mean(0) for i in range(len(cfgs))]
    for index, (name, (_, rtol)) in enumerate(ACCUMULATION_CASES.items()):
        whole, accumulated = global_losses[2 * index], global_losses[2 * index + 1]
        torch.testing.assert_close(accumulated, whole, rtol=rtol, atol=0, msg=name)
        assert whole[-1] < whole[0], name  # and it trains


def test_hierarchical_training_equals_flat_ddp_on_4_ranks():
    flat, two_level = on_ranks(
        train_steps,
        4,
        configs(["data.micro_batch_size=2"], ["data.micro_batch_size=2", "comm=hierarchical", "comm.ranks_per_node=2"]),
        STEPS,
    )[0]
    torch.testing.assert_close(torch.tensor(two_level["losses"]), torch.tensor(flat["losses"]), rtol=1e-6, atol=0)


def test_powersgd_resumes_and_keeps_training():
    (result,) = on_ranks(
        train_steps, 2, configs(["comm=powersgd", "comm.start_iter=2", "checkpoint=default"]), STEPS, 4
    )[0]
    # Its memories restart empty (documented), so the resumed steps are close, not identical.
    torch.testing.assert_close(
        torch.tensor(result["resumed_losses"]), torch.tensor(result["losses"][4:]), rtol=2e-2, atol=0
    )


def test_compression_metrics_reach_the_run_directory(tmp_path):
    """train.py with comm=topk logs bytes sent, compression ratio and communication time each window. Its
    exchange runs after backward, so none of it is hidden; the run's last step sends the residual whole."""
    import json

    from helpers import run_train

    done = run_train(
        [*FAST, "comm=topk", "trainer.max_steps=4", "trainer.log_every=2", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "grad_bytes_sent" in r]
    assert len(logged) == 2
    assert logged[0]["grad_compression_ratio"] > 20  # 1% density on 2 ranks: 50x fewer bytes than dense
    assert 1.5 < logged[1]["grad_compression_ratio"] < 2.5  # step 3 at 1%, step 4 dense
    for record in logged:
        assert record["comm_busy_time_s"] > 0 and record["comm_hidden_fraction"] < 0.2
