"""What rank 0 prints: one short line per logged step and a small table at the end (the rest is in files)."""

from __future__ import annotations

import math
from collections.abc import Callable
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


# What one console line shows, in order: (record key, how it reads, how the value is written).
STEP_FIELDS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("loss", "loss {}", short_number),
    ("val_loss", "val {}", short_number),
    ("lr", "lr {}", lambda value: f"{value:.2e}"),
    ("grad_norm", "grad {}", short_number),
    ("tokens_per_s", "{} tok/s", si_number),
    ("mfu", "mfu {}", lambda value: f"{value:.1%}"),
    ("memory_peak_bytes", "mem {}", lambda value: f"{value / GIB:.2f} GiB"),
)


def step_line(record: dict[str, Any], max_steps: int) -> str:
    """``step 10/200 | loss 4.62 | val 4.1 | lr 1.65e-03 | grad 3.01 | 15.3k tok/s | mfu 57% | mem 0.38 GiB | eta``;
    a metric that is absent or None is left out, a non-finite one is written as such (training never stops here)."""
    parts = [f"step {record['step']}/{max_steps}"]
    for key, template, show in STEP_FIELDS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(template.format(show(value) if math.isfinite(value) else str(value)))
    step_time = record.get("step_time_s")
    remaining = step_time * (max_steps - record["step"]) if isinstance(step_time, (int, float)) else math.nan
    if math.isfinite(remaining):
        parts.append(f"eta {duration(remaining)}")
    return " | ".join(parts)


def summary_table(summary: dict[str, Any], run_dir: str) -> str:
    """The run's main results as aligned ``name  value`` rows, ending with where everything else is."""
    stats = summary.get("metrics", {})

    def mean(key: str) -> float | None:
        return stats[key]["mean"] if key in stats else None

    peaks = [peak for peak in summary.get("peak_memory_bytes_per_rank") or [] if peak is not None]
    stopped = f" (stopped by {summary['stopped_by']})" if summary.get("stopped_by") else ""
    layout, ranks = summary.get("layout", summary.get("parallelism")), summary.get("world_size")
    if summary.get("comm") not in (None, "default"):  # how gradients travelled, when not the plain all-reduce
        layout += f" with comm={summary['comm']}"
    groups = summary.get("replica_groups", 1)
    groups = f" in each of {groups} replica groups" if groups > 1 else ""  # ft=torchft: world_size is one group's
    rows = [
        ("steps", f"{summary.get('steps')}{stopped}"),
        ("layout", f"{layout} on {ranks} rank{'' if ranks == 1 else 's'}{groups}, {summary.get('precision')}"),
        ("train loss", _pair(summary.get("first_logged_loss"), summary.get("final_train_loss"))),
        ("val loss", _maybe(summary.get("final_val_loss"), short_number)),
        ("tokens/s (mean)", _maybe(mean("tokens_per_s"), si_number)),
        ("mfu (mean)", _maybe(mean("mfu"), lambda v: f"{v:.1%}")),
        ("peak memory", f"{max(peaks) / GIB:.2f} GiB per rank (max)" if peaks else "-"),
        ("wall time", _maybe(summary.get("wall_time_s"), duration)),
        ("skipped steps", str(summary.get("skipped_steps", 0))),
        *([("steps run again", str(summary["dropped_steps"]))] if summary.get("dropped_steps") else []),
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
