"""Load finished runs into pandas DataFrames.

A run directory is what ``train.py`` leaves: ``summary.json``, ``metrics.jsonl`` and ``.hydra/``. A multirun (``-m``)
directory holds one per job (``0/``, ``1/``, ...); ``load_runs`` takes either, or any tree of them. Each run is
labelled by the overrides that differ between the runs found, so a sweep over ``parallelism`` and
``distributed.nproc_per_node`` reads as ``parallelism=fsdp distributed.nproc_per_node=4``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

RUN_FILES = ("summary.json", "metrics.jsonl")


def find_run_dirs(root: str | Path) -> list[Path]:
    """Every directory under ``root`` (``root`` included) holding a finished run's summary and metrics, sorted."""
    root = Path(root)
    found = {path.parent for path in root.rglob("summary.json") if (path.parent / "metrics.jsonl").is_file()}
    return sorted(found, key=lambda path: [int(p) if p.isdigit() else p for p in path.relative_to(root).parts])


def _overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    return [line[2:].strip() for line in path.read_text().splitlines() if line.startswith("- ")]


def _labels(all_overrides: list[list[str]]) -> list[str]:
    """Per run, its overrides that are not shared by every run (the swept ones), space-separated."""
    shared = set.intersection(*map(set, all_overrides)) if all_overrides else set()
    return [" ".join(o for o in overrides if o not in shared) or "(defaults)" for overrides in all_overrides]


def load_runs(root: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, metrics) for every run under ``root``.

    ``runs``: one row per run: ``run`` (label), ``path``, the summary's scalar fields (``parallelism``,
    ``world_size``, ``final_val_loss``, ``wall_time_s``, ...), ``model_state_bytes`` (per rank total),
    ``peak_memory_bytes`` (largest rank) and the mean of every logged metric (``mean_<key>``).
    ``metrics``: one row per logged record, with the run's label and every metric as a column.
    """
    run_dirs = find_run_dirs(root)
    if not run_dirs:
        raise FileNotFoundError(f"no run directories (summary.json + metrics.jsonl) under {root}")
    labels = _labels([_overrides(run_dir) for run_dir in run_dirs])
    rows, records = [], []
    for label, run_dir in zip(labels, run_dirs, strict=True):
        summary = json.loads((run_dir / "summary.json").read_text())
        row: dict[str, Any] = {"run": label, "path": str(run_dir)}
        row |= {key: value for key, value in summary.items() if not isinstance(value, (dict, list))}
        row["model_state_bytes"] = summary.get("model_state_bytes", {}).get("total")
        row["peak_memory_bytes"] = max(summary.get("peak_memory_bytes_per_rank") or [float("nan")])
        row |= {f"mean_{key}": stats["mean"] for key, stats in summary.get("metrics", {}).items()}
        rows.append(row)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            records.append({"run": label, "parallelism": summary.get("parallelism"), **json.loads(line)})
    return pd.DataFrame(rows), pd.DataFrame(records)


def load_wandb_runs(root: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, metrics) from W&B offline runs (``wandb/offline-run-*``) under ``root``, read from W&B's own files
    without its service: one row per run with its config's ``parallelism``/``world size`` where present and its
    summary; one row per history record."""
    from distrain.trackers.wandb_files import read_wandb_run

    rows, records = [], []
    for run_dir in sorted(Path(root).rglob("offline-run-*")):
        run = read_wandb_run(run_dir)
        label = run.get("name") or run.get("id", run_dir.name)
        parallelism = run["config"].get("parallelism", {})
        row = {"run": label, "path": str(run_dir), "group": run.get("group")}
        row["parallelism"] = parallelism.get("name") if isinstance(parallelism, dict) else parallelism
        row |= {key: value for key, value in run["summary"].items() if not isinstance(value, (dict, list))}
        rows.append(row)
        for record in run["history"]:
            step = record.get("step", record.get("_step"))  # W&B keeps its own step counter as _step
            records.append({"run": label, "parallelism": row["parallelism"], **record, "step": step})
    if not rows:
        raise FileNotFoundError(f"no W&B offline runs under {root}")
    return pd.DataFrame(rows), pd.DataFrame(records)
