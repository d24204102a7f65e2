"""TensorBoard: event files written by rank 0, one scalar per metric under the name metrics.jsonl uses."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml

from distrain.artifacts.outputs import check_writable
from distrain.errors import ArtifactError
from distrain.trackers.base import TrackedRun, TrackerSetupError, absolute_path, numeric_metrics, require_package

log = logging.getLogger(__name__)


class TensorBoardTracker:
    """Scalars for every logged step into ``<run dir>/tensorboard`` (or ``<dir>/<run name>``), the resolved config
    and the final summary as text. A job resumed at step N purges what an earlier attempt wrote after step N, so
    TensorBoard shows one curve per run, as metrics.jsonl does."""

    def __init__(self, *, dir: str | None) -> None:  # noqa: A002 - the config key users write
        self.dir = dir
        self.writer: Any = None

    def check(self) -> None:
        require_package("tensorboard", "tensorboard")
        if self.dir:
            try:
                check_writable(self.dir, directory=True)
            except ArtifactError as err:
                raise TrackerSetupError("dir", self.dir, f"a writable directory for event files ({err})") from None

    def absolute_paths(self) -> dict[str, str]:
        return {"dir": absolute_path(self.dir)} if self.dir else {}

    def start(self, run: TrackedRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        directory = Path(self.dir) / run.name if self.dir else run.run_dir / "tensorboard"
        self.writer = SummaryWriter(str(directory), purge_step=run.initial_step + 1 if run.initial_step else None)
        self.writer.add_text("config", _code_block(yaml.safe_dump(run.config, sort_keys=False)), run.initial_step)
        log.info("TensorBoard event files in %s", directory)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in numeric_metrics(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()  # so a run watched live, or one that dies, shows every logged step

    def finish(self, summary: dict[str, Any]) -> None:
        shown = {key: value for key, value in summary.items() if not isinstance(value, (list, dict))}
        self.writer.add_text("summary", _code_block(json.dumps(shown, indent=2)), summary.get("steps", 0))
        self.writer.close()

    def fail(self) -> None:
        if self.writer is not None:
            self.writer.close()  # flushes what was logged; the curve simply ends where the run failed


def _code_block(text: str) -> str:
    """TensorBoard renders text as Markdown: indent it four spaces to keep its layout."""
    return "\n".join("    " + line for line in text.splitlines())
