"""The Llama family's config schema (``conf/model/llama*.yaml`` extend it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distrain.models.common.config import DecoderConfig


@dataclass(kw_only=True)
class LlamaConfig(DecoderConfig):
    """Llama-architecture decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention (HF LlamaForCausalLM math)."""

    _target_: str = "distrain.models.llama.Llama"
    ffn_hidden: int = 344  # SwiGLU hidden units
    # HF's "llama3" scaling: {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; empty: plain RoPE
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    tie_embeddings: bool = False  # output head shares the embedding's weight
