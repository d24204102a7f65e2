"""Experiment trackers, chosen by the ``logger`` config group. Only rank 0 calls them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    def start(self, *, run_dir: str, run_name: str, config: dict[str, Any]) -> None: ...

    def log(self, record: dict[str, Any]) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...


class NullTracker:
    """Nothing beyond the run directory."""

    def start(self, *, run_dir: str, run_name: str, config: dict[str, Any]) -> None:
        pass

    def log(self, record: dict[str, Any]) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


class JsonlTracker:
    """Appends each record, tagged with ``run``, to one JSON-lines file that many runs can share."""

    def __init__(self, *, path: str) -> None:
        self.path = Path(path)

    def start(self, *, run_dir: str, run_name: str, config: dict[str, Any]) -> None:
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
