"""Framework overhead: distrain's DDP step time against a hand-written minimal PyTorch DDP loop, side by side.

Both train the default model (gpt_tiny) on the default data (the standard library's source bytes) with AdamW, the
same micro-batch, gradient clipping at 1.0, on the same number of gloo ranks with the same threads per rank, for the
same number of steps. The minimal loop is what a researcher would write by hand: DDP, a random window per sample,
forward, backward, clip, step. distrain adds its sampler, timing marks, monitoring windows, the agreement per step and
the progress log. The ratio is the cost of all that. Both run in one invocation, one after the other.

    python benchmarks/overhead.py                          # 2 ranks, 100 steps
    python benchmarks/overhead.py --world-size 2 --steps 200 --out-dir results/
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import metrics, publish, train
from torch.nn.parallel import DistributedDataParallel

from distrain.data.corpus import stdlib_source_corpus
from distrain.models.gpt import GPT

MODEL = {"vocab_size": 256, "max_seq_len": 128, "d_model": 128, "n_layers": 4, "n_heads": 4}
MICRO_BATCH, SEQ_LEN, WARMUP_STEPS = 8, 128, 10


def minimal_rank(rank: int, world: int, steps: int, port: int, results: dict) -> None:
    """One rank of the hand-written loop; rank 0 stores the mean step time after warm-up."""
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    tokens = stdlib_source_corpus(max_bytes=4_000_000, val_fraction=0.05).train
    model = DistributedDataParallel(GPT(**MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        offsets = torch.randint(0, len(tokens) - SEQ_LEN - 1, (MICRO_BATCH,), generator=generator)
        batch = torch.stack([tokens[o : o + SEQ_LEN + 1] for o in offsets.tolist()]).long()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # as distrain's logging does, wait for the step to finish
        times.append(time.perf_counter() - start)
    if rank == 0:
        results["step_time_s"] = statistics.mean(times[WARMUP_STEPS:])
    dist.destroy_process_group()


def minimal_loop(world: int, steps: int) -> float:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with torch.multiprocessing.Manager() as manager:
        results = manager.dict()
        torch.multiprocessing.spawn(minimal_rank, args=(world, steps, port, results), nprocs=world)
        return results["step_time_s"]


def distrain_loop(world: int, steps: int, run_dir: Path) -> float:
    train(
        [
            f"distributed.nproc_per_node={world}",
            f"trainer.max_steps={steps}",
            f"trainer.log_every={WARMUP_STEPS}",
            "trainer.eval_every=0",
            "trainer.progress_bar=false",
            "checkpoint=none",
            "logger=none",
        ],
        run_dir,
    )
    return statistics.mean([r["step_time_s"] for r in metrics(run_dir) if "step_time_s" in r][1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out-dir", type=Path, default=None, help="write overhead.md and overhead.png here")
    args = parser.parse_args()
    minimal = minimal_loop(args.world_size, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        ours = distrain_loop(args.world_size, args.steps, Path(tmp))
    tokens = MICRO_BATCH * SEQ_LEN * args.world_size
    rows = ["| loop | step (s) | tokens / s | ratio to minimal |", "|---|---|---|---|"]
    for name, seconds in (("minimal PyTorch DDP", minimal), ("distrain (parallelism=ddp)", ours)):
        rows.append(f"| {name} | {seconds:.4f} | {tokens / seconds:.0f} | {seconds / minimal:.3f}x |")
    title = f"gpt_tiny, {args.world_size} CPU ranks (gloo), {args.steps} steps (first {WARMUP_STEPS} not timed)"
    bars = {"minimal PyTorch DDP": minimal, "distrain": ours}
    publish(title, rows, args.out_dir, "overhead", bars=(bars, "step time (s)"))


if __name__ == "__main__":
    main()
