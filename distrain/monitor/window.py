"""The logging window: this rank's per-step measurements summed over ``log_every`` steps, turned into one metrics
record for all ranks when the window closes.

Collectives: closing a window runs one ``all_gather`` of a dozen floats per rank (every rank's loss, phase times,
memory), from which every rank computes the means, the rank balance and the straggler; a world of one gathers
nothing. Nothing else is communicated for monitoring.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distrain.monitor.system import GpuUtilisation, memory_now
from distrain.monitor.timing import PHASES, Clock, comm_traffic, phase_seconds, pipeline_occupancy

log = logging.getLogger(__name__)

_FIELDS = (
    "loss",
    "grad_norm",
    *PHASES,
    "comm_busy",
    "comm_bytes",
    "comm_dense_bytes",
    "stage_busy",
    "schedule",
    "theoretical_bubble",
    "memory_allocated_bytes",
    "memory_reserved_bytes",
    "memory_peak_bytes",
    "gpu_util_percent",
)


class LogWindow:
    """Per-step sums since the last closed window on this rank; ``close`` is collective.

    Args:
        device: where the step's tensors live.
        tokens_per_step, samples_per_step: global, per optimizer step.
        flops_per_token: the model's training FLOPs per token (forward and backward).
        peak_flops: one device's peak FLOP/s; None leaves MFU out.
        straggler_threshold: the busiest rank (busy = data + compute + optimizer per step, i.e. not waiting for
            others) is named a straggler when it exceeds the median of the other ranks by more than this fraction.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        tokens_per_step: int,
        samples_per_step: int,
        flops_per_token: float,
        peak_flops: float | None,
        straggler_threshold: float,
    ) -> None:
        self.device, self.clock, self.gpu = device, Clock(device), GpuUtilisation(device)
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.straggler_threshold = straggler_threshold
        self._reset()

    def restart(self) -> None:
        """Start a fresh window now (at the start of training, so set-up time stays out of the first one)."""
        self._reset()

    def _reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.grad_norms: list[torch.Tensor] = []
        self.marks: list[dict[str, Any]] = []
        self.paused = 0.0
        self.started = self.clock.mark()

    @property
    def steps(self) -> int:
        return len(self.losses)

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor, marks: dict[str, Any]) -> None:
        """One finished step: its detached loss and grad norm (kept on device) and its phase timestamps."""
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.marks.append(marks)

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training steps (evaluation, synchronous checkpoints) out of throughput."""
        self.paused += seconds

    def close(self) -> dict[str, Any]:
        """The window's metrics record, identical on every rank but for the model's own metrics (this rank's) and
        the compression quality guard's check (rank 0 only).
        Collective: one all_gather (none in a world of one)."""
        steps = self.steps
        elapsed = self.clock.seconds(self.started, self.clock.mark()) - self.paused
        phases = {name: 0.0 for name in PHASES}
        for marks in self.marks:
            measured = phase_seconds(self.clock, marks) | comm_traffic(self.clock, marks)
            for name, value in (measured | pipeline_occupancy(self.clock, marks)).items():
                phases[name] = phases.get(name, 0.0) + value / steps
        local = {
            "loss": torch.stack(self.losses).float().mean().item(),
            "grad_norm": torch.stack(self.grad_norms).float().mean().item(),
            **phases,
            "memory_reserved_bytes": float("nan"),
            **memory_now(self.device),
            "gpu_util_percent": self.gpu.percent() if self.gpu.handle is not None else float("nan"),
        }
        row = [local[f] for f in _FIELDS] + [elapsed / steps]
        if dist.get_world_size() == 1:  # nothing to gather: a one-process job skips the collective (170 us on gloo)
            per_rank = np.array([row])
        else:  # on the training device: NCCL gathers only device tensors
            mine = torch.tensor([row], dtype=torch.float64, device=self.device)
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine)
            per_rank = torch.cat(gathered).cpu().numpy()  # [rank, field]; numpy's reductions cost less than torch's
        model_metrics = self._model_metrics() | self._comm_quality()
        self._reset()
        record = self._record(per_rank, steps, elapsed)
        return record | {name: value for name, value in model_metrics.items() if name not in record}

    def _model_metrics(self) -> dict[str, float]:
        """The model's own step metrics (``ModelSpec.metrics``, e.g. tokens per expert) and the optimizer's
        (``optimizer_bytes_sent``) and, with ft=torchft, the replica groups that took part in each step
        (``replica_groups``), averaged over the window's steps. This rank's values, not gathered: they
        describe the batches this rank saw and the collectives it ran."""
        sums: dict[str, float] = {}
        for marks in self.marks:
            own = marks.get("model_metrics", {}) | marks.get("optimizer_metrics", {}) | marks.get("replica_metrics", {})
            for name, value in own.items():
                sums[name] = sums.get(name, 0.0) + float(value)
        return {name: total / self.steps for name, total in sums.items()}

    def _comm_quality(self) -> dict[str, float]:
        """The compression quality guard's latest check in this window (rank 0 only; ``distrain.comm.quality``)."""
        checks = [marks["comm_quality"] for marks in self.marks if "comm_quality" in marks]
        return checks[-1] if checks else {}

    def _record(self, per_rank: np.ndarray, steps: int, elapsed: float) -> dict[str, Any]:
        column = {name: per_rank[:, i] for i, name in enumerate(_FIELDS)}
        step_times = per_rank[:, -1]
        tokens_per_s = self.tokens_per_step * steps / elapsed
        record: dict[str, Any] = {
            "loss": column["loss"].mean().item(),
            "grad_norm": column["grad_norm"].mean().item(),
            "step_time_s": elapsed / steps,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": self.samples_per_step * steps / elapsed,
        }
        for name in PHASES:  # mean over ranks; comm is NaN where the strategy cannot separate it
            value = column[name].mean().item()
            if not math.isnan(value):
                record[f"{name}_time_s"] = value
        record |= self._communication(column)
        record |= self._pipeline(column)
        if self.peak_flops:
            record["mfu"] = self.flops_per_token * tokens_per_s / (self.peak_flops * per_rank.shape[0])
        for name in ("memory_allocated_bytes", "memory_reserved_bytes", "memory_peak_bytes"):
            if not math.isnan(column[name].max().item()):
                record[name] = column[name].max().item()  # the rank closest to running out
        if not math.isnan(column["gpu_util_percent"].mean().item()):
            record["gpu_util_percent"] = column["gpu_util_percent"].mean().item()
        record |= self._balance(column, step_times)
        return record

    @staticmethod
    def _communication(column: dict[str, np.ndarray]) -> dict[str, Any]:
        """Gradient bytes and communication time from a DDP comm hook (nothing for strategies without hooks)."""
        if math.isnan(column["comm_bytes"].mean().item()):
            return {}
        sent, busy = column["comm_bytes"].mean().item(), column["comm_busy"].mean().item()
        record = {
            "grad_bytes_sent": sent,  # per rank per step, mean over ranks
            "grad_bytes_sent_rank_max": column["comm_bytes"].max().item(),
            "comm_busy_time_s": busy,
        }
        if sent > 0:  # one rank sends nothing: there is no ratio to report, not an infinite one
            record["grad_compression_ratio"] = column["comm_dense_bytes"].mean().item() / sent
        if busy > 0:  # the part of the collectives' time that backward covered
            record["comm_hidden_fraction"] = min(1.0, max(0.0, 1.0 - column["comm"].mean().item() / busy))
        return record

    @staticmethod
    def _pipeline(column: dict[str, np.ndarray]) -> dict[str, Any]:
        """The pipeline bubble: each rank's idle fraction of the pipeline's time (the longest rank's schedule time:
        a last stage that finishes early idles until the others do), their mean, and the ideal schedule's."""
        if math.isnan(column["schedule"].mean().item()):
            return {}
        idle = (1.0 - column["stage_busy"] / column["schedule"].max()).clip(0.0, 1.0).tolist()
        record = {f"pipeline_bubble_rank{rank}": value for rank, value in enumerate(idle)}
        record["pipeline_bubble"] = sum(idle) / len(idle)
        record["pipeline_bubble_theory"] = column["theoretical_bubble"].mean().item()
        return record

    def _balance(self, column: dict[str, np.ndarray], step_times: np.ndarray) -> dict[str, Any]:
        """Spread of step and busy time over ranks; the slowest rank is named when it is beyond the threshold."""
        busy = (column["data"] + column["compute"] + column["optimizer"]).tolist()
        slowest = max(range(len(busy)), key=busy.__getitem__)
        others = busy[:slowest] + busy[slowest + 1 :]
        median = statistics.median(others) if others else busy[slowest]
        balance: dict[str, Any] = {
            "step_time_rank_min_s": step_times.min().item(),
            "step_time_rank_max_s": step_times.max().item(),
            "busy_time_rank_min_s": min(busy),
            "busy_time_rank_max_s": max(busy),
            "busy_time_rank_mean_s": sum(busy) / len(busy),
        }
        slowdown = busy[slowest] / median - 1 if median > 0 else 0.0
        if len(busy) > 1 and slowdown > self.straggler_threshold:
            balance |= {"straggler_rank": slowest, "straggler_slowdown": slowdown}
            log.warning(
                "straggler: rank %d is busy %.3f s per step, %.0f%% more than the median of the other ranks (%.3f s)",
                slowest,
                busy[slowest],
                100 * slowdown,
                median,
            )
        return balance
