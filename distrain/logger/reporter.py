"""Rank 0's reporting: metrics.jsonl and summary.json in the run directory, the tracker, the progress display."""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from distrain.logger.trackers import Tracker

log = logging.getLogger(__name__)


class RunReporter:
    """Writes one JSON object per logged step to ``metrics.jsonl`` and forwards it to the tracker.

    Only the rank built with ``enabled=True`` (rank 0) writes; the progress bar redraws on a terminal and
    becomes one log line per logged step otherwise (CI, SLURM output files).
    """

    def __init__(self, *, run_dir: str, tracker: Tracker, enabled: bool, max_steps: int, progress_bar: bool) -> None:
        self.run_dir, self.tracker, self.enabled, self.max_steps = Path(run_dir), tracker, enabled, max_steps
        self.records: list[dict[str, Any]] = []
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.bar = None
        if enabled and progress_bar and sys.stderr.isatty():
            self.bar = tqdm(total=max_steps, desc="train", dynamic_ncols=True)

    def start(
        self,
        *,
        run_name: str,
        run_group: str | None,
        config: dict[str, Any],
        initial_step: int,
        resumed_from: str | None,
    ) -> None:
        self.initial_step, self.records = initial_step, []
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._rewind_metrics(initial_step)
        self.tracker.start(
            run_dir=str(self.run_dir),
            run_name=run_name,
            run_group=run_group,
            config=config,
            resumed_from=resumed_from,
        )
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
            file.write(strict_json(record) + "\n")
        self.records.append(record)
        self.tracker.log(record)
        shown = {k: record[k] for k in ("loss", "val_loss", "tokens_per_s", "mfu", "lr") if k in record}
        if self.bar is not None:
            self.bar.update(record["step"] - self.bar.n)  # tqdm shows step, rate and ETA itself
            self.bar.set_postfix({k: _short(v) for k, v in shown.items()})
        else:
            eta = ""
            if "step_time_s" in record:
                eta = f" eta={_duration(record['step_time_s'] * (self.max_steps - record['step']))}"
            text = " ".join(f"{k}={_short(v)}" for k, v in shown.items())
            log.info("step %d/%d %s%s", record["step"], self.max_steps, text, eta)

    def finish(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        summary = summary | {"metrics": metric_statistics(self.records)}
        log.info("per-step metrics over the run:\n%s", statistics_table(summary["metrics"]))
        (self.run_dir / "summary.json").write_text(strict_json(summary, indent=2) + "\n")
        self.tracker.finish(summary)
        log.info("summary: %s", strict_json({k: v for k, v in summary.items() if not isinstance(v, list)}))


def without_nonfinite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None (JSON has no spelling for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: without_nonfinite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_nonfinite(item) for item in value]
    return value


def strict_json(value: Any, indent: int | None = None) -> str:
    """Standard JSON that any parser reads: a metric with nothing to measure is null, never NaN or Infinity."""
    return json.dumps(without_nonfinite(value), indent=indent, allow_nan=False)


def _short(value: float) -> str:
    if isinstance(value, float) and (value == 0 or 1e-3 <= abs(value) < 1e5 or not math.isfinite(value)):
        return f"{value:.4g}"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def metric_statistics(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean, standard deviation, min and max of every numeric metric over the logged records."""
    columns: dict[str, list[float]] = {}
    for record in records:
        for key, value in record.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key != "step" and number and math.isfinite(value):
                columns.setdefault(key, []).append(float(value))
    stats = {}
    for key, values in columns.items():
        stats[key] = {
            "mean": statistics.fmean(values),
            "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
            "min": min(values),
            "max": max(values),
            "count": len(values),
        }
    return stats


def statistics_table(stats: dict[str, dict[str, float]]) -> str:
    """``metric_statistics`` as an aligned text table."""
    rows = [("metric", "mean", "std", "min", "max")]
    rows += [(k, *(_short(v[c]) for c in ("mean", "std", "min", "max"))) for k, v in stats.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)
