"""Whether a tensor is a DTensor, asked without importing DTensor: its import costs most of a second, and a run
that shards nothing (``parallelism=single``, ``ddp``) reaches its first step without it (DCP imports it at the
first save or load). No DTensor can exist before ``torch.distributed.tensor`` is imported, so its absence from
``sys.modules`` answers the question."""

from __future__ import annotations

import sys

import torch


def is_dtensor(value: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def full_value(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over its mesh when it is sharded); a plain tensor as it is."""
    return value.full_tensor() if is_dtensor(value) else value
