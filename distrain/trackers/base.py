"""Experiment trackers, chosen by the ``logger`` config group (one or several: ``logger=[wandb,mlflow]``, each
configured under ``logger.<name>``). Only rank 0 calls them; every one receives the same records."""

from __future__ import annotations

import importlib.util
import json
import logging
import netrc
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from distrain.artifacts.outputs import check_writable
from distrain.errors import ArtifactError

log = logging.getLogger(__name__)


class TrackerSetupError(ValueError):
    """A tracker that cannot start as configured: ``key`` (relative to ``logger.<name>``; empty for the tracker
    itself), its value, and what is allowed. Validation reports it as ``logger.<name>.<key>`` before ranks start."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r}: {allowed}")


@dataclass(frozen=True)
class TrackedRun:
    """What every tracker starts from: the run directory, names, the resolved config, and where the job resumed
    (``resumed_from``, the checkpoint, at ``initial_step``; None and 0 for a fresh run)."""

    run_dir: Path
    name: str
    group: str | None
    config: dict[str, Any]
    resumed_from: str | None = None
    initial_step: int = 0

    def recorded_id(self, id_file: str) -> str | None:
        """The tracker run id kept in this run directory's ``id_file``, else in that of the run whose checkpoint
        this job resumed (``<its run dir>/checkpoints/step_N``), else None."""
        candidates = [self.run_dir / id_file]
        if self.resumed_from:
            candidates.append(Path(self.resumed_from).resolve().parents[1] / id_file)
        for candidate in candidates:
            if candidate.is_file():
                return candidate.read_text().strip()
        return None


class Tracker(Protocol):
    """What every tracker implements. One may also define ``absolute_paths() -> dict[str, str]``: its settings
    that name local files or stores, made absolute from the launching process's directory, which the launch writes
    into the run's config (a requeued job started elsewhere, or a tool reading the saved config, finds them)."""

    def check(self) -> None:
        """Raise ``TrackerSetupError`` for what would stop ``start`` (a missing package, an unusable URI); runs in
        the launching process before any rank starts, so it must not create runs or files."""

    def start(self, run: TrackedRun) -> None:
        """Open (or continue) this job's run; a tracker may drop what an earlier attempt logged after
        ``run.initial_step``."""

    def log(self, record: dict[str, Any]) -> None:
        """One logged step: ``record["step"]`` and the metrics, under the names metrics.jsonl uses."""

    def finish(self, summary: dict[str, Any]) -> None:
        """The run ended (completed, or stopped by a signal after checkpointing): store the summary, close."""

    def fail(self) -> None:
        """The run failed: mark it so and close, raising nothing (the job is already failing)."""


def numeric_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite-or-not numbers except ``step`` (strings, lists and None are not scalars)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def absolute_path(path: str) -> str:
    """``path`` (``~`` expanded) made absolute from this process's directory; an absolute path as it is."""
    expanded = Path(path).expanduser()
    return str(expanded if expanded.is_absolute() else expanded.resolve())


def require_package(module: str, tracker: str) -> None:
    """TrackerSetupError unless ``module`` is importable (found without importing it)."""
    if importlib.util.find_spec(module) is None:
        raise TrackerSetupError(
            "", tracker, f"this tracker needs the {module} package: pip install 'distrain[trackers]'"
        )


class JsonlTracker:
    """Appends each record, tagged with ``run``, to one JSON-lines file that many runs can share."""

    def __init__(self, *, path: str) -> None:
        self.path = Path(path)

    def check(self) -> None:
        if not str(self.path) or str(self.path) == ".":
            raise TrackerSetupError("path", str(self.path), "a file path")
        try:
            check_writable(self.path, directory=False)
            if self.path.is_file() and not _json_lines(self.path):
                raise ArtifactError(
                    str(self.path), "holds lines that are not JSON records: not a runs file to append to"
                )
        except ArtifactError as err:
            raise TrackerSetupError("path", str(self.path), f"a writable file path ({err})") from None

    def absolute_paths(self) -> dict[str, str]:
        return {"path": absolute_path(str(self.path))} if str(self.path) not in ("", ".") else {}

    def start(self, run: TrackedRun) -> None:
        self.run_name = run.name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write({"event": "start", "run_dir": str(run.run_dir), "initial_step": run.initial_step})

    def log(self, record: dict[str, Any]) -> None:
        self._write({"event": "metrics", **record})

    def finish(self, summary: dict[str, Any]) -> None:
        self._write({"event": "summary", **summary})

    def fail(self) -> None:
        self._write({"event": "failed"})

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"run": self.run_name, **record}) + "\n")


def _json_lines(path: Path) -> bool:
    """Whether the first line of the file at ``path`` is a JSON object (or the file is empty)."""
    with open(path, "rb") as file:
        first = file.readline(1 << 20).strip()
    try:
        return not first or isinstance(json.loads(first), dict)
    except ValueError:
        return False


WANDB_ID_FILE = "wandb_run_id"


def wandb_credentials_present() -> bool:
    """An API key in the environment or in ~/.netrc for the W&B host (no network access)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    """One W&B run per training job, written by rank 0 into ``<run dir>/wandb``.

    The run id is kept in ``<run dir>/wandb_run_id``: a job restarted or requeued in the same run directory, or
    resumed from a checkpoint in another run's directory, continues that run (``resume="allow"``). ``mode=auto``
    is online when credentials exist and offline otherwise (``WANDB_MODE`` in the environment wins), so a run
    never prompts for a login. The whole resolved config is the run's config; metrics use the optimizer step.
    """

    def __init__(
        self,
        *,
        project: str,
        entity: str | None,
        group: str | None,
        tags: list[str],
        name: str | None,
        mode: str,
    ) -> None:
        self.project, self.entity, self.group, self.tags, self.name, self.mode = (
            project,
            entity,
            group,
            tags,
            name,
            mode,
        )
        self.run: Any = None

    def check(self) -> None:
        require_package("wandb", "wandb")

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        return os.environ.get("WANDB_MODE") or ("online" if wandb_credentials_present() else "offline")

    def start(self, run: TrackedRun) -> None:
        import wandb

        run_id = run.recorded_id(WANDB_ID_FILE) or uuid.uuid4().hex[:12]
        (run.run_dir / WANDB_ID_FILE).write_text(run_id + "\n")
        mode = self.resolved_mode()
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            group=self.group or run.group,
            tags=list(self.tags),
            name=self.name or run.name,
            config=run.config,
            id=run_id,
            resume="allow",
            dir=str(run.run_dir),
            mode=mode,
            settings=wandb.Settings(silent=True, console="off"),
        )
        log.info("W&B run %s (%s) in %s", run_id, mode, run.run_dir / "wandb")

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if not isinstance(v, (list, dict))})
        self.run.finish()

    def fail(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
