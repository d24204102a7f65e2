"""Phase timestamps of an optimizer step, cheap enough to take every step.

On CPU a timestamp is ``time.perf_counter()``. On a GPU it is a CUDA event recorded on the current stream, and
durations are read only when a logging window closes (``Clock.seconds`` synchronises on the window's last event),
so timing adds no host-device synchronisation to the steps themselves.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

PHASES = ("data", "compute", "comm", "optimizer")


class Clock:
    """Timestamps in the time base of ``device``'s work."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return end - start


def phase_seconds(clock: Clock, marks: dict[str, Any]) -> dict[str, float]:
    """Split one step into data wait, forward+backward compute, exposed communication and optimizer.

    ``marks``: ``step_start``, ``data_ready`` (batches in hand), ``backward_done`` (gradients synchronised),
    ``optimizer_done``; and ``comm_launch`` when a DDP communication hook saw the step's last bucket launched;
    ``comm_after_backward``: (start, end) intervals of communication run after backward (none overlapped).
    Autograd has no work left once the last bucket is launched, so the time from there to the end of backward is
    communication that backward did not hide. Strategies without hooks (fsdp, zero) have no ``comm_launch``:
    their communication is inside ``compute`` and ``comm`` is reported as NaN.
    """
    forward_backward = clock.seconds(marks["data_ready"], marks["backward_done"])
    comm = clock.seconds(marks["comm_launch"], marks["backward_done"]) if "comm_launch" in marks else float("nan")
    # An exchange after the optimizer step (comm=topk's update feedback) is exposed by definition: it is counted
    # as communication, not as optimizer time.
    after = sum(clock.seconds(start, end) for start, end in marks.get("comm_after_backward", ()))
    return {
        "data": clock.seconds(marks["step_start"], marks["data_ready"]),
        "compute": forward_backward - (0.0 if math.isnan(comm) else comm),
        "comm": comm + after if after else comm,
        "optimizer": clock.seconds(marks["backward_done"], marks["optimizer_done"]) - after,
    }


def comm_traffic(clock: Clock, marks: dict[str, Any]) -> dict[str, float]:
    """One step's gradient communication as a DDP comm hook reported it (NaN for strategies without hooks).

    ``comm_busy``: seconds during which at least one bucket's collective was in flight (union of the buckets'
    launch-to-done intervals), hidden behind backward or not; ``comm_bytes``: bytes this rank sent;
    ``comm_dense_bytes``: what a dense fp32 ring all-reduce of the same buckets would have sent.
    """
    if "comm_intervals" not in marks:
        return {"comm_busy": math.nan, "comm_bytes": math.nan, "comm_dense_bytes": math.nan}
    intervals = sorted(
        (clock.seconds(marks["data_ready"], start), clock.seconds(marks["data_ready"], end))
        for start, end in marks["comm_intervals"]
    )
    busy, covered_until = 0.0, -math.inf
    for start, end in intervals:
        start = max(start, covered_until)
        if end > start:
            busy += end - start
            covered_until = end
    return {"comm_busy": busy, "comm_bytes": marks["comm_bytes"], "comm_dense_bytes": marks["comm_dense_bytes"]}


def pipeline_occupancy(clock: Clock, marks: dict[str, Any]) -> dict[str, float]:
    """One step of a pipeline schedule on this rank (NaN for other strategies).

    ``stage_busy``: seconds this rank's stages spent in forward and backward chunks; ``schedule``: seconds the
    schedule ran; ``theoretical_bubble``: the schedule's ideal idle fraction. Busy over schedule time is the
    stage's occupancy; the rest is its bubble (waiting for neighbours, and the send/recv themselves).
    """
    if "stage_intervals" not in marks:
        return {"stage_busy": math.nan, "schedule": math.nan, "theoretical_bubble": math.nan}
    return {
        "stage_busy": sum(clock.seconds(start, end) for start, end in marks["stage_intervals"]),
        "schedule": clock.seconds(*marks["schedule_span"]),
        "theoretical_bubble": marks["theoretical_bubble"],
    }
