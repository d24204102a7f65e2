"""``parallelism=single``: one process, the model as it is."""

from __future__ import annotations

from typing import Any

from distrain.parallelism.base import LocalBackwardStrategy
from distrain.parallelism.capabilities import Capabilities
from distrain.parallelism.layout import Layout


class SingleProcessStrategy(LocalBackwardStrategy):
    """No communication of gradients; world size must be 1."""

    capabilities = Capabilities(one_rank=True, memory_formula="single")

    @staticmethod
    def resolve_layout(parallelism: Any, world_size: int, ranks_per_node: int | None = None, **_: Any) -> Layout:
        """One rank holding the whole model."""
        return Layout()

    def __init__(self, *, name: str = "single") -> None:
        self.name = name
