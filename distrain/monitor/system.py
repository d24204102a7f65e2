"""Memory and device utilisation of this rank."""

from __future__ import annotations

import os
import resource
from typing import Any

import torch

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA's peak allocation on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_now(device: torch.device) -> dict[str, float]:
    """Current memory: CUDA allocated and reserved on a GPU (and peak), the process's RSS on CPU (and peak)."""
    if device.type == "cuda":
        return {
            "memory_allocated_bytes": float(torch.cuda.memory_allocated(device)),
            "memory_reserved_bytes": float(torch.cuda.memory_reserved(device)),
            "memory_peak_bytes": float(torch.cuda.max_memory_allocated(device)),
        }
    rss = resident_bytes()
    return {"memory_allocated_bytes": float(rss), "memory_peak_bytes": float(max(rss, peak_memory_bytes(device)))}


def resident_bytes() -> int:
    """This process's resident set size: one read of ``/proc/self/statm`` on Linux (12 us, where psutil takes 40 us
    and the window reads it at every close), psutil elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


class GpuUtilisation:
    """NVML's utilisation of this rank's GPU, when a GPU and the NVML bindings (nvidia-ml-py) are present."""

    def __init__(self, device: torch.device) -> None:
        self.handle: Any = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:  # noqa: BLE001 - no NVML library or driver: utilisation is simply not reported
            self.handle = None

    def percent(self) -> float | None:
        if self.handle is None:
            return None
        return float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
