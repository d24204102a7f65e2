"""Graceful stop on SIGTERM / SIGUSR1 / SIGUSR2 (SLURM sends one before a time limit or preemption) and SIGINT
(Ctrl-C in a terminal reaches every process of the run; the launcher forwards it too).

The handler only records the signal; at the next step boundary all ranks agree (``distrain.trainer.agreement``: a signal
seen by any rank stops every rank at the same step), save a checkpoint and return. The job then exits with
``REQUEUE_EXIT_CODE`` so a scheduler or wrapper can requeue it with ``checkpoint.resume=auto``.
"""

from __future__ import annotations

import signal
from types import FrameType

# SIGUSR2 is what submitit asks SLURM to send before a time limit (hydra.launcher.signal_delay_s).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
REQUEUE_EXIT_CODE = 143  # 128 + SIGTERM: "terminated", the conventional status for a job stopped to be requeued


class StopRequest:
    """Records SIGTERM/SIGUSR1/SIGUSR2/SIGINT while installed (main thread only); ``install``/``uninstall`` around
    training."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.signal_name = signal.Signals(signum).name

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
