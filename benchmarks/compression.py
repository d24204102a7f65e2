"""Gradient compression side by side: bytes each rank sends per step, compression ratio, step time and the loss
after a fixed number of steps, for dense DDP, bf16, PowerSGD and top-k at 1% (with and without
density warm-up) and 0.1%.

Runs `train.py` once per option on the default model and data (the out-of-the-box run), 2 CPU ranks unless told
otherwise, and reads each run's summary.json and metrics.jsonl. Bytes are distrain's ``grad_bytes_sent`` (the
traffic model in distrain/comm/traffic.py, checked against gloo's socket writes in tests/distributed/test_comm.py).
Ratios are computed within one invocation.

    python benchmarks/compression.py                        # 200 steps, 2 ranks
    python benchmarks/compression.py --steps 100 --world-size 4 --out-dir results/
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import metrics, publish, train

OPTIONS = {
    "dense (comm=default)": ["comm=default"],
    "bf16": ["comm=bf16"],
    "powersgd rank 4": ["comm=powersgd", "comm.rank=4"],
    "top-k 1%": ["comm=topk", "comm.density=0.01"],
    "top-k 1%, 100-step warm-up from dense": [
        "comm=topk",
        "comm.density=0.01",
        "comm.warmup_steps=100",
        "comm.warmup_start_density=1.0",
    ],
    "top-k 0.1%": ["comm=topk", "comm.density=0.001"],
}


def run(overrides: list[str], steps: int, world: int, run_dir: Path) -> dict:
    args = [
        *overrides,
        f"distributed.nproc_per_node={world}",
        f"trainer.max_steps={steps}",
        "trainer.log_every=10",
        "trainer.progress_bar=false",
        "checkpoint=none",
        "logger=none",
    ]
    summary = train(args, run_dir)
    windows = [r for r in metrics(run_dir) if "grad_bytes_sent" in r][1:]  # the first window includes warm-up
    return {
        "bytes": statistics.mean(r["grad_bytes_sent"] for r in windows),
        "step_time_s": statistics.mean(r["step_time_s"] for r in windows),
        "comm_time_s": statistics.mean(r["comm_busy_time_s"] for r in windows),
        "train_loss": summary["final_train_loss"],
        "val_loss": summary["final_val_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=None, help="write compression.md and compression.png here")
    args = parser.parse_args()
    header = "| option | bytes sent / rank / step | compression | step (s) | comm busy (s) | train loss | val loss |"
    rows = [header, "|---|---|---|---|---|---|---|"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, overrides) in enumerate(OPTIONS.items()):
            results[name] = result = run(overrides, args.steps, args.world_size, Path(tmp) / str(index))
            dense = results["dense (comm=default)"]
            rows.append(
                f"| {name} | {result['bytes'] / 2**20:.3f} MiB | {dense['bytes'] / result['bytes']:.1f}x"
                f" | {result['step_time_s']:.4f} ({result['step_time_s'] / dense['step_time_s']:.2f}x)"
                f" | {result['comm_time_s']:.4f} | {result['train_loss']:.3f} | {result['val_loss']:.3f} |"
            )
            print(rows[-1], flush=True)
    title = f"default model and data, {args.world_size} CPU ranks (gloo), {args.steps} steps"
    sent = {name: result["bytes"] / 2**20 for name, result in results.items()}
    publish(title, rows, args.out_dir, "compression", bars=(sent, "gradient MiB sent / rank / step"), log_scale=True)


if __name__ == "__main__":
    main()
