"""Rank 0's reporting: metrics.jsonl and summary.json in the run directory, the tracker, the progress display."""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from distrain.artifacts.run_directory import is_metrics_record
from distrain.errors import RunError, first_line
from distrain.trackers.base import TrackedRun, Tracker, numeric_metrics
from distrain.trackers.console import step_line, summary_table

log = logging.getLogger(__name__)


class RunReporter:
    """Writes one JSON object per logged step to ``metrics.jsonl`` and forwards it to every tracker.

    Only the rank built with ``enabled=True`` (rank 0) writes. Every logged step is one console line; on a terminal
    a progress bar sits below them (log lines are redirected above it), elsewhere (CI, SLURM output) there is none.
    A tracker that fails after starting is dropped with one warning: metrics.jsonl still holds every record.
    """

    def __init__(
        self, *, run_dir: str, trackers: dict[str, Tracker], enabled: bool, max_steps: int, progress_bar: bool
    ) -> None:
        self.run_dir, self.trackers, self.enabled, self.max_steps = Path(run_dir), dict(trackers), enabled, max_steps
        self.records: list[dict[str, Any]] = []
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.show_bar = enabled and progress_bar and sys.stderr.isatty()
        self.bar: Any = None
        self._redirect: Any = None

    def start(
        self,
        *,
        run_name: str,
        run_group: str | None,
        config: dict[str, Any],
        initial_step: int,
        resumed_from: str | None,
    ) -> None:
        """Rewind metrics.jsonl to ``initial_step``, start the trackers and the progress bar. Called on every rank;
        rank 0 broadcasts whether its trackers started (one ``broadcast_object_list``), so when one fails every
        rank raises the RunError naming it at once, instead of the others waiting at their next collective."""
        self.initial_step, self.records = initial_step, []
        problem = [None]
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._rewind_metrics(initial_step)
            run = TrackedRun(self.run_dir, run_name, run_group, config, resumed_from, initial_step)
            for name, tracker in self.trackers.items():
                try:
                    tracker.start(run)
                except Exception as err:  # noqa: BLE001 - any tracker's own error becomes the one line below
                    problem = [f"logger.{name} could not start: {first_line(err, 400)}"]
                    break
        if dist.is_initialized():
            dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise RunError(problem[0])
        if self.show_bar:
            self.bar = tqdm(total=self.max_steps, initial=initial_step, desc="train", dynamic_ncols=True, leave=False)
            self._redirect = logging_redirect_tqdm([logging.getLogger("distrain")], tqdm_class=tqdm)
            self._redirect.__enter__()  # log lines print above the bar instead of through it

    def advance(self, step: int) -> None:
        """Move the progress bar to ``step`` (every step; tqdm redraws at most a few times a second)."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def _rewind_metrics(self, initial_step: int) -> None:
        """After a restart from a checkpoint, drop records of the steps that are about to be trained again, so
        metrics.jsonl stays one record per step of the run that really happened (rewritten atomically)."""
        if not self.metrics_path.exists():
            return
        lines = self.metrics_path.read_text().splitlines(keepends=True)
        # A last line a crash cut short is dropped (the inspector of the run directory allows only that one).
        kept = [line for line in lines if is_metrics_record(line) and json.loads(line)["step"] <= initial_step]
        self.records = [json.loads(line) for line in kept]  # the summary's statistics cover the whole run
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
        self._to_trackers("log", record)
        self.advance(record["step"])
        if self.bar is not None and "loss" in record:
            self.bar.set_postfix_str(f"loss {record['loss']:.4g}", refresh=False)
        log.info(step_line(record, self.max_steps))

    def finish(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._close_bar()
        summary = summary | {"metrics": metric_statistics(self.records)}
        losses = [record["loss"] for record in self.records if isinstance(record.get("loss"), (int, float))]
        if losses:  # after a resume, the run's first logged loss is an earlier job's
            summary["first_logged_loss"] = losses[0]
            if summary.get("final_train_loss") is None:
                summary["final_train_loss"] = losses[-1]
        (self.run_dir / "summary.json").write_text(strict_json(summary, indent=2) + "\n")
        self._to_trackers("finish", summary)
        self.trackers = {}
        log.info(summary_table(summary, str(self.run_dir.resolve())))

    def fail(self) -> None:
        """The run failed before ``finish``: close the bar (so the error prints on its own line) and mark every
        tracker's run failed. Raises nothing: the job is already failing with its own error."""
        self._close_bar()
        for tracker in self.trackers.values():
            _fail_quietly(tracker)
        self.trackers = {}

    def _close_bar(self) -> None:
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _to_trackers(self, method: str, payload: dict[str, Any]) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                getattr(tracker, method)(payload)
            except Exception as err:  # noqa: BLE001 - a tracker's outage must not stop training
                log.warning("logger.%s failed (%s); it gets no more records this run", name, first_line(err, 400))
                del self.trackers[name]
                _fail_quietly(tracker)


def _fail_quietly(tracker: Tracker) -> None:
    try:
        tracker.fail()
    except Exception as err:  # noqa: BLE001 - closing a broken tracker must not hide the run's own outcome
        log.warning("could not mark the tracker's run failed: %s", first_line(err, 400))


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


def metric_statistics(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean, standard deviation, min and max of every numeric metric over the logged records."""
    columns: dict[str, list[float]] = {}
    for record in records:
        for key, value in numeric_metrics(record).items():
            if math.isfinite(value):
                columns.setdefault(key, []).append(value)
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
