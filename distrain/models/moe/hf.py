"""Conversion between :class:`~distrain.models.moe.model.MoE` and Hugging Face ``MixtralForCausalLM``.

Attention, norms, embedding and head are renamed by the Llama family's table (``distrain.models.llama.hf``); this
module maps the experts. ``to_hf`` writes the names of transformers 5's in-memory modules, which
``MixtralForCausalLM.load_state_dict(strict=True)`` and (from files) ``from_pretrained`` accept::

    layers.L.moe.router.weight  (E, d)        -> model.layers.L.mlp.gate.weight           (MixtralTopKRouter)
    layers.L.moe.w1, w3         (E, h, d) x 2 -> model.layers.L.mlp.experts.gate_up_proj  (E, 2h, d): [w1; w3]
    layers.L.moe.w2             (E, d, h)     -> model.layers.L.mlp.experts.down_proj     (MixtralExperts)

``from_hf`` reads those and also the per-expert layout ``save_pretrained`` writes and Hub checkpoints hold
(``model.layers.L.block_sparse_moe.gate.weight``, ``...block_sparse_moe.experts.N.w{1,2,3}.weight``), stacking the
experts. Transformers 4.x reads only the per-expert layout, so an export of ``to_hf`` loads with transformers >= 5.

The forward is the same math: router logits in the input dtype, softmax over all experts in fp32, top-k of the
probabilities, the k gates renormalised to sum to 1, SwiGLU experts; rotate-half RoPE with plain theta, RMSNorm.
``hf_config`` sets what Mixtral has beyond that to the values that change nothing: ``sliding_window=None``,
``router_jitter_noise=0``, ``attention_dropout=0``, untied embeddings (this family never ties). ``from_hf_config``
refuses (ValueError) a config whose forward this family cannot reproduce.

What only the training loss sees, and does not map exactly:

- ``router_aux_loss_coef`` is set from ``load_balance_coef``, as both weight a Switch load-balancing term, but the
  terms differ: ours is summed over layers, each ``E * sum_i f_i P_i`` with f the share of the layer's token-slots
  (1 when balanced); Mixtral's (only with ``output_router_logits=True``, off here) pools the layers' counts and
  probabilities first and counts top_k slots per token (``top_k`` when balanced).
- the router z-loss (``z_loss_coef``) has no Mixtral counterpart: it is not exported, and ``from_hf_config`` leaves
  it to the config's default.

``transformers`` is imported only by the config functions, so renaming checkpoints works without it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from distrain.models.common.hf import decoder_fields, decoder_sizes
from distrain.models.llama.hf import from_hf as llama_from_hf
from distrain.models.llama.hf import to_hf as llama_to_hf

if TYPE_CHECKING:
    from transformers import MixtralConfig

    from distrain.models.moe.model import MoE

_OURS_MOE = re.compile(r"layers\.(\d+)\.moe\.(w1|w2|w3|router\.weight)")
_HF_FUSED = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(gate\.weight|experts\.\w+_proj)")
_HF_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w[123])\.weight")
# A dense MLP's names: the Llama table would map them to a feed_forward this family does not have.
_DENSE_MLP = re.compile(r"(model\.)?layers\.\d+\.(mlp\.\w+_proj|feed_forward\.\w+)\.weight")


def to_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename (and fuse the experts of) an ``MoE`` state dict to ``MixtralForCausalLM`` names; KeyError on an unknown
    key or an expert projection without its pair (w1 needs w3). Tensors stay on their device."""
    dense: dict[str, Tensor] = {}
    moe: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        match = _OURS_MOE.fullmatch(key)
        if match is not None:
            moe.setdefault(match.group(1), {})[match.group(2)] = value
        elif _DENSE_MLP.fullmatch(key):
            raise KeyError(f"no MoE state-dict mapping for key {key!r}")
        else:
            dense[key] = value
    out = llama_to_hf(dense)
    for layer, parts in moe.items():
        prefix = f"model.layers.{layer}.mlp."
        if ("w1" in parts) != ("w3" in parts):
            raise KeyError(f"layers.{layer}.moe.w1 and w3 go together into gate_up_proj; only one is given")
        if "w1" in parts:
            out[prefix + "experts.gate_up_proj"] = torch.cat((parts["w1"], parts["w3"]), dim=1)
        if "w2" in parts:
            out[prefix + "experts.down_proj"] = parts["w2"]
        if "router.weight" in parts:
            out[prefix + "gate.weight"] = parts["router.weight"]
    return out


