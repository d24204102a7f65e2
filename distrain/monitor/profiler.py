"""``profile=true``: a torch.profiler trace of a window of optimizer steps, one Chrome trace file per rank in
``<run dir>/profile/`` (open in chrome://tracing or https://ui.perfetto.dev)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

log = logging.getLogger(__name__)


class StepProfiler:
    """Records steps ``start_step`` .. ``start_step + num_steps - 1``; does nothing when disabled."""

    def __init__(self, *, enabled: bool, run_dir: str, rank: int, start_step: int, num_steps: int) -> None:
        self.profile = None
        if not enabled:
            return
        self.path = Path(run_dir) / "profile" / f"trace_rank{rank}.json"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profile = profile(
            activities=activities,
            # skip the steps before start_step; one warm-up step whose events are discarded, then record
            schedule=schedule(wait=max(0, start_step - 2), warmup=1 if start_step > 1 else 0, active=num_steps),
            on_trace_ready=self._export,
            record_shapes=True,
        )

    def _export(self, prof: profile) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        log.info("profiler trace written to %s", self.path)

    def __enter__(self) -> StepProfiler:
        if self.profile is not None:
            self.profile.__enter__()
        return self

    def step(self) -> None:
        if self.profile is not None:
            self.profile.step()

    def __exit__(self, *exc: object) -> None:
        if self.profile is not None:
            self.profile.__exit__(*exc)
