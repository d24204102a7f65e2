"""The Llama family's config schema (``conf/model/llama*.yaml`` extend it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class LlamaConfig:
    """Llama-architecture decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention (HF LlamaForCausalLM math)."""

    _target_: str = "distrain.models.llama.Llama"
    vocab_size: int = 256
    max_seq_len: int = 128  # longest context (RoPE has no table: any length up to this is valid)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None: n_heads
    ffn_hidden: int = 344  # SwiGLU hidden units
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF's "llama3" scaling: {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; empty: plain RoPE
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    tie_embeddings: bool = False  # output head shares the embedding's weight
    init_std: float = 0.02
    init_from: str | None = None  # a local Hugging Face Llama directory (*.safetensors) whose weights start training
