"""Conversion between :class:`~distrain.models.gpt.model.GPT` and Hugging Face ``GPT2LMHeadModel``.

The GPT family is GPT-2's architecture exactly when GPT-2 is configured with the exact (erf) GELU
(``activation_function="gelu"``, where GPT-2's own default is the tanh approximation), with biases: learned
positions, pre-norm LayerNorm (eps 1e-5) blocks, biased q/k/v/o and MLP projections, attention scaled by
``1/sqrt(head_dim)``, a final LayerNorm and a bias-free head. GPT-2 stores its projections as ``Conv1D`` weights
of shape (in, out), ours are ``nn.Linear`` (out, in), and it fuses q, k and v into one ``c_attn``: the state-dict
functions transpose and concatenate (to_hf) or split and transpose (from_hf); they work on any device, meta
included. ``transformers`` is imported only by ``hf_config``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from distrain.models.gpt.model import GPT

_TOP_LEVEL = {
    "tok_emb.weight": "transformer.wte.weight",
    "pos_emb.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "head.weight": "lm_head.weight",
}
# Per block: ours -> GPT-2's, and whether the weight is a Conv1D one (stored transposed). q/k/v are fused apart.
_PER_BLOCK = {
    "attn_norm.weight": ("ln_1.weight", False),
    "attn_norm.bias": ("ln_1.bias", False),
    "attn.wo.weight": ("attn.c_proj.weight", True),
    "attn.wo.bias": ("attn.c_proj.bias", False),
    "mlp_norm.weight": ("ln_2.weight", False),
    "mlp_norm.bias": ("ln_2.bias", False),
    "mlp.w_in.weight": ("mlp.c_fc.weight", True),
    "mlp.w_in.bias": ("mlp.c_fc.bias", False),
    "mlp.w_out.weight": ("mlp.c_proj.weight", True),
    "mlp.w_out.bias": ("mlp.c_proj.bias", False),
}
_QKV = ("attn.wq", "attn.wk", "attn.wv")
_OURS_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"transformer\.h\.(\d+)\.(.+)")


def to_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A ``GPT`` state dict under ``GPT2LMHeadModel``'s names and layouts; KeyError on an unknown key."""
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        if key in _TOP_LEVEL:
            out[_TOP_LEVEL[key]] = tensor
            continue
        match = _OURS_BLOCK.fullmatch(key)
        if match is None or (match.group(2) not in _PER_BLOCK and match.group(2).rsplit(".", 1)[0] not in _QKV):
            raise KeyError(f"no GPT-2 state-dict mapping for key {key!r}")
        block, name = match.groups()
        if name in _PER_BLOCK:
            hf_name, transposed = _PER_BLOCK[name]
            out[f"transformer.h.{block}.{hf_name}"] = tensor.t() if transposed else tensor
        elif name == "attn.wq.weight":  # c_attn holds q, k, v side by side along its output (second) dim
            parts = [state[f"blocks.{block}.{proj}.weight"].t() for proj in _QKV]
            out[f"transformer.h.{block}.attn.c_attn.weight"] = torch.cat(parts, dim=1)
        elif name == "attn.wq.bias":
            parts = [state[f"blocks.{block}.{proj}.bias"] for proj in _QKV]
            out[f"transformer.h.{block}.attn.c_attn.bias"] = torch.cat(parts)
    return out


def from_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A ``GPT2LMHeadModel`` state dict under ``GPT``'s names and layouts; KeyError on an unknown key. A
    checkpoint of a tied GPT-2 omits ``lm_head.weight``: the head is then the token embedding."""
    top = {hf: ours for ours, hf in _TOP_LEVEL.items()}
    per_block = {hf: (ours, transposed) for ours, (hf, transposed) in _PER_BLOCK.items()}
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        if key in top:
            out[top[key]] = tensor
            continue
        match = _HF_BLOCK.fullmatch(key)
        if match is None:
            raise KeyError(f"no GPT state-dict mapping for key {key!r}")
        block, name = match.groups()
        if name in per_block:
            ours, transposed = per_block[name]
            out[f"blocks.{block}.{ours}"] = tensor.t() if transposed else tensor
        elif name in ("attn.c_attn.weight", "attn.c_attn.bias"):
            kind = name.rsplit(".", 1)[1]
            parts = tensor.chunk(3, dim=-1)  # (in, 3 out) weight or (3 out,) bias
            for proj, part in zip(_QKV, parts, strict=True):
                out[f"blocks.{block}.{proj}.{kind}"] = part.t() if kind == "weight" else part
        else:
            raise KeyError(f"no GPT state-dict mapping for key {key!r}")
    if "head.weight" not in out and "tok_emb.weight" in out:
        out["head.weight"] = out["tok_emb.weight"]
    return out


def hf_config(model: GPT) -> Any:
    """The ``transformers.GPT2Config`` describing ``model`` (exact GELU, its head tied or not, dropout as trained);
    ValueError for a model without biases, which GPT-2 always has."""
    from transformers import GPT2Config

    if not model.bias:
        raise ValueError(
            "a GPT with model.bias=false has no GPT-2 counterpart (GPT-2 has biases); use the default format"
        )
    dropout = float(model.dropout)
    return GPT2Config(
        vocab_size=model.vocab_size,
        n_positions=model.max_seq_len,
        n_embd=model.d_model,
        n_layer=model.n_layers,
        n_head=model.n_heads,
        n_inner=model.mlp_ratio * model.d_model,
        activation_function="gelu",
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=model.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        architectures=["GPT2LMHeadModel"],
    )
