"""Learning-rate schedules as multiplicative factors on each group's base learning rate."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_decay_factor(step: int, *, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float) -> float:
    """Factor for optimizer step ``step`` (0-based): linear warm-up to 1, then decay to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def warmup_decay_schedule(
    optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int, decay: str, min_lr_ratio: float
) -> LambdaLR:
    """A LambdaLR stepping once per optimizer step; its state (last step) goes into checkpoints."""

    def factor(step: int) -> float:
        return warmup_decay_factor(
            step, warmup_steps=warmup_steps, total_steps=total_steps, decay=decay, min_lr_ratio=min_lr_ratio
        )

    return LambdaLR(optimizer, factor)
