"""How long checkpoints stop training: synchronous saves against ``checkpoint.async_save=true``, side by side.

Runs `train.py` twice on the same model, data and schedule (a checkpoint every ``--every`` steps), once with each
mode, and prints the training loop's wall time, the time per step and the stall per checkpoint relative to a run
without checkpoints. The runs happen one after the other in one invocation, so the ratios compare like with like.

    python benchmarks/checkpoint_stall.py                          # 2 CPU ranks, a 27M-parameter GPT
    python benchmarks/checkpoint_stall.py --d-model 256 --layers 4 --steps 20
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import train


def run(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    run_dir = workdir / mode
    checkpoint = {
        "none": ["checkpoint=none"],
        "sync": [f"checkpoint.every_n_steps={args.every}", "checkpoint.save_final=false"],
        "async": [
            f"checkpoint.every_n_steps={args.every}",
            "checkpoint.save_final=false",
            "checkpoint.async_save=true",
        ],
    }[mode]
    overrides = [
        "data=synthetic",
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        "model.max_seq_len=64",
        "data.micro_batch_size=4",
        f"trainer.max_steps={args.steps}",
        f"trainer.log_every={args.steps}",
        "trainer.eval_every=0",
        "trainer.eval_batches=1",
        "logger=none",
        *checkpoint,
    ]
    summary = train(overrides, run_dir)
    saved = sorted((run_dir / "checkpoints").glob("step_*")) if mode != "none" else []
    size = sum(f.stat().st_size for f in saved[0].rglob("*") if f.is_file()) if saved else 0
    return {"wall_time_s": summary["wall_time_s"], "checkpoints": len(saved), "checkpoint_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: run(mode, args, Path(tmp)) for mode in ("none", "sync", "async")}
    base = results["none"]["wall_time_s"]
    megabytes = results["sync"]["checkpoint_bytes"] / 1e6
    print(f"{args.steps} steps, a checkpoint every {args.every} ({megabytes:.0f} MB each)\n")
    print("| mode | loop wall time (s) | vs no checkpoints | stall per checkpoint (s) |")
    print("|---|---|---|---|")
    for mode, result in results.items():
        saves = args.steps // args.every if mode != "none" else 0
        stall = (result["wall_time_s"] - base) / saves if saves else 0.0
        print(f"| {mode} | {result['wall_time_s']:.2f} | {result['wall_time_s'] / base:.3f}x | {stall:.2f} |")


if __name__ == "__main__":
    main()
