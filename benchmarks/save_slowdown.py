"""Step time before and after a checkpoint save, for every layout that saves (issue 41).

Each layout trains nanoGPT's shakespeare-char model shape (4 layers x 128, context 64, batch 12) on synthetic
tokens for ``--steps`` steps with one checkpoint in the middle, logging every step; the table gives the median
step time over the steps before the save and over those after it (the steps next to the save and the first few
are left out). The layouts run one after the other in one invocation.

    python benchmarks/save_slowdown.py --out-dir benchmarks/results
    python benchmarks/save_slowdown.py --layouts single ddp --steps 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from common import metrics, publish, train

LAYOUTS = {  # name -> overrides; the 2-rank layouts split the machine's cores between their ranks
    "single": ["parallelism=single"],
    "ddp": ["parallelism=ddp"],
    "fsdp": ["parallelism=fsdp"],
    "zero": ["parallelism=zero", "parallelism.stage=2"],
    "tensor": ["parallelism=tensor"],
    "pipeline": ["parallelism=pipeline", "parallelism.pipeline_microbatches=2"],
    "hybrid": ["parallelism=hybrid", "parallelism.dp=1", "parallelism.pp=2", "parallelism.pipeline_microbatches=2"],
}
SKIPPED = 5  # steps at the start and around the save left out of the medians


def step_times(layout: str, steps: int, workdir: Path) -> tuple[float, float]:
    """Median step time (s) before and after the one save at the middle step."""
    save_at = steps // 2
    run_dir = workdir / layout
    overrides = [
        *LAYOUTS[layout],
        "data=synthetic",
        "model.n_layers=4",
        "model.d_model=128",
        "model.n_heads=4",
        "model.max_seq_len=64",
        "data.micro_batch_size=12",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.eval_batches=1",
        "logger=none",
        f"checkpoint.every_n_steps={save_at}",
        "checkpoint.save_final=false",
    ]
    train(overrides, run_dir)
    times = {r["step"]: r["step_time_s"] for r in metrics(run_dir) if "step_time_s" in r}
    before = [t for s, t in times.items() if SKIPPED < s <= save_at - SKIPPED]
    after = [t for s, t in times.items() if save_at + SKIPPED < s]
    return statistics.median(before), statistics.median(after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 6 * SKIPPED:
        parser.error(f"--steps must be >= {6 * SKIPPED}: the medians leave out {SKIPPED} steps at each edge")
    rows = [
        "| layout | step before the save (ms) | step after the save (ms) | after / before |",
        "|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            before, after = step_times(layout, args.steps, Path(tmp))
            rows.append(f"| {layout} | {before * 1e3:.1f} | {after * 1e3:.1f} | {after / before:.3f} |")
            print(rows[-1], flush=True)
    title = (
        f"Step time before and after one checkpoint save ({args.steps} steps, save at step {args.steps // 2}; "
        f"medians; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end)"
    )
    publish(title, rows, args.out_dir, "save_slowdown")


if __name__ == "__main__":
    main()
