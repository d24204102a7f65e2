"""This rank's fixed validation batches: one set per source of a mixture (``data=mix``), one otherwise."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distrain.data.sampler import Batch, token_windows, validation_batches


@dataclass(frozen=True)
class ValidationSets:
    """Batches by source name ("" for a single dataset) and the weights ``val_loss`` averages the sources' losses
    with (the mixture's: the loss of the distribution the run trains on)."""

    batches: dict[str, list[Batch]]
    weights: dict[str, float]

    @classmethod
    def single(cls, batches: list[Batch]) -> ValidationSets:
        return cls({"": batches}, {"": 1.0})

    def transformed(self, transform: Callable[[Batch], Batch]) -> ValidationSets:
        """The same sets with ``transform`` applied to every batch (document masking)."""
        batches = {name: [transform(batch) for batch in sets] for name, sets in self.batches.items()}
        return ValidationSets(batches, self.weights)

    def scores(self, losses: list[float]) -> dict[str, float]:
        """``val_loss`` from each set's loss (in ``batches``' order), and ``val/<name>/loss`` for a mixture's."""
        by_name = dict(zip(self.batches, losses, strict=True))
        scores = {"val_loss": sum(self.weights[name] * loss for name, loss in by_name.items())}
        return scores | {f"val/{name}/loss": loss for name, loss in by_name.items() if name}


def validation_sets(split: Any, seq_len: int, **settings: Any) -> ValidationSets:
    """The validation batches of ``split`` (``validation_batches``'s ``settings``), one set per mixture source."""
    windows = token_windows(split, seq_len)
    names = getattr(windows, "names", None)
    if names is None:
        return ValidationSets.single(validation_batches(windows, **settings))
    return ValidationSets(
        {name: validation_batches(windows.source(name), **settings) for name in names}, dict(split.weights)
    )