def from_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a ``MixtralForCausalLM`` state dict (fused or per-expert layout, see the module docstring) to ``MoE``
    names; KeyError on an unknown key. ``output.weight`` is the embedding when ``lm_head.weight`` is absent."""
    dense: dict[str, Tensor] = {}
    out: dict[str, Tensor] = {}
    per_expert: dict[tuple[str, str], dict[int, Tensor]] = {}
    for key, value in state.items():
        fused, single = _HF_FUSED.fullmatch(key), _HF_PER_EXPERT.fullmatch(key)
        if fused is not None:
            out |= _from_fused(fused.group(1), fused.group(2), value, key)
        elif single is not None:
            per_expert.setdefault((single.group(1), single.group(3)), {})[int(single.group(2))] = value
        elif _DENSE_MLP.fullmatch(key):
            raise KeyError(f"no MoE state-dict mapping for key {key!r}")
        else:
            dense[key] = value
    for (layer, name), experts in per_expert.items():
        # Experts 0..n-1 stack into one tensor; with a gap the tensor is left out, so the caller's check (e.g.
        # hf_weights.weights_problem) names it as missing rather than loading experts into the wrong slots.
        if sorted(experts) == list(range(len(experts))):
            out[f"layers.{layer}.moe.{name}"] = torch.stack([experts[i] for i in range(len(experts))])
    return out | llama_from_hf(dense)


def _from_fused(layer: str, name: str, value: Tensor, key: str) -> dict[str, Tensor]:
    ours = f"layers.{layer}.moe."
    if name == "gate.weight":
        return {ours + "router.weight": value}
    if name == "experts.down_proj":
        return {ours + "w2": value}
    if name == "experts.gate_up_proj":
        hidden = value.shape[1] // 2  # MixtralExperts chunks it in two along dim 1: gate first, then up
        return {ours + "w1": value[:, :hidden], ours + "w3": value[:, hidden:]}
    raise KeyError(f"no MoE state-dict mapping for key {key!r}")


def hf_config(model: MoE) -> MixtralConfig:
    """The ``transformers.MixtralConfig`` describing ``model`` (the whole model, read from its attributes)."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **decoder_fields(model),
        intermediate_size=model.expert_hidden,
        sliding_window=None,  # full causal attention, as ours
        attention_dropout=0.0,
        num_local_experts=model.n_experts,
        num_experts_per_tok=model.top_k,
        router_jitter_noise=0.0,  # Mixtral scales the MoE input by noise in training when > 0; ours has none
        router_aux_loss_coef=model.load_balance_coef,  # a different term (module docstring); loss only
        output_router_logits=False,
    )


def _forward_difference(config: MixtralConfig) -> str | None:
    """What in ``config`` makes Mixtral's forward differ from every ``MoE`` (None: nothing)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    window = getattr(config, "sliding_window", None)
    checks = (
        (getattr(config, "model_type", None) != "mixtral", f"model_type {config.model_type!r}, not 'mixtral'"),
        (config.hidden_act != "silu", f"hidden_act {config.hidden_act!r} (only silu)"),
        (head_dim * config.num_attention_heads != config.hidden_size, "head_dim != hidden_size / attention heads"),
        (rope.get("rope_type", rope.get("type", "default")) != "default", f"RoPE scaling {rope} (only plain RoPE)"),
        (window is not None and window < config.max_position_embeddings, f"sliding_window {window}"),
        (bool(getattr(config, "router_jitter_noise", 0.0)), "router_jitter_noise > 0 (no router noise here)"),
        (bool(getattr(config, "attention_dropout", 0.0)), "attention_dropout > 0 (no dropout here)"),
        (bool(config.tie_word_embeddings), "tie_word_embeddings (this family has an untied head)"),
    )
    return next((reason for bad, reason in checks if bad), None)


def from_hf_config(config: MixtralConfig) -> dict[str, Any]:
    """``MoE`` constructor kwargs for a ``MixtralConfig``; ValueError (one line) for a forward this family lacks.
    ``z_loss_coef`` (no Mixtral counterpart) is left out, so the constructor's default applies."""
    problem = _forward_difference(config)
    if problem is not None:
        raise ValueError(f"this Mixtral config cannot be reproduced by the MoE family: {problem}")
    # transformers 5 keeps theta inside rope_parameters; 4.x has a rope_theta attribute.
    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None) or 1e6)
    return {
        **decoder_sizes(config),
        "expert_hidden": config.intermediate_size,
        "n_experts": config.num_local_experts,
        "top_k": config.num_experts_per_tok,
        "load_balance_coef": float(config.router_aux_loss_coef),
        "rope_theta": float(theta),
    }
