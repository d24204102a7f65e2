"""``parallelism=single``: one process, the model as it is."""

from __future__ import annotations

from distrain.parallelism.base import LocalBackwardStrategy
from distrain.parallelism.capabilities import Capabilities


class SingleProcessStrategy(LocalBackwardStrategy):
    """No communication of gradients; world size must be 1."""

    capabilities = Capabilities(one_rank=True, memory_formula="single")

    def __init__(self, *, name: str = "single") -> None:
        self.name = name
