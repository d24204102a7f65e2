"""A Llama-architecture decoder with the same math as ``transformers.LlamaForCausalLM``.

The model holds no buffers: RoPE tables are rebuilt in every attention forward on the input's device, so a model
built on the meta device and materialised later needs nothing but ``reset_parameters()``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distrain.models.hf_weights import load_hf_weights
from distrain.models.llama.spec import LLAMA_SPEC

if TYPE_CHECKING:
    from distrain.parallelism.context import ContextParallel

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class RMSNorm(nn.Module):
    """Root-mean-square norm, reduced in fp32 whatever the input dtype.

    Args:
        dim: size of the last (normalised) dimension.
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` (..., dim) on its own device; returns the input's dtype scaled by ``weight``."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
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
        inv_freq = rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling, positions.device)
        positions = positions.to(torch.float32)
        # An elementwise outer product, not a matmul, so autocast cannot drop the angles to low precision.
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        """Attend over ``x`` (batch, seq, d_model) on its device; returns (batch, seq, d_model).

        With ``context`` set, ``seq`` is this rank's share of the sequence and the context's all-gather of keys and
        values runs over its group (an all-to-all in backward); without it no collective runs.
        """
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        context = self.context
        positions = torch.arange(seq, device=x.device) if context is None else context.positions(seq, x.device)
        cos, sin = self._rope(positions, q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        scale = 1.0 / math.sqrt(self.head_dim)
        if context is not None:  # gathers the kv heads before repetition: n_rep times fewer bytes
            out = context.attend(q, k, v, n_rep=self.n_rep, scale=scale)
            return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        # Query head j reads kv head j // n_rep, as in Hugging Face's repeat_kv.
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))`` with w1 the gate, w3 the up and w2 the down projection."""

    def __init__(self, d_model: int, ffn_hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, d_model, bias=False)
        self.w3 = nn.Linear(d_model, ffn_hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to ``x`` (..., d_model) on its device."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block; ``forward`` takes the hidden states only, so wrappers and splitters can treat it
    as a plain ``Tensor -> Tensor`` module."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_hidden: int,
        norm_eps: float,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(d_model, norm_eps)
        self.attention = Attention(d_model, n_heads, n_kv_heads, rope_theta, rope_scaling)
        self.ffn_norm = RMSNorm(d_model, norm_eps)
        self.feed_forward = FeedForward(d_model, ffn_hidden)

    def forward(self, x: Tensor) -> Tensor:
        """Run the block on ``x`` (batch, seq, d_model) on its device."""
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama decoder: embedding, ``n_layers`` blocks, final norm and LM head.

    A pipeline splitter may set ``tok_embeddings``, ``norm`` or ``output`` to None and drop entries of ``layers``;
    ``forward`` then skips them, so a stage without the embedding takes hidden states instead of token ids.
    """

    parallel_spec = LLAMA_SPEC

    def __init__(
        self,
        *,
        vocab_size: int,
        max_seq_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        ffn_hidden: int,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        tie_embeddings: bool = False,
        init_std: float = 0.02,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(f"d_model {d_model} must split into {n_heads} heads of even size")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads}")
        rope_scaling = dict(rope_scaling) if rope_scaling else None  # {} (the config's default): plain RoPE
        _check_rope_scaling(rope_scaling)
        self.vocab_size, self.max_seq_len, self.d_model = vocab_size, max_seq_len, d_model
        self.n_layers, self.n_heads, self.n_kv_heads = n_layers, n_heads, n_kv_heads
        self.head_dim, self.ffn_hidden, self.norm_eps = d_model // n_heads, ffn_hidden, norm_eps
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.tie_embeddings, self.init_std = tie_embeddings, init_std

        self.tok_embeddings = nn.Embedding(vocab_size, d_model)
        block_args = (d_model, n_heads, n_kv_heads, ffn_hidden, norm_eps, rope_theta, self.rope_scaling)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(*block_args) for i in range(n_layers)})
        self.norm = RMSNorm(d_model, norm_eps)
        self.output = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()
        if init_from and not self.output.weight.is_meta:  # on the meta device (validation) there is nothing to fill
            load_hf_weights(self, init_from)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise in place, on whatever device the parameters live (meta included).

        Residual-branch outputs (``wo``, ``w2``) get ``init_std / sqrt(2 * n_layers)`` so the residual stream's
        variance does not grow with depth.
        """
        residual_std = self.init_std / math.sqrt(2 * self.n_layers)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        # named_parameters yields a tied weight once, so it is initialised once.
        for name, param in self.named_parameters():
            if param.dim() == 2:
                std = residual_std if name.endswith(("wo.weight", "w2.weight")) else self.init_std
                nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, tokens: Tensor) -> Tensor:
        """Token ids (batch, seq), or hidden states (batch, seq, d_model) when there is no embedding, to logits
        (batch, seq, vocab), or to hidden states when ``output`` is None; all on the input's device."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
