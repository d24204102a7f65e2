"""Inspector of a run directory (``hydra.run.dir``) that already exists: the files distrain writes there must be
distrain's when they exist, because a run replaces ``summary.json`` and ``param_groups.json``, rewinds
``metrics.jsonl`` on resume and reuses ``wandb_run_id`` and ``mlflow_run_id``.

A run directory holding them is an earlier run of this job (a restart, a requeue, ``checkpoint.resume=auto``)
and is used as it is; one holding a file of the same name that distrain did not write (a user's own
``summary.json``, a ``metrics.jsonl`` of other records) is refused, naming the file. Reads only those few files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from distrain.errors import ArtifactError

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PARAM_GROUPS = "param_groups.json"
WANDB_ID = "wandb_run_id"
MLFLOW_ID = "mlflow_run_id"
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}\s*")


def inspect_run_directory(run_dir: str | Path) -> Path:
    """``run_dir`` (resolved), after checking that every file in it that a run writes was written by distrain;
    ``ArtifactError`` naming the first one that was not."""
    run_dir = Path(run_dir).absolute()
    checks = {SUMMARY: _is_summary, PARAM_GROUPS: _is_param_groups, METRICS: _is_metrics}
    checks |= {WANDB_ID: _is_run_id, MLFLOW_ID: _is_run_id}
    for name, ours in checks.items():
        path = run_dir / name
        if not path.exists():
            continue
        if not path.is_file():
            raise ArtifactError(str(path), "is not a file; distrain writes its run's file of this name here")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ArtifactError(str(path), f"cannot be read as distrain's {name} ({err})") from None
        if not ours(text):
            raise ArtifactError(
                str(path),
                f"is not a distrain run's {name}; a run would replace it (move it, or choose another hydra.run.dir)",
            )
    return run_dir


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _is_summary(text: str) -> bool:
    summary = _json(text)
    return isinstance(summary, dict) and {"steps", "world_size"} <= summary.keys()


def _is_param_groups(text: str) -> bool:
    groups = _json(text)
    return isinstance(groups, list) and all(isinstance(g, dict) and {"group", "names"} <= g.keys() for g in groups)


def _is_metrics(text: str) -> bool:
    """One JSON record with an integer ``step`` per line; the last line may be one a crash cut short (a record's
    start: every record distrain writes begins with its step)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and not text.endswith("\n"):
        cut, lines = lines[-1], lines[:-1]
        if not cut.startswith('{"step": '):
            return False
    return all(is_metrics_record(line) for line in lines)


def is_metrics_record(line: str) -> bool:
    """Whether ``line`` is one whole record of distrain's metrics.jsonl."""
    record = _json(line)
    return isinstance(record, dict) and isinstance(record.get("step"), int)


def _is_run_id(text: str) -> bool:
    return _RUN_ID.fullmatch(text) is not None
