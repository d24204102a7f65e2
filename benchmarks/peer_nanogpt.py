"""nanoGPT as a contender (``python benchmarks/peers.py --nanogpt DIR``): a nanoGPT checkout's own ``train.py`` on
its shakespeare-char CPU recipe (its README's command) against ``python train.py
experiment=nanogpt_shakespeare_char`` on the same prepared data, run alternately.

Nothing of nanoGPT is in this repository. Get a checkout and prepare its data as its README says::

    git clone https://github.com/karpathy/nanoGPT && python nanoGPT/data/shakespeare_char/prepare.py

For each run: start-up (from starting the command to the training loop: for nanoGPT, its line ``using fused
AdamW``, printed as the loop is entered; for distrain, ``loop_started_at``), the median step time (each program's
own per-step timing; nanoGPT's includes the evaluation iterations, hence the median), the median step after the
first checkpoint (iteration 250) over the median before it, the whole command's wall time and CPU time (user +
system: the work, which the machine's other tenants stretch far less than the wall time), and the validation loss
of the final model on one common evaluator: every non-overlapping window of ``val.bin`` (context 64), both models
loaded from their checkpoints by this file. Before timing, both programs' modules are compiled to bytecode
(``common.compile_bytecode``), as any second run would find them.
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from common import REPO, children_cpu_s, compile_bytecode, metrics

RECIPE = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64"]
RECIPE += ["--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--dropout=0.0"]
CONTEXT = 64
ITER_LINE = re.compile(r"^iter (\d+): loss [-\d.]+, time ([\d.]+)ms")
SKIPPED = 10  # first steps left out of the medians (allocator, first-call costs)
FIRST_SAVE = 250  # both programs evaluate and save a checkpoint after iteration 250 (nanoGPT: when val improves)


def after_over_before_save(times: list[tuple[int, float]]) -> float:
    """Median step time after the first save over the median before it (steps after ``SKIPPED``)."""
    before = [seconds for step, seconds in times if SKIPPED < step <= FIRST_SAVE]
    after = [seconds for step, seconds in times if step > FIRST_SAVE]
    return statistics.median(after) / statistics.median(before) if before and after else float("nan")


def data_dir(checkout: Path) -> Path:
    """The checkout's prepared shakespeare-char data; exits with one line when it is not there."""
    data = checkout / "data" / "shakespeare_char"
    missing = [name for name in ("train.bin", "val.bin", "meta.pkl") if not (data / name).is_file()]
    if not (checkout / "train.py").is_file() or missing:
        sys.exit(
            f"--nanogpt {checkout} is not allowed: a nanoGPT checkout with its shakespeare-char data prepared "
            f"(python {checkout}/data/shakespeare_char/prepare.py); missing: {', '.join(missing) or 'train.py'}"
        )
    return data


