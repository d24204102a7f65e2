"""Rank 0's reporting: metrics.jsonl and summary.json in the run directory, the tracker, the progress display."""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from distrain.logger.trackers import Tracker

log = logging.getLogger(__name__)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA's peak allocation on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class RunReporter:
    """Writes one JSON object per logged step to ``metrics.jsonl`` and forwards it to the tracker.

    Only the rank built with ``enabled=True`` (rank 0) writes; the progress bar redraws on a terminal and
    becomes one log line per logged step otherwise (CI, SLURM output files).
    """

    def __init__(self, *, run_dir: str, tracker: Tracker, enabled: bool, max_steps: int, progress_bar: bool) -> None:
        self.run_dir, self.tracker, self.enabled = Path(run_dir), tracker, enabled
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.bar = None
        if enabled and progress_bar and sys.stderr.isatty():
            self.bar = tqdm(total=max_steps, desc="train", dynamic_ncols=True)

    def start(self, *, run_name: str, config: dict[str, Any], initial_step: int) -> None:
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._rewind_metrics(initial_step)
        self.tracker.start(run_dir=str(self.run_dir), run_name=run_name, config=config)
        if self.bar is not None:
            self.bar.update(initial_step)

    def _rewind_metrics(self, initial_step: int) -> None:
        """After a restart from a checkpoint, drop records of the steps that are about to be trained again, so
        metrics.jsonl stays one record per step of the run that really happened (rewritten atomically)."""
        if not self.metrics_path.exists():
            return
        lines = self.metrics_path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= initial_step]
        if len(kept) < len(lines):
            rewritten = self.metrics_path.with_suffix(".jsonl.tmp")
            rewritten.write_text("".join(kept))
            rewritten.replace(self.metrics_path)
            log.info(
                "metrics.jsonl rewound to step %d (%d later records dropped)", initial_step, len(lines) - len(kept)
            )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.metrics_path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        self.tracker.log(record)
        shown = {k: record[k] for k in ("loss", "val_loss", "tokens_per_s", "lr") if k in record}
        if self.bar is not None:
            self.bar.update(record["step"] - self.bar.n)
            self.bar.set_postfix({k: _short(v) for k, v in shown.items()})
        else:
            log.info("step %d %s", record["step"], " ".join(f"{k}={_short(v)}" for k, v in shown.items()))

    def finish(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.tracker.finish(summary)
        log.info("summary: %s", json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))


def _short(value: float) -> str:
    if isinstance(value, float) and (value == 0 or 1e-3 <= abs(value) < 1e5 or not math.isfinite(value)):
        return f"{value:.4g}"
    return f"{value:.3g}" if isinstance(value, float) else str(value)
