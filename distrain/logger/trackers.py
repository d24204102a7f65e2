"""Experiment trackers, chosen by the ``logger`` config group (one or several: ``logger=[wandb,mlflow]``, each
configured under ``logger.<name>``). Only rank 0 calls them; every one receives the same records."""

from __future__ import annotations

import importlib.util
import json
import logging
import netrc
import os
import uuid
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class TrackerSetupError(ValueError):
    """A tracker that cannot start as configured: ``key`` (relative to ``logger.<name>``; empty for the tracker
    itself), its value, and what is allowed. Validation reports it as ``logger.<name>.<key>`` before ranks start."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r}: {allowed}")


class Tracker(Protocol):
    def check(self) -> None:
        """Raise ``TrackerSetupError`` for what would stop ``start`` (a missing package, an unusable URI); runs in
        the launching process before any rank starts, so it must not create runs or files."""

    def start(
        self,
        *,
        run_dir: str,
        run_name: str,
        run_group: str | None,
        config: dict[str, Any],
        resumed_from: str | None,
        initial_step: int,
    ) -> None:
        """``resumed_from``: the checkpoint this job resumed from at ``initial_step`` (a tracker may continue that
        run, and drop what it logged after that step)."""

    def log(self, record: dict[str, Any]) -> None:
        """One logged step: ``record["step"]`` and the metrics, under the names metrics.jsonl uses."""

    def finish(self, summary: dict[str, Any]) -> None: ...


def numeric_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite-or-not numbers except ``step`` (strings, lists and None are not scalars)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


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
        if not str(self.path) or self.path.is_dir():
            raise TrackerSetupError("path", str(self.path), "a file path (not a directory)")

    def start(self, *, run_dir: str, run_name: str, **run: Any) -> None:
        self.run_name = run_name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write({"event": "start", "run_dir": run_dir})

    def log(self, record: dict[str, Any]) -> None:
        self._write({"event": "metrics", **record})

    def finish(self, summary: dict[str, Any]) -> None:
        self._write({"event": "summary", **summary})

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"run": self.run_name, **record}) + "\n")


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

    @staticmethod
    def run_id(run_dir: Path, resumed_from: str | None) -> str:
        """This run directory's id, else the id of the run that wrote the checkpoint we resume, else a new one."""
        candidates = [run_dir / WANDB_ID_FILE]
        if resumed_from:
            candidates.append(Path(resumed_from).resolve().parents[1] / WANDB_ID_FILE)
        for candidate in candidates:
            if candidate.is_file():
                return candidate.read_text().strip()
        return uuid.uuid4().hex[:12]

    def start(
        self,
        *,
        run_dir: str,
        run_name: str,
        run_group: str | None,
        config: dict[str, Any],
        resumed_from: str | None,
        initial_step: int,
    ) -> None:
        import wandb

        directory = Path(run_dir)
        run_id = self.run_id(directory, resumed_from)
        (directory / WANDB_ID_FILE).write_text(run_id + "\n")
        mode = self.resolved_mode()
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            group=self.group or run_group,
            tags=list(self.tags),
            name=self.name or run_name,
            config=config,
            id=run_id,
            resume="allow",
            dir=str(directory),
            mode=mode,
            settings=wandb.Settings(silent=True, console="off"),
        )
        log.info("W&B run %s (%s) in %s", run_id, mode, directory / "wandb")

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if not isinstance(v, (list, dict))})
        self.run.finish()
