"""The config schema every decoder family of the Llama kind extends (``LlamaConfig``, ``MoEConfig``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class DecoderConfig:
    """What every decoder of the Llama family has: sizes, grouped-query attention, RMSNorm, RoPE, init."""

    vocab_size: int = 256
    max_seq_len: int = 128  # longest context (RoPE has no table: any length up to this is valid)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None: n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    init_from: str | None = None  # a local Hugging Face directory (*.safetensors) whose weights start training
