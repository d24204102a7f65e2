"""Model FLOPs utilisation: the model's training FLOPs per token over the devices' peak.

Peak FLOP/s per device: ``monitor.peak_flops`` if set; on a GPU, the datasheet's dense peak for the compute dtype
from ``GPU_PEAK_FLOPS`` (matched by device name); on CPU, the fp32 matmul throughput measured on this rank's
threads at start-up, so CPU MFU says how close the step comes to the best matmul this rank can do.
"""

from __future__ import annotations

import time

import torch

# Dense (no sparsity) peak FLOP/s from vendor datasheets: (bf16/fp16 tensor cores, fp32 without TF32).
GPU_PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 67e12),
    "H100 SXM": (989e12, 67e12),
    "H100 PCIe": (756e12, 51e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "A10G": (125e12, 31.2e12),
    "L40S": (362e12, 91.6e12),
    "L4": (121e12, 30.3e12),
    "V100": (125e12, 15.7e12),
    "T4": (65e12, 8.1e12),
}


def gpu_peak_flops(device_name: str, low_precision: bool) -> float | None:
    """The table's peak for the first name that occurs in ``device_name`` (longest names tried first)."""
    for name in sorted(GPU_PEAK_FLOPS, key=len, reverse=True):
        if name in device_name:
            return GPU_PEAK_FLOPS[name][0 if low_precision else 1]
    return None


def measured_cpu_flops(size: int = 512, bursts: int = 6, seconds: float = 0.05) -> float:
    """fp32 matmul FLOP/s on this process's intra-op threads: the best of ``bursts`` short bursts, so a moment of
    contention from another process while measuring does not lower the peak (and inflate MFU)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = 0.0
    for _ in range(bursts):
        count, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            torch.mm(a, b)
            count += 1
        best = max(best, 2 * size**3 * count / elapsed)
    return best


def peak_flops_per_device(device: torch.device, compute_dtype: torch.dtype, configured: float | None) -> float | None:
    """Peak FLOP/s of one device for MFU, or None when unknown (MFU is then not reported)."""
    if configured:
        return configured
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), compute_dtype != torch.float32)
    return measured_cpu_flops()
