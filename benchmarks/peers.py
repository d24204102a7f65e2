"""distrain against what a user would pick instead: PyTorch Lightning, Hugging Face Accelerate and a minimal
hand-written DDP loop, one after another in one invocation.

Each trains the default model (gpt_tiny) on the default data (the standard library's source bytes) with AdamW
(lr 3e-3, betas 0.9/0.95, weight decay 0.1, distrain's warm-up + cosine schedule), micro-batch 8 per rank, gradient
clipping at 1.0, on the same number of gloo ranks with the same threads per rank, as a fresh command (its own
interpreter and ranks), so start-up is measured the same way for all:

- start-up: from starting the command to rank 0 beginning its first optimizer step (imports, process start,
  process group, model, data);
- step: mean wall time per optimizer step on rank 0 after 10 warm-up steps (for distrain, its logged step time);
- final loss: mean training loss over the last 10 steps, averaged over ranks.

Ratios are to the minimal loop. Needs ``pip install -e ".[bench]"`` (Lightning and Accelerate with the pinned torch).

    python benchmarks/peers.py                                    # 2 ranks, 200 steps
    python benchmarks/peers.py --steps 200 --out-dir benchmarks/results
    python benchmarks/peers.py --nanogpt nanoGPT --out-dir benchmarks/results    # also nanoGPT on its own recipe

With ``--nanogpt DIR`` (a nanoGPT checkout with its shakespeare-char data prepared) a second table compares
nanoGPT's ``train.py`` on its CPU recipe with ``train.py experiment=nanogpt_shakespeare_char``, alternating the two
(``benchmarks/peer_nanogpt.py``). The tables note the machine's load average at the end of the invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, compile_bytecode, metrics, publish

MODEL = {"vocab_size": 256, "max_seq_len": 128, "d_model": 128, "n_layers": 4, "n_heads": 4}
MICRO_BATCH, SEQ_LEN, WARMUP_STEPS, LAST = 8, 128, 10, 10
PEERS = ("minimal", "lightning", "accelerate")
LABELS = {
    "minimal": "minimal PyTorch DDP loop",
    "lightning": "PyTorch Lightning (Trainer, strategy=ddp)",
    "accelerate": "Hugging Face Accelerate (torchrun)",
    "distrain": "distrain (python train.py)",
}


def run_peer(name: str, world: int, steps: int, out: Path) -> dict:
    """``python peers.py --worker NAME`` (under torchrun for the ones that expect an outer launcher)."""
    here = str(Path(__file__).resolve())
    worker = [here, "--worker", name, "--steps", str(steps), "--world-size", str(world), "--result", str(out)]
    if name == "accelerate":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *worker]
    else:
        command = [sys.executable, *worker]
    env = os.environ | {"PEERS_STARTED_AT": str(time.time()), "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=out.parent)
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_distrain(world: int, steps: int, run_dir: Path) -> dict:
    started = time.time()
    args = [
        f"distributed.nproc_per_node={world}",
        f"trainer.max_steps={steps}",
        f"trainer.log_every={LAST}",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        "checkpoint=none",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"distrain failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    timed = [r["step_time_s"] for r in metrics(run_dir) if "step_time_s" in r][1:]  # the first window: warm-up
    return {
        "startup_s": summary["loop_started_at"] - started,
        "step_time_s": sum(timed) / len(timed),
        "final_loss": summary["final_train_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out-dir", type=Path, default=None, help="write peers.md and peers.png here")
    parser.add_argument("--nanogpt", type=Path, default=None, help="a nanoGPT checkout: also compare with it")
    parser.add_argument("--nanogpt-steps", type=int, default=2000, help="iterations of nanoGPT's recipe")
    parser.add_argument("--nanogpt-repeats", type=int, default=3, help="alternating runs of each program")
    parser.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from peer_loops import WORKERS

        WORKERS[args.worker](args.world_size, args.steps, args.result)
        # The result is written and the process group torn down; skip the interpreter's teardown, where a
        # framework's leftover native thread aborted a finished worker ("terminate called without an active
        # exception": seen once each for Lightning and Accelerate in CI).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    results, nanogpt = {}, None
    compile_bytecode(REPO / "distrain", Path(__file__).parent)
    with tempfile.TemporaryDirectory() as tmp:
        if args.nanogpt is not None:  # first: a checkout without its data is refused before the long runs
            from peer_nanogpt import compare

            nanogpt = compare(args.nanogpt, args.nanogpt_steps, args.nanogpt_repeats, Path(tmp))
        for name in PEERS:
            results[name] = run_peer(name, args.world_size, args.steps, Path(tmp) / f"{name}.json")
            print(name, results[name], flush=True)
        results["distrain"] = run_distrain(args.world_size, args.steps, Path(tmp) / "distrain")
        print("distrain", results["distrain"], flush=True)
    title, rows = default_job_table(results, args.world_size, args.steps)
    if nanogpt is not None:
        from peer_nanogpt import table

        nanogpt_title, nanogpt_rows = table(nanogpt, args.nanogpt_steps)
        rows += ["", nanogpt_title, "", *nanogpt_rows]
    rows += ["", f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} at the end of the invocation."]
    bars = {LABELS[name].split(" (")[0]: r["step_time_s"] for name, r in results.items()}
    publish(title, rows, args.out_dir, "peers", bars=(bars, "step time (s)"))


def default_job_table(results: dict[str, dict], world: int, steps: int) -> tuple[str, list[str]]:
    minimal, labels = results["minimal"], LABELS
    header = "| framework | start-up (s) | vs minimal | step (s) | vs minimal | final loss |"
    rows = [header, "|---|---|---|---|---|---|"]
    for name, r in results.items():
        rows.append(
            f"| {labels[name]} | {r['startup_s']:.2f} | {r['startup_s'] / minimal['startup_s']:.2f}x"
            f" | {r['step_time_s']:.4f} | {r['step_time_s'] / minimal['step_time_s']:.2f}x | {r['final_loss']:.3f} |"
        )
    return f"gpt_tiny, {world} CPU ranks (gloo), {steps} steps, AdamW, one invocation", rows


if __name__ == "__main__":
    main()
