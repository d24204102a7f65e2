"""What the benchmark scripts share: running train.py once and writing the resulting markdown table."""

from __future__ import annotations

import json
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


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def publish(title: str, rows: list[str], out: Path | None) -> None:
    """Print the table under ``title``, and write it to ``out`` when given."""
    table = f"{title}\n\n" + "\n".join(rows)
    print("\n" + table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + "\n")
