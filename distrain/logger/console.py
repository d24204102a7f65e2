"""What rank 0 prints: one short line per logged step and a small table at the end (the rest is in files)."""

from __future__ import annotations

import math
from typing import Any

GIB = 1024**3


def short_number(value: float) -> str:
    """4 significant digits, exponent only for very small or very large values."""
    if isinstance(value, float) and (value == 0 or 1e-3 <= abs(value) < 1e5 or not math.isfinite(value)):
        return f"{value:.4g}"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def si_number(value: float) -> str:
    """1234567 -> 1.23M (throughputs read at a glance)."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def step_line(record: dict[str, Any], max_steps: int) -> str:
    """``step 10/200 | loss 4.62 | val 4.1 | lr 1.65e-03 | grad 3.01 | 15.3k tok/s | mfu 57% | mem 0.38 GiB | eta``."""
    parts = [f"step {record['step']}/{max_steps}"]
    if "loss" in record:
        parts.append(f"loss {short_number(record['loss'])}")
    if "val_loss" in record:
        parts.append(f"val {short_number(record['val_loss'])}")
    if "lr" in record:
        parts.append(f"lr {record['lr']:.2e}")
    if "grad_norm" in record:
        parts.append(f"grad {short_number(record['grad_norm'])}")
    if "tokens_per_s" in record:
        parts.append(f"{si_number(record['tokens_per_s'])} tok/s")
    if record.get("mfu") is not None:
        parts.append(f"mfu {record['mfu']:.1%}")
    if record.get("memory_peak_bytes") is not None:
        parts.append(f"mem {record['memory_peak_bytes'] / GIB:.2f} GiB")
    if "step_time_s" in record:
        parts.append(f"eta {duration(record['step_time_s'] * (max_steps - record['step']))}")
    return " | ".join(parts)


def summary_table(summary: dict[str, Any], run_dir: str) -> str:
    """The run's main results as aligned ``name  value`` rows, ending with where everything else is."""
    stats = summary.get("metrics", {})

    def mean(key: str) -> float | None:
        return stats[key]["mean"] if key in stats else None

    peaks = [peak for peak in summary.get("peak_memory_bytes_per_rank") or [] if peak is not None]
    stopped = f" (stopped by {summary['stopped_by']})" if summary.get("stopped_by") else ""
    rows = [
        ("steps", f"{summary.get('steps')}{stopped}"),
        ("layout", f"{summary.get('parallelism')} x {summary.get('world_size')} ranks, {summary.get('precision')}"),
        ("train loss", _pair(summary.get("first_logged_loss"), summary.get("final_train_loss"))),
        ("val loss", _maybe(summary.get("final_val_loss"), short_number)),
        ("tokens/s (mean)", _maybe(mean("tokens_per_s"), si_number)),
        ("mfu (mean)", _maybe(mean("mfu"), lambda v: f"{v:.1%}")),
        ("peak memory", f"{max(peaks) / GIB:.2f} GiB per rank (max)" if peaks else "-"),
        ("wall time", _maybe(summary.get("wall_time_s"), duration)),
        ("skipped steps", str(summary.get("skipped_steps", 0))),
        ("run directory", run_dir),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name.ljust(width)}  {value}" for name, value in rows]
    return "\n".join(["run summary (all of it in summary.json):", *lines])


def _maybe(value: float | None, show: Any) -> str:
    return "-" if value is None else show(value)


def _pair(first: float | None, last: float | None) -> str:
    if first is None or last is None:
        return _maybe(last, short_number)
    return f"{short_number(first)} -> {short_number(last)}"
