"""The mixture-of-experts family's config schema (``conf/model/moe_tiny.yaml``, ``mixtral_8x7b.yaml`` extend it)."""

from __future__ import annotations

from dataclasses import dataclass

from distrain.models.common.config import DecoderConfig


@dataclass(kw_only=True)
class MoEConfig(DecoderConfig):
    """Llama-style decoder with top-k routed SwiGLU experts as its MLP (Mixtral layout); defaults: the tiny model.
    ``init_from``: a Mixtral directory."""

    _target_: str = "distrain.models.moe.MoE"
    n_kv_heads: int | None = 2
    expert_hidden: int = 128  # SwiGLU hidden units of one expert
    n_experts: int = 8
    top_k: int = 2  # experts per token
    load_balance_coef: float = 0.01  # Switch Transformer load-balancing loss weight
    z_loss_coef: float = 0.001  # ST-MoE router z-loss weight
