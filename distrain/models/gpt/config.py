"""The GPT family's config schema (``conf/model/gpt_*.yaml`` extend it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class GPTConfig:
    """Decoder-only transformer (pre-norm, causal self-attention, GELU MLP, learned positions)."""

    _target_: str = "distrain.models.gpt.GPT"
    vocab_size: int = 256  # byte-level corpus
    max_seq_len: int = 128  # context length; also the training sequence length
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True  # biases in projections and LayerNorms; nanoGPT's recipes set false
    tie_embeddings: bool = False  # the head is the token embedding's weight (nanoGPT, GPT-2)