def run_nanogpt(checkout: Path, steps: int, out_dir: Path) -> dict[str, Any]:
    """nanoGPT's ``train.py`` with its recipe for ``steps`` iterations, from the checkout (it reads ``data/`` from
    there), writing its checkpoint to ``out_dir``."""
    schedule = [f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--out_dir={out_dir}"]
    command = [sys.executable, "-u", "train.py", "config/train_shakespeare_char.py", *RECIPE, *schedule]
    started, cpu_before = time.time(), children_cpu_s()
    loop_started, times, lines = None, [], []
    with subprocess.Popen(command, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as run:
        for line in run.stdout:
            lines.append(line)
            if loop_started is None and line.startswith("using fused AdamW"):
                loop_started = time.time()
            if match := ITER_LINE.match(line):
                times.append((int(match[1]), float(match[2]) / 1e3))
    if run.returncode != 0 or loop_started is None:
        sys.exit(f"nanoGPT failed:\n{''.join(lines[-30:])}")
    step_times = [seconds for step, seconds in times if step >= SKIPPED]
    return {
        "startup_s": loop_started - started,
        "step_time_s": statistics.median(step_times),
        "after_save": after_over_before_save(times),
        "wall_s": time.time() - started,
        "cpu_s": children_cpu_s() - cpu_before,
        "val_loss": common_val_loss(nanogpt_model(checkout, out_dir / "ckpt.pt"), checkout / "data/shakespeare_char"),
    }


def run_distrain(data: Path, steps: int, run_dir: Path) -> dict[str, Any]:
    """``train.py experiment=nanogpt_shakespeare_char`` on the same data, every step logged (as nanoGPT's recipe)."""
    args = ["experiment=nanogpt_shakespeare_char", f"data.path={data}", f"trainer.max_steps={steps}"]
    args += ["trainer.log_every=1", "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"]
    started, cpu_before = time.time(), children_cpu_s()
    done = subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True)
    wall, cpu = time.time() - started, children_cpu_s() - cpu_before
    if done.returncode != 0:
        sys.exit(f"distrain failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    times = [(r["step"], r["step_time_s"]) for r in metrics(run_dir) if "step_time_s" in r]
    return {
        "startup_s": summary["loop_started_at"] - started,
        "step_time_s": statistics.median(seconds for step, seconds in times if step > SKIPPED),
        "after_save": after_over_before_save(times),
        "wall_s": wall,
        "cpu_s": cpu,
        "val_loss": common_val_loss(distrain_model(run_dir / "checkpoints"), data),
    }


def nanogpt_module(checkout: Path) -> Any:
    """nanoGPT's ``model.py`` from ``checkout``, imported by path (its ``GPT`` and ``GPTConfig``)."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", checkout / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt_model(checkout: Path, checkpoint: Path) -> Any:
    """A callable (inputs, targets) -> mean loss: nanoGPT's model from its ``ckpt.pt`` (its best validation)."""
    module = nanogpt_module(checkout)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)  # nanoGPT pickles its config dict
    model = module.GPT(module.GPTConfig(**saved["model_args"]))
    model.load_state_dict({key.removeprefix("_orig_mod."): value for key, value in saved["model"].items()})
    model.eval()
    return lambda inputs, targets: model(inputs, targets)[1]


def distrain_model(checkpoints: Path) -> Any:
    """A callable (inputs, targets) -> mean loss: distrain's final model, loaded as ``generate`` loads it."""
    from distrain.tools.generate import load_model

    newest = sorted(checkpoints.glob("step_*"))[-1]
    model, _ = load_model(newest, "cpu")
    return lambda inputs, targets: F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


@torch.no_grad()
def common_val_loss(loss_of: Any, data: Path, batch: int = 64) -> float:
    """Mean loss over every non-overlapping window of ``CONTEXT`` ids in ``val.bin`` (targets shifted by one)."""
    ids = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64))
    windows = (len(ids) - 1) // CONTEXT
    inputs = ids[: windows * CONTEXT].view(windows, CONTEXT)
    targets = ids[1 : windows * CONTEXT + 1].view(windows, CONTEXT)
    total = 0.0
    for start in range(0, windows, batch):
        chunk = slice(start, start + batch)
        total += loss_of(inputs[chunk], targets[chunk]).item() * len(inputs[chunk])
    return total / windows


def compare(checkout: Path, steps: int, repeats: int, workdir: Path) -> dict[str, list[dict[str, Any]]]:
    """nanoGPT, then distrain, ``repeats`` times; each run's numbers."""
    data = data_dir(checkout)
    compile_bytecode(REPO / "distrain", checkout / "model.py")
    runs: dict[str, list[dict[str, Any]]] = {"nanoGPT": [], "distrain": []}
    for repeat in range(repeats):
        runs["nanoGPT"].append(run_nanogpt(checkout, steps, workdir / f"nanogpt_{repeat}"))
        print("nanoGPT", runs["nanoGPT"][-1], flush=True)
        runs["distrain"].append(run_distrain(data, steps, workdir / f"distrain_{repeat}"))
        print("distrain", runs["distrain"][-1], flush=True)
    return runs


def table(runs: dict[str, list[dict[str, Any]]], steps: int) -> tuple[str, list[str]]:
    """The markdown rows: per program the median over its runs, and distrain / nanoGPT."""
    keys = ("startup_s", "step_time_s", "after_save", "wall_s", "cpu_s", "val_loss")
    median = {name: {key: statistics.median(r[key] for r in rs) for key in keys} for name, rs in runs.items()}
    header = "| program | start-up (s) | step (ms) | step after / before the first save | whole run (s) "
    header += "| whole run, CPU (s) | validation loss (common) |"
    rows = [header, "|---" * 7 + "|"]
    for name, m in median.items():
        rows.append(
            f"| {name} | {m['startup_s']:.2f} | {m['step_time_s'] * 1e3:.1f} | {m['after_save']:.3f}"
            f" | {m['wall_s']:.1f} | {m['cpu_s']:.1f} | {m['val_loss']:.4f} |"
        )
    ratio = {key: median["distrain"][key] / median["nanoGPT"][key] for key in keys}
    rows.append(
        f"| distrain / nanoGPT | {ratio['startup_s']:.2f}x | {ratio['step_time_s']:.3f}x | - | {ratio['wall_s']:.3f}x"
        f" | {ratio['cpu_s']:.3f}x | {ratio['val_loss']:.4f}x |"
    )
    title = (
        f"nanoGPT's shakespeare-char CPU recipe (4 x 128, context 64, batch 12, {steps} iterations), one process, "
        f"alternating, {len(runs['nanoGPT'])} run(s) each (medians)"
    )
    return title, rows
