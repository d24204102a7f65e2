"""Seeding every random number generator a rank uses."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and all CUDA devices). Same seed on every rank: identical initial weights."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
