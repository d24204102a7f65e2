"""Model FLOPs utilisation: the model's training FLOPs per token over the devices' peak.

Peak FLOP/s per device: ``monitor.peak_flops`` if set; on a GPU, the datasheet's dense peak for the compute dtype
from ``GPU_PEAK_FLOPS`` (matched by device name). On CPU the peak is unknown and MFU is left out unless
``monitor.peak_flops`` is set: a matmul rate measured at start-up depended on what else the machine was doing at
that moment (other ranks still starting), and MFU read up to 444% from it.
"""

from __future__ import annotations

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


def peak_flops_per_device(device: torch.device, compute_dtype: torch.dtype, configured: float | None) -> float | None:
    """Peak FLOP/s of one device for MFU, or None when unknown (MFU is then not reported)."""
    if configured:
        return configured
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), compute_dtype != torch.float32)
    return None
