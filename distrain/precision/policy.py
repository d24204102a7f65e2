"""Precision policy shared by all strategies: what autocast runs in and whether gradients are loss-scaled."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PrecisionPolicy:
    """Weights and optimizer state stay fp32; forward and backward run under autocast in ``compute_dtype``.

    Args:
        name: the option's name (fp32, bf16, fp16), reported in the run summary.
        compute_dtype: ``float32`` (autocast off), ``bfloat16`` or ``float16``.
        grad_scaler: use a dynamic loss scaler (needed for fp16, whose range underflows small gradients).
    """

    def __init__(self, *, name: str, compute_dtype: str, grad_scaler: bool) -> None:
        self.name = name
        self.compute_dtype = DTYPES[compute_dtype]
        self.use_grad_scaler = grad_scaler

    @property
    def uses_autocast(self) -> bool:
        return self.compute_dtype != torch.float32

    @contextlib.contextmanager
    def autocast(self, device: torch.device) -> Iterator[None]:
        with torch.autocast(device_type=device.type, dtype=self.compute_dtype, enabled=self.uses_autocast):
            yield

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """A GradScaler for ``device``; a disabled one (all its methods pass through) when not loss scaling."""
        return torch.amp.GradScaler(device.type, enabled=self.use_grad_scaler)


def autocast_supported(device_type: str, compute_dtype: str) -> tuple[bool, str]:
    """Whether autocast in ``compute_dtype`` works on ``device_type`` here, checked by running a matmul under it."""
    if compute_dtype == "float32":
        return True, ""
    if device_type == "cuda" and compute_dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        return False, "this GPU has no bfloat16 support"
    try:
        with torch.autocast(device_type=device_type, dtype=DTYPES[compute_dtype]):
            out = torch.ones(2, 2, device=device_type) @ torch.ones(2, 2, device=device_type)
        if out.dtype != DTYPES[compute_dtype]:
            return False, f"autocast on {device_type} does not compute in {compute_dtype}"
    except (RuntimeError, AssertionError) as err:
        return False, str(err).splitlines()[0]
    return True, ""
