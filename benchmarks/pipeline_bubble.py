"""The pipeline bubble measured beside the theory: for each schedule and number of micro-batches, each stage's idle
fraction of the pipeline's time (``pipeline_bubble_rank<r>`` in the metrics) and the ideal (p-1)/(v m + p-1).

Runs `train.py` with ``parallelism=pipeline`` on 2 CPU ranks for each setting, one after the other in one
invocation, and prints a markdown table (means over the logged windows after the first).

    python benchmarks/pipeline_bubble.py
    python benchmarks/pipeline_bubble.py --steps 30 --out-dir results/
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import metrics, publish, train

SETTINGS = (
    [("gpipe", m) for m in (1, 2, 4, 8)] + [("1f1b", m) for m in (2, 4, 8)] + [("interleaved", m) for m in (2, 4, 8)]
)
MODEL = ["model.n_layers=4", "model.d_model=256", "model.max_seq_len=128", "data.micro_batch_size=16"]


def run(schedule: str, microbatches: int, steps: int, run_dir: Path) -> dict[str, float]:
    train(
        [
            "parallelism=pipeline",
            f"parallelism.schedule={schedule}",
            f"parallelism.pipeline_microbatches={microbatches}",
            *MODEL,
            f"trainer.max_steps={steps}",
            "trainer.log_every=5",
            "trainer.eval_every=0",
            "trainer.progress_bar=false",
            "checkpoint=none",
            "logger=none",
        ],
        run_dir,
    )
    windows = [r for r in metrics(run_dir) if "pipeline_bubble" in r][1:]
    keys = (
        "pipeline_bubble_theory",
        "pipeline_bubble",
        "pipeline_bubble_rank0",
        "pipeline_bubble_rank1",
        "step_time_s",
    )
    return {key: statistics.mean(r[key] for r in windows) for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out-dir", type=Path, default=None, help="write pipeline_bubble.md and .png here")
    args = parser.parse_args()
    measured = {}
    rows = [
        "| schedule | micro-batches | theory | measured (mean) | stage 0 | stage 1 | step (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for index, (schedule, microbatches) in enumerate(SETTINGS):
            r = run(schedule, microbatches, args.steps, Path(tmp) / str(index))
            rows.append(
                f"| {schedule} | {microbatches} | {r['pipeline_bubble_theory']:.3f} | {r['pipeline_bubble']:.3f}"
                f" | {r['pipeline_bubble_rank0']:.3f} | {r['pipeline_bubble_rank1']:.3f} | {r['step_time_s']:.3f} |"
            )
            print(rows[-1], flush=True)
            measured[f"{schedule} m={microbatches}"] = r["pipeline_bubble"]
    title = f"2 CPU ranks (gloo), 4 blocks of width 256, 16 sequences of 128 tokens per step, {args.steps} steps"
    publish(title, rows, args.out_dir, "pipeline_bubble", bars=(measured, "measured bubble (mean over stages)"))


if __name__ == "__main__":
    main()
