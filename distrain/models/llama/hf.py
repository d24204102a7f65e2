"""Conversion between :class:`~distrain.models.llama.model.Llama` and Hugging Face ``LlamaForCausalLM``.

The state-dict functions only rename keys (tensors are passed through untouched, on whatever device they live): the
model uses Hugging Face's rotate-half RoPE layout, so q_proj/k_proj need no permutation. ``transformers`` is imported
only by the config functions, so renaming checkpoints works without it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from torch import Tensor

from distrain.models.common.hf import decoder_fields, decoder_sizes

if TYPE_CHECKING:
    from transformers import LlamaConfig

    from distrain.models.llama.model import Llama

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _rename(key: str, top: dict[str, str], per_layer: dict[str, str], pattern: re.Pattern, prefix: str) -> str:
    if key in top:
        return top[key]
    match = pattern.fullmatch(key)
    if match is None or match.group(2) not in per_layer:
        raise KeyError(f"no Llama state-dict mapping for key {key!r}")
    return f"{prefix}{match.group(1)}.{per_layer[match.group(2)]}"


def to_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a ``Llama`` state dict to ``LlamaForCausalLM`` names; raises KeyError on an unknown key.

    A tied model's state dict holds the shared tensor under both names, and so does the result, which
    ``LlamaForCausalLM(tie_word_embeddings=True).load_state_dict(strict=True)`` accepts.
    """
    return {_rename(k, _TOP_LEVEL, _PER_LAYER, _OURS_LAYER, "model.layers."): v for k, v in state.items()}


def from_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a ``LlamaForCausalLM`` state dict to ``Llama`` names; raises KeyError on an unknown key.

    Checkpoints saved with tied embeddings often omit ``lm_head.weight``; ``output.weight`` is then the embedding.
    """
    top = {hf: ours for ours, hf in _TOP_LEVEL.items()}
    per_layer = {hf: ours for ours, hf in _PER_LAYER.items()}
    out = {_rename(k, top, per_layer, _HF_LAYER, "layers."): v for k, v in state.items()}
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(model: Llama) -> LlamaConfig:
    """The ``transformers.LlamaConfig`` describing ``model`` (the whole model, whatever has been split off)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **decoder_fields(model),
        intermediate_size=model.ffn_hidden,
        rope_scaling=None if model.rope_scaling is None else dict(model.rope_scaling),
        attention_bias=False,
        mlp_bias=False,
    )


def from_hf_config(config: LlamaConfig) -> dict[str, Any]:
    """``Llama`` constructor kwargs for a ``LlamaConfig``; raises ValueError for what the model does not implement."""
    if config.model_type != "llama":
        raise ValueError(f"a Llama config.json (model_type 'llama'); this one is {config.model_type!r}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    unsupported = config.hidden_act != "silu" or config.attention_bias or config.mlp_bias
    if unsupported or head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError("only silu, bias-free Llama configs with head_dim = hidden_size / heads are supported")
    # transformers 5 keeps theta inside rope_parameters; 4.x has rope_theta plus an optional rope_scaling.
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = rope.pop("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    is_default = rope.get("rope_type", rope.get("type", "default")) == "default"
    return {
        **decoder_sizes(config),
        "ffn_hidden": config.intermediate_size,
        "rope_theta": float(theta),
        "rope_scaling": None if is_default else rope,
        "tie_embeddings": bool(config.tie_word_embeddings),
    }
