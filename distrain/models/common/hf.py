"""The Hugging Face config fields every decoder of the Llama family maps alike (``LlamaConfig``, ``MixtralConfig``),
both ways; each family's ``hf`` module adds its own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from distrain.models.common.decoder import Decoder


def decoder_fields(model: Decoder) -> dict[str, Any]:
    """The Hugging Face config fields every decoder of the Llama family fills alike (Llama's, Mixtral's)."""
    return {
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.head_dim,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,  # transformers 5 moves it into rope_parameters
        "tie_word_embeddings": model.tie_embeddings,
        "initializer_range": model.init_std,
        "hidden_act": "silu",
    }


def decoder_sizes(config: PretrainedConfig) -> dict[str, Any]:
    """The ``Decoder`` keyword arguments a Hugging Face config of the family gives alike (``rope_theta`` is each
    family's own: transformers 4 and 5 keep it in different places, with different defaults)."""
    return {
        "vocab_size": config.vocab_size,
        "max_seq_len": config.max_position_embeddings,
        "d_model": config.hidden_size,
        "n_layers": config.num_hidden_layers,
        "n_heads": config.num_attention_heads,
        "n_kv_heads": config.num_key_value_heads or config.num_attention_heads,
        "norm_eps": config.rms_norm_eps,
        "init_std": config.initializer_range,
    }
