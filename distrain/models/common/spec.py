"""What the Llama family's specs share: the decoder shell's module names and the switch to context parallelism."""

from __future__ import annotations

from typing import Any

from torch import nn

# ``ModelSpec`` fields for ``distrain.models.common.decoder.Decoder``'s children (the same in every family member).
DECODER_MODULES: dict[str, Any] = {
    "blocks": "layers",
    "before_blocks": ("tok_embeddings",),
    "after_blocks": ("norm", "output"),
    "width": "d_model",
}


def enable_context_parallel(model: nn.Module, context: Any) -> None:
    """Make every attention module of ``model`` (or of a pipeline stage) attend with ``context``, a
    ``distrain.parallelism.context.ContextParallel``: the model then takes this rank's load-balanced share of each
    sequence. Attention modules are found by what they hold (``context`` and ``n_rep``), so the mixture of experts'
    blocks, which hold the same attention, are found too."""
    for module in model.modules():
        if hasattr(module, "context") and hasattr(module, "n_rep"):
            module.context = context
