"""Learning-rate schedules as multiplicative factors on each group's base learning rate (``lr * lr_multiplier``).

Every schedule warms up linearly, then: ``cosine`` or ``linear`` decay over the remaining steps, ``constant``, or
``wsd`` (warm-up, stable, decay): constant until the last ``decay_fraction`` of ``total_steps``, then a decay of shape
``linear``, ``cosine`` or ``1-sqrt``. The factor depends only on the step and the configured total, so a run resumed
during WSD's constant phase with a larger ``trainer.max_steps`` continues exactly as a run planned that long.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, TypedDict

import torch
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from typing import Unpack


def decay_steps(total_steps: int, decay_fraction: float) -> int:
    """The number of final steps WSD spends decaying (at least 1)."""
    return max(1, round(decay_fraction * total_steps))


def remaining(shape: str, progress: float) -> float:
    """How much of the way from 1 down to the floor is left at ``progress`` in [0, 1] of a decay of ``shape``."""
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress


def warmup_decay_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay: str,
    min_lr_ratio: float,
    decay_fraction: float = 0.2,
    decay_shape: str = "linear",
) -> float:
    """Factor for optimizer step ``step`` (0-based): linear warm-up to 1, then the decay towards ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    if decay == "wsd":
        length = decay_steps(total_steps, decay_fraction)
        start = total_steps - length
        if step < start:
            return 1.0
        progress, shape = min(1.0, (step - start) / length), decay_shape
    else:
        progress, shape = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)), decay
    return min_lr_ratio + (1.0 - min_lr_ratio) * remaining(shape, progress)


class ScheduleShape(TypedDict, total=False):
    """``warmup_decay_factor``'s keywords, as the ``scheduler`` config gives them (total_steps from the trainer)."""

    total_steps: int
    warmup_steps: int
    decay: str
    min_lr_ratio: float
    decay_fraction: float
    decay_shape: str


def warmup_decay_schedule(optimizer: torch.optim.Optimizer, **shape: Unpack[ScheduleShape]) -> LambdaLR:
    """A LambdaLR stepping once per optimizer step, its factor ``warmup_decay_factor(step, **shape)``; its state
    (the last step and each group's base learning rate) goes into checkpoints, the schedule's shape does not (it
    is rebuilt from the config on resume)."""
    # str(): the config's enum members become the plain names the factor compares
    plain = {key: str(value) if key in ("decay", "decay_shape") else value for key, value in shape.items()}
    return LambdaLR(optimizer, partial(warmup_decay_factor, **plain))
