"""The MLP family's config schema (``conf/model/mlp.yaml`` extends it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class MLPConfig:
    """Position-wise residual MLP language model (no attention): the smallest model every strategy takes."""

    _target_: str = "distrain.models.mlp.MLPLanguageModel"
    vocab_size: int = 256
    max_seq_len: int = 128
    d_model: int = 128
    hidden: int = 512
    n_layers: int = 4
