"""Models built on the meta device (shapes, no storage) for what is asked about a model before any rank starts:
validation, memory plans, exports.

Built as is, every random initialisation of a meta tensor runs through torch's Python decompositions, whose first
use imports ``torch._dynamo``: 1.4 s of every run's start-up on a 2-core machine, for values a meta tensor does not
hold. :func:`meta_device` skips those fills.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# In-place random fills: the tensor methods and the torch.nn.init functions named like them. An initialiser that
# reaches them through its own torch-function dispatch (kaiming_uniform_, nn.Linear's) runs them below this mode;
# uniform_ has a meta kernel and needs no decomposition, so that costs nothing.
_RANDOM_FILLS = frozenset(
    {"normal_", "uniform_", "random_", "exponential_", "bernoulli_", "cauchy_", "log_normal_", "geometric_"}
)


class _SkipRandomFillsOfMeta(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _RANDOM_FILLS:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextmanager
def meta_device() -> Iterator[None]:
    """``torch.device("meta")`` without the random fills of meta tensors (see the module docstring)."""
    with torch.device("meta"), _SkipRandomFillsOfMeta():
        yield
