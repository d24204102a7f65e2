"""Causal grouped-query self-attention with rotary position embeddings (Llama 3 scaling included), the math of
``transformers.LlamaAttention``; shared by every decoder of the Llama family.

RoPE tables are rebuilt in every forward on the input's device: the module holds no buffers, so one built on the
meta device needs nothing but its parameters initialised.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distrain.models.common.documents import document_attention_mask, document_positions

if TYPE_CHECKING:
    from distrain.parallelism.context import ContextParallel

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    if rope_scaling is None:
        return
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}: only 'llama3' (or None) is implemented")
    missing = [key for key in _LLAMA3_KEYS if key not in rope_scaling]
    if missing:
        raise ValueError(f"llama3 rope_scaling lacks {missing}")


def rope_inv_freq(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None, device: torch.device | None = None
) -> Tensor:
    """Inverse RoPE frequencies (head_dim // 2,), fp32 on ``device``, with optional Llama 3 scaling.

    Llama 3 scaling leaves wavelengths shorter than ``original / high_freq_factor`` alone, divides those longer than
    ``original / low_freq_factor`` by ``factor``, and blends linearly (in ``original / wavelength``) in between.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_scaling is None:
        return inv_freq
    factor = rope_scaling["factor"]
    low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    original = rope_scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(is_medium, blended, scaled)


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings.

    The number of heads is read from the projections' output width in ``forward``, so a tensor-parallel shard holding
    ``n_heads / tp`` query heads and ``n_kv_heads / tp`` kv heads runs this code unchanged. ``context``, set by the
    spec's ``context_parallel`` hook, makes the input this rank's load-balanced share of every sequence: RoPE then
    uses the tokens' global positions and attention gathers the other ranks' keys and values.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
    ) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.wq = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.context: ContextParallel | None = None

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of the angles of ``positions``: (seq,) gives (seq, head_dim), one row per position for every
        sequence; (batch, seq) gives (batch, 1, seq, head_dim), each sequence's own (document masking)."""
        inv_freq = rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling, positions.device)
        positions = positions.to(torch.float32)
        # An elementwise outer product, not a matmul, so autocast cannot drop the angles to low precision.
        freqs = positions[..., None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        if angles.dim() == 3:  # per sequence: broadcast over the heads
            angles = angles.unsqueeze(1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        """Attend over ``x`` (batch, seq, d_model) on its device; returns (batch, seq, d_model).

        With ``context`` set, ``seq`` is this rank's share of the sequence and the context's all-gather of keys and
        values runs over its group (an all-to-all in backward); without it no collective runs. ``documents``
        (batch, whole sequence; document masking) restarts the rotary positions at each document and keeps every
        query's attention inside its document.
        """
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        context = self.context
        positions = torch.arange(seq, device=x.device) if context is None else context.positions(seq, x.device)
        mask = None
        if documents is not None:
            mask = document_attention_mask(documents, positions)
            positions = document_positions(documents)[:, positions]
        cos, sin = self._rope(positions, q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        scale = 1.0 / math.sqrt(self.head_dim)
        if context is not None:  # gathers the kv heads before repetition: n_rep times fewer bytes
            out = context.attend(q, k, v, n_rep=self.n_rep, scale=scale, mask=mask)
            return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        # Query head j reads kv head j // n_rep, as in Hugging Face's repeat_kv.
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
