"""What the benchmark scripts share: running train.py once, and publishing a markdown table and a bar chart."""

from __future__ import annotations

import argparse
import compileall
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def train(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """``python train.py <overrides>`` into ``run_dir``; exits the benchmark with the run's error if it fails.
    Returns the run's summary.json."""
    args = [*overrides, f"hydra.run.dir={run_dir}"]
    done = subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"train.py {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def compile_bytecode(*paths: Path) -> None:
    """Write the bytecode of the Python files under ``paths`` (as a second run of any program reads it) so that
    start-up compares programs, not this machine's ``PYTHONDONTWRITEBYTECODE``: with it set, every run compiles
    distrain's 150 modules again (about 0.1 s), while nanoGPT or a one-file loop compiles next to nothing."""
    for path in paths:
        if path.is_dir():
            compileall.compile_dir(str(path), quiet=1)
        else:
            compileall.compile_file(str(path), quiet=1)


def children_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process's finished children: a command's difference is its
    work, which other tenants of the machine stretch far less than its wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def publish(
    title: str,
    rows: list[str],
    out_dir: Path | None,
    name: str,
    bars: tuple[dict[str, float], str] | None = None,
    log_scale: bool = False,
) -> None:
    """Print the table under ``title``. With ``out_dir``: also write ``<name>.md`` and, given ``bars``
    (label -> value, axis label), ``<name>.png``."""
    table = f"{title}\n\n" + "\n".join(rows)
    print("\n" + table)
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.md").write_text(table + "\n")
    if bars is not None:
        import matplotlib.pyplot as plt

        values, label = bars
        figure, axes = plt.subplots(figsize=(7, 4))
        axes.bar(range(len(values)), list(values.values()))
        axes.set_xticks(range(len(values)), list(values), rotation=30, ha="right", fontsize="small")
        axes.set(ylabel=label, title=title if len(title) < 70 else name)
        if log_scale:
            axes.set_yscale("log")
        figure.tight_layout()
        figure.savefig(out_dir / f"{name}.png", dpi=100)
        print(f"wrote {out_dir / name}.md and .png")


def one_process_gpt_parser(doc: str | None) -> argparse.ArgumentParser:
    """Arguments of the one-process GPT benchmarks: its shape, the batch and the number of timed steps."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    return parser
