"""Per-rank model-state memory and step time for each data-parallel strategy and world size.

Runs `train.py` once per (strategy, world size) on the same model and synthetic data, reads each run's
summary.json, and prints a markdown table: measured model-state bytes per rank (parameters + gradients +
optimizer state, from the tensors each rank holds), the ZeRO-formula prediction, the ratio to DDP at the same
world size, and the mean step time. Ratios are computed within one invocation, side by side.

    python benchmarks/memory_by_strategy.py                        # fp32, world sizes 1 2 4
    python benchmarks/memory_by_strategy.py --precision bf16 --world-sizes 2 4 --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import metrics, publish, train

STRATEGIES = {
    "ddp": ["parallelism=ddp"],
    "zero1": ["parallelism=zero", "stage=1"],
    "zero2": ["parallelism=zero", "stage=2"],
    "zero3": ["parallelism=zero", "stage=3"],
    "fsdp2": ["parallelism=fsdp", "stage=2"],
    "fsdp3": ["parallelism=fsdp", "stage=3"],
}


def run(name: str, world: int, precision: str, steps: int, workdir: Path) -> dict:
    strategy = STRATEGIES[name]
    run_dir = workdir / f"{name}_{world}"
    args = [
        *strategy,
        f"precision={precision}",
        f"distributed.nproc_per_node={world}",
        "data=synthetic",
        f"trainer.max_steps={steps}",
        "trainer.log_every=5",
        "trainer.eval_every=0",
        "checkpoint=none",
    ]
    summary = train(args, run_dir)
    records = metrics(run_dir)
    step_times = [r["step_time_s"] for r in records if "step_time_s" in r][1:]  # first window includes warm-up
    return summary | {"step_time_s": statistics.mean(step_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=None, help="write memory_by_strategy.md and .png here")
    args = parser.parse_args()
    rows = ["| strategy | world | model state / rank (MiB) | predicted (MiB) | ratio to DDP | x (DDP / N) | step (s) |"]
    rows.append("|---|---|---|---|---|---|---|")
    measured_mib = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_sizes:
            results = {name: run(name, world, args.precision, args.steps, Path(tmp)) for name in STRATEGIES}
            ddp = results["ddp"]["model_state_bytes"]["total"]
            for name, summary in results.items():
                measured = max(summary["model_state_bytes_per_rank"])
                predicted = summary["predicted_model_state_bytes"]
                rows.append(
                    f"| {name} | {world} | {measured / 2**20:.3f} | {predicted / 2**20:.3f} | {measured / ddp:.3f}"
                    f" | {measured / (ddp / world):.3f} | {summary['step_time_s']:.3f} |"
                )
                print(rows[-1], flush=True)
                measured_mib[f"{name} x{world}"] = measured / 2**20
    title = f"precision={args.precision}, model=gpt_tiny, data=synthetic, {args.steps} steps"
    publish(title, rows, args.out_dir, "memory_by_strategy", bars=(measured_mib, "model state MiB / rank"))


if __name__ == "__main__":
    main()
