"""What the decoder families' specs share: the decoder shell's module names, the switch to context parallelism, and
the refusals of a head tied to the embedding (``model.tie_embeddings``: Llama, MoE and GPT)."""

from __future__ import annotations

from typing import Any

from torch import nn

from distrain.models.spec import ConfigProblem

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


def tied_head_problem(model: nn.Module, split_head: bool) -> ConfigProblem | None:
    """A head tied to the embedding cannot be split over the vocabulary while the embedding stays whole."""
    if split_head and model.tie_embeddings:
        return ConfigProblem(
            "model.tie_embeddings",
            True,
            "false with loss_parallel or sequence_parallel (they split the head, not the embedding)",
        )
    return None


def tied_pipeline_problem(model: nn.Module) -> str | None:
    """A head tied to the embedding would be one weight on the first and the last pipeline stage."""
    if model.tie_embeddings:
        return "model.tie_embeddings=true puts one weight in the first and the last stage; set it false"
    return None
