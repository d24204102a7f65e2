"""Gradient compression side by side: bytes each rank sends, validation loss, and the quality guard's error, for
dense DDP, bf16, PowerSGD, top-k (of the update, and of the gradient with either feedback) and DiLoCo (its outer
steps every H inner steps, streaming fragments, and its pseudo-gradients compressed by top-k or PowerSGD), on one
job.

Runs `train.py` once per option on the default model and data (the out-of-the-box run), 2 CPU ranks unless told
otherwise, and reads each run's summary.json and metrics.jsonl. Bytes are distrain's ``grad_bytes_sent`` (the
traffic model in distrain/comm/traffic.py, checked against gloo's socket writes in tests/distributed/test_comm.py),
averaged over every logged window, so they are the whole run's bytes per step. Ratios are computed within one
invocation. With ``--out-dir``: compression.md (the table) and compression.png (bytes vs validation loss, the
Pareto front dashed).

    python benchmarks/compression.py                        # 200 steps, 2 ranks
    python benchmarks/compression.py --steps 100 --world-size 4 --out-dir benchmarks/results
    python benchmarks/compression.py --job llama_tokens --out-dir benchmarks/results   # model=llama_tiny data=tokens

``--job llama_tokens`` first tokenises the standard library's Python files with ``python -m distrain.data.prepare``
(BPE, vocabulary 4096) and runs dense, the top-k and PowerSGD defaults and the DiLoCo rows on ``model=llama_tiny``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import metrics, publish, train

DENSE = "dense (comm=default)"
OPTIONS = {
    DENSE: ["comm=default"],
    "bf16": ["comm=bf16"],
    "powersgd rank 4": ["comm=powersgd", "comm.rank=4"],
    "powersgd rank 1": ["comm=powersgd", "comm.rank=1"],
    "top-k 1% (update, the default)": ["comm=topk", "comm.density=0.01"],
    "top-k 1% (update), sync_every=0": ["comm=topk", "comm.density=0.01", "comm.sync_every=0"],
    "top-k 2% (update), sync_every=0": ["comm=topk", "comm.density=0.02", "comm.sync_every=0"],
    "top-k 1% (estimate)": ["comm=topk", "comm.density=0.01", "comm.feedback=estimate"],
    "top-k 1% (residual)": ["comm=topk", "comm.density=0.01", "comm.feedback=residual"],
    "top-k 1% (residual), 100-step warm-up from dense": [
        "comm=topk",
        "comm.density=0.01",
        "comm.feedback=residual",
        "comm.warmup_steps=100",
        "comm.warmup_start_density=1.0",
    ],
    "top-k 0.1% (update), sync_every=0": ["comm=topk", "comm.density=0.001", "comm.sync_every=0"],
    "diloco H=50 (the paper's outer Nesterov, lr 0.7)": ["comm=diloco"],
    "diloco H=10": ["comm=diloco", "comm.sync_every=10"],
    "diloco H=10, outer lr 1 without momentum (local SGD)": [
        "comm=diloco",
        "comm.sync_every=10",
        "comm.outer_lr=1.0",
        "comm.outer_momentum=0",
        "comm.nesterov=false",
    ],
    "diloco H=10, 5 streaming fragments": ["comm=diloco", "comm.sync_every=10", "comm.fragments=5"],
    "diloco H=10, pseudo-gradient top-k 10%": [
        "comm=diloco",
        "comm.sync_every=10",
        "comm.compression=topk",
        "comm.density=0.1",
    ],
    "diloco H=10, pseudo-gradient powersgd rank 4": [
        "comm=diloco",
        "comm.sync_every=10",
        "comm.compression=powersgd",
        "comm.rank=4",
    ],
}
# The rows of the --job llama_tokens table: the defaults of each family and the DiLoCo ones.
LLAMA_ROWS = [DENSE, "powersgd rank 4", "top-k 1% (update, the default)"] + [
    n for n in OPTIONS if n.startswith("diloco")
]


def run(overrides: list[str], steps: int, world: int, run_dir: Path, job: list[str]) -> dict:
    args = [
        *job,
        *overrides,
        f"distributed.nproc_per_node={world}",
        f"trainer.max_steps={steps}",
        "trainer.log_every=10",
        "trainer.progress_bar=false",
        "checkpoint=none",
        "logger=none",
    ]
    summary = train(args, run_dir)
    records = metrics(run_dir)
    windows = [r for r in records if "grad_bytes_sent" in r]
    errors = [r["grad_compression_error"] for r in records if "grad_compression_error" in r]
    return {
        "bytes": statistics.mean(r["grad_bytes_sent"] for r in windows),
        "step_time_s": statistics.mean(r["step_time_s"] for r in windows[1:]),  # the first includes warm-up
        "train_loss": summary["final_train_loss"],
        "val_loss": summary["final_val_loss"],
        "error": statistics.mean(errors) if errors else None,
    }


def pareto_plot(results: dict[str, dict], title: str, path: Path) -> None:
    """Bytes per step (log) against final validation loss; the options no other beats on both are joined."""
    import matplotlib.pyplot as plt

    points = sorted((r["bytes"] / 2**20, r["val_loss"], name) for name, r in results.items())
    front, best = [], float("inf")
    for sent, loss, _ in points:
        if loss < best:
            front.append((sent, loss))
            best = loss
    figure, axes = plt.subplots(figsize=(8, 5))
    for sent, loss, name in points:
        axes.scatter(sent, loss, color="tab:blue" if (sent, loss) in front else "tab:gray")
        axes.annotate(name, (sent, loss), textcoords="offset points", xytext=(5, 3), fontsize="x-small")
    axes.plot(*zip(*front, strict=True), linestyle="--", color="tab:blue", label="Pareto front")
    axes.set(xscale="log", xlabel="gradient MiB sent / rank / step", ylabel="final validation loss", title=title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=None, help="write compression.md and compression.png here")
    parser.add_argument("--job", choices=["default", "llama_tokens"], default="default")
    args = parser.parse_args()
    header = "| option | MiB / rank / step | fewer bytes | val loss | vs dense | train loss | guard error | step (s) |"
    rows = [header, "|---|---|---|---|---|---|---|---|"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        job, options, name_of_job = [], OPTIONS, "default model and data"
        if args.job == "llama_tokens":
            job = ["model=llama_tiny", "data=tokens", f"data.path={prepared(Path(tmp) / 'tokens')}"]
            options, name_of_job = (
                {n: OPTIONS[n] for n in LLAMA_ROWS},
                "model=llama_tiny, data=tokens (stdlib BPE 4096)",
            )
        for index, (name, overrides) in enumerate(options.items()):
            results[name] = r = run(overrides, args.steps, args.world_size, Path(tmp) / str(index), job)
            dense = results[DENSE]
            error = "-" if r["error"] is None else f"{r['error']:.2f}"
            rows.append(
                f"| {name} | {r['bytes'] / 2**20:.3f} | {dense['bytes'] / r['bytes']:.1f}x | {r['val_loss']:.3f}"
                f" | {r['val_loss'] / dense['val_loss'] - 1:+.1%} | {r['train_loss']:.3f} | {error}"
                f" | {r['step_time_s']:.3f} ({r['step_time_s'] / dense['step_time_s']:.2f}x) |"
            )
            print(rows[-1], flush=True)
    title = f"{name_of_job}, {args.world_size} CPU ranks (gloo), {args.steps} steps"
    name = "compression" if args.job == "default" else f"compression_{args.job}"
    publish(title, rows, args.out_dir, name)
    if args.out_dir is not None:
        pareto_plot(results, title, args.out_dir / f"{name}.png")
        print(f"wrote {args.out_dir / f'{name}.png'}")


def prepared(out: Path) -> Path:
    """A token dataset of the standard library's Python files (BPE, vocabulary 4096)."""
    from distrain.data.corpus import stdlib_source_files

    files = [str(path) for path in stdlib_source_files()]
    command = [sys.executable, "-m", "distrain.data.prepare", "--out", str(out), "--input", *files]
    done = subprocess.run([*command, "--vocab-size", "4096"], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"prepare failed:\n{done.stderr[-3000:]}")
    return out


if __name__ == "__main__":
    main()
