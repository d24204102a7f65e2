"""A Llama-architecture decoder with the same math as ``transformers.LlamaForCausalLM``: the family's decoder shell
(``distrain.models.common``) with pre-norm blocks of RoPE attention and a SwiGLU MLP.

The model holds no buffers: RoPE tables are rebuilt in every attention forward on the input's device, so a model
built on the meta device and materialised later needs nothing but ``reset_parameters()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.nn.functional as F
from torch import Tensor, nn

from distrain.models.common.attention import Attention, check_rope_scaling
from distrain.models.common.decoder import Decoder, DecoderArgs, RMSNorm, decoder_args
from distrain.models.llama.spec import LLAMA_SPEC

if TYPE_CHECKING:
    from typing import Unpack


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
    """Pre-norm decoder block; ``forward`` takes the hidden states (and, under document masking, the sequence's
    documents), so wrappers and splitters can treat it as a plain ``Tensor -> Tensor`` module."""

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

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        """Run the block on ``x`` (batch, seq, d_model) on its device (``documents``: ``Attention.forward``'s)."""
        h = x + self.attention(self.attention_norm(x), documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(Decoder):
    """Llama decoder: RMSNorm, RoPE (with Llama 3 scaling), SwiGLU MLP, grouped-query attention."""

    parallel_spec = LLAMA_SPEC

    def __init__(
        self,
        *,
        ffn_hidden: int,
        rope_scaling: dict[str, Any] | None = None,
        tie_embeddings: bool = False,
        init_from: str | None = None,
        **sizes: Unpack[DecoderArgs],
    ) -> None:
        rope_scaling = dict(rope_scaling) if rope_scaling else None  # {} (the config's default): plain RoPE
        check_rope_scaling(rope_scaling)

        def block(decoder: Decoder) -> TransformerBlock:
            heads = (decoder.d_model, decoder.n_heads, decoder.n_kv_heads)
            return TransformerBlock(*heads, ffn_hidden, decoder.norm_eps, decoder.rope_theta, rope_scaling)

        super().__init__(**decoder_args(sizes), block=block, tie_embeddings=tie_embeddings)
        self.ffn_hidden, self.rope_scaling = ffn_hidden, rope_scaling
        self.initialise(init_from)
