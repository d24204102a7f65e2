"""What an optimizer does, declared on its factory function (a ``capabilities`` attribute) and asked by the memory
prediction and the comm checks instead of the optimizer's name. An optimizer of the user's own declares the same
attribute; one that declares none keeps no state distrain can predict and is treated as non-adaptive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig


@dataclass(frozen=True)
class OptimizerCapabilities:
    adaptive: bool = False  # each entry normalised by its own history (Adam-type): delayed error feedback shrinks
    linear: bool = False  # without momentum its update is the gradient times the learning rate (SGD)
    moments: int = 0  # fp32 state tensors it keeps per parameter (AdamW: 2)
    momentum_buffer: bool = False  # one more while optimizer.momentum > 0 (SGD, Muon)

    def state_bytes_per_param(self, optimizer: DictConfig | dict[str, Any]) -> int:
        """fp32 optimizer-state bytes per parameter under these settings."""
        buffers = self.moments + int(self.momentum_buffer and (optimizer.get("momentum") or 0) > 0)
        return 4 * buffers


def optimizer_capabilities(optimizer: DictConfig) -> OptimizerCapabilities:
    """The capabilities the optimizer ``optimizer._target_`` names declares (the defaults when none)."""
    try:
        factory = get_object(str(optimizer.get("_target_")))
    except Exception:  # noqa: BLE001 - an unimportable target is refused by validation, with its own line
        return OptimizerCapabilities()
    found = getattr(factory, "capabilities", None)
    return found if isinstance(found, OptimizerCapabilities) else OptimizerCapabilities()
