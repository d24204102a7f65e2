"""AdamW against Muon on llama_tiny with the default data, each at its best learning rate from a small sweep.

For each optimizer, ``train.py`` runs once per learning rate (the sweep of multirun_sweeps/optimizers.yaml: ddp on
2 CPU ranks unless told otherwise); the rate with the lowest final validation loss is that optimizer's. Then:

- equal steps: both at ``--steps``: final validation loss, step time, optimizer-step time (the ``optimizer_time_s``
  phase: clipping, the step, the schedule), and for Muon the bytes its distributed step sent per step and rank
  (``optimizer_bytes_sent``) under ddp and, in one more run, under fsdp;
- equal wall time: the optimizer with the faster step runs again at its best rate for as many more steps as the
  slower one's run took (its schedule planned for that length), and its final validation loss is compared.

Ratios are within one invocation, runs one after another on the same machine. With ``--out-dir``: optimizers.md (the
table) and optimizers.png (training loss by step and by wall time of the best runs).

    python benchmarks/optimizers.py --out-dir benchmarks/results                  # 200 steps, 2 ranks
    python benchmarks/optimizers.py --steps 100 --lrs-adamw 3e-3 --lrs-muon 1e-2  # no sweep
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import metrics, publish, train

BASE = ["model=llama_tiny", "checkpoint=none", "logger=none", "trainer.progress_bar=false", "trainer.eval_every=50"]


def run(name: str, overrides: list[str], root: Path) -> dict[str, Any]:
    """One train.py run; its summary, per-step means of the logged windows and its training-loss curve."""
    run_dir = root / name.replace(" ", "_")
    summary = train([*BASE, *overrides], run_dir)
    records = [r for r in metrics(run_dir) if "loss" in r]
    mean = {key: statistics.fmean(r[key] for r in records if key in r) for key in records[-1] if key != "step"}
    elapsed, curve = 0.0, []
    previous = 0
    for record in records:
        elapsed += record["step_time_s"] * (record["step"] - previous)
        previous = record["step"]
        curve.append((record["step"], elapsed, record["loss"]))
    print(f"  {name}: val {summary['final_val_loss']:.4f}, step {mean['step_time_s'] * 1e3:.1f} ms", flush=True)
    return {"summary": summary, "mean": mean, "curve": curve, "seconds": elapsed}


def sweep(optimizer: str, lrs: list[float], common: list[str], root: Path) -> tuple[float, dict[str, Any], dict, float]:
    """Every rate of ``lrs``; returns (best rate, its run, val loss by rate, the median step time of the runs: the
    learning rate changes no work, so the sweep's runs are repeated timings of one step)."""
    runs = {
        lr: run(f"{optimizer} lr {lr:g}", [f"optimizer={optimizer}", f"optimizer.lr={lr}", *common], root) for lr in lrs
    }
    best = min(runs, key=lambda lr: runs[lr]["summary"]["final_val_loss"])
    step_time = statistics.median(r["mean"]["step_time_s"] for r in runs.values())
    return best, runs[best], {lr: r["summary"]["final_val_loss"] for lr, r in runs.items()}, step_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--lrs-adamw", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--lrs-muon", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2])
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    common = [f"trainer.max_steps={args.steps}", f"distributed.nproc_per_node={args.world_size}"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        best = {name: sweep(name, getattr(args, f"lrs_{name}"), common, root) for name in ("adamw", "muon")}
        fast, slow = sorted(best, key=lambda name: best[name][3])
        steps = round(args.steps * best[slow][3] / best[fast][3])
        extra = run(
            f"{fast} at equal wall time",
            [f"optimizer={fast}", f"optimizer.lr={best[fast][0]}", f"trainer.max_steps={steps}", common[1]],
            root,
        )
        fsdp = run(
            "muon under fsdp", ["optimizer=muon", f"optimizer.lr={best['muon'][0]}", "parallelism=fsdp", *common], root
        )
    rows = table(best, args, fast, slow, steps, extra, fsdp)
    publish(f"AdamW vs Muon: llama_tiny, default data, {args.steps} steps, {args.world_size} CPU ranks", rows,
            args.out_dir, "optimizers")  # fmt: skip
    if args.out_dir:
        plot({name: best[name][1]["curve"] for name in best} | {f"{fast}, {steps} steps": extra["curve"]}, args.out_dir)


HEADER = [
    "| optimizer | best lr (swept: final val loss) | steps | final val loss | step time (ms) | optimizer step (ms) "
    "| optimizer bytes/step/rank |",
    "|---|---|---|---|---|---|---|",
]


def row(label: str, lr: str, steps: int, result: dict, sent: str) -> str:
    mean = result["mean"]
    return (
        f"| {label} | {lr} | {steps} | {result['summary']['final_val_loss']:.4f} | {mean['step_time_s'] * 1e3:.1f} "
        f"| {mean.get('optimizer_time_s', float('nan')) * 1e3:.1f} | {sent} |"
    )


def table(best: dict, args: Any, fast: str, slow: str, steps: int, extra: dict, fsdp: dict) -> list[str]:
    rows = list(HEADER)
    for name, (lr, result, by_lr, _) in best.items():
        swept = ", ".join(f"{rate:g}: {loss:.3f}" for rate, loss in by_lr.items())
        sent = result["mean"].get("optimizer_bytes_sent")
        rows.append(row(name, f"{lr:g} ({swept})", args.steps, result, "0" if sent is None else f"{sent:,.0f} (ddp)"))
    rows.append(row(f"{fast}, equal wall time", f"{best[fast][0]:g}", steps, extra, ""))
    sent = fsdp["mean"].get("optimizer_bytes_sent", 0)
    rows.append(row("muon under fsdp", f"{best['muon'][0]:g}", args.steps, fsdp, f"{sent:,.0f} (fsdp)"))
    medians = ", ".join(f"{name} {best[name][3] * 1e3:.1f} ms" for name in best)
    rows += [
        "",
        f"Median step time over each sweep's runs: {medians}; {slow}'s step takes {best[slow][3] / best[fast][3]:.2f}x "
        f"{fast}'s, so at equal wall time {fast} runs {steps} steps (its schedule planned for them).",
    ]
    return rows


def plot(curves: dict[str, list[tuple[int, float, float]]], out_dir: Path) -> None:
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for label, curve in curves.items():
        steps, seconds, losses = zip(*curve, strict=True)
        by_step.plot(steps, losses, label=label)
        by_time.plot(seconds, losses, label=label)
    by_step.set(xlabel="optimizer step", ylabel="training loss", yscale="log")
    by_time.set(xlabel="training seconds", ylabel="training loss", yscale="log")
    by_step.legend(fontsize="small")
    figure.suptitle("AdamW vs Muon on llama_tiny (each at its best swept learning rate)")
    figure.tight_layout()
    figure.savefig(out_dir / "optimizers.png", dpi=100)


if __name__ == "__main__":
    main()
