"""Whether a tensor is a DTensor, asked without importing DTensor: its import costs most of a second, and a run
that shards nothing (``parallelism=single``, ``ddp``) reaches its first step without it (DCP imports it at the
first save or load). No DTensor can exist before ``torch.distributed.tensor`` is imported, so its absence from
``sys.modules`` answers the question."""

from __future__ import annotations

import sys
from typing import Any

import torch


def is_dtensor(value: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def full_value(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over its mesh when it is sharded); a plain tensor as it is."""
    return value.full_tensor() if is_dtensor(value) else value


def local_value(value: torch.Tensor) -> torch.Tensor:
    """The part of a DTensor this rank holds (a view: writing it writes the DTensor); a plain tensor as it is."""
    return value.to_local() if is_dtensor(value) else value


def local_parts(state: Any, *, copy: bool = False) -> Any:
    """``state`` (nested dicts and lists) with every DTensor replaced by this rank's local part: what pickles and
    travels without its device mesh (a healing replica group's copy, whose rank r holds rank r's shards). ``copy``:
    each tensor cloned, so the result stays as it is while training changes the originals."""
    if isinstance(state, dict):
        return {key: local_parts(value, copy=copy) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(local_parts(value, copy=copy) for value in state)
    if not isinstance(state, torch.Tensor):
        return state
    return local_value(state).clone() if copy else local_value(state)


def as_placed(template: Any, parts: Any) -> Any:
    """``local_parts``'s inverse: ``parts`` with each tensor whose counterpart in ``template`` is a DTensor put back
    on that DTensor's mesh and placements (no communication: each rank wraps the part it received)."""
    if isinstance(template, dict) and isinstance(parts, dict):
        return {key: as_placed(template.get(key), value) for key, value in parts.items()}
    if isinstance(template, list | tuple) and isinstance(parts, list | tuple) and len(template) == len(parts):
        return type(parts)(as_placed(t, p) for t, p in zip(template, parts, strict=True))
    if is_dtensor(template) and isinstance(parts, torch.Tensor):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            parts.to(template.device),
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    return parts
