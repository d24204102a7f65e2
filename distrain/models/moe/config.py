"""The mixture-of-experts family's config schema (``conf/model/moe_tiny.yaml``, ``mixtral_8x7b.yaml`` extend it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class MoEConfig:
    """Llama-style decoder with top-k routed SwiGLU experts as its MLP (Mixtral layout); defaults: the tiny model."""

    _target_: str = "distrain.models.moe.MoE"
    vocab_size: int = 256
    max_seq_len: int = 128  # longest context (RoPE has no table: any length up to this is valid)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = 2  # key/value heads (grouped-query attention); None: n_heads
    expert_hidden: int = 128  # SwiGLU hidden units of one expert
    n_experts: int = 8
    top_k: int = 2  # experts per token
    load_balance_coef: float = 0.01  # Switch Transformer load-balancing loss weight
    z_loss_coef: float = 0.001  # ST-MoE router z-loss weight
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    init_from: str | None = None  # a local Hugging Face Mixtral directory (*.safetensors) whose weights start training
