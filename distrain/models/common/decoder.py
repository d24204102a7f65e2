"""The Llama family's decoder shell: embedding, blocks, final norm and LM head, its initialisation and its one
forward that skips what a pipeline splitter removed; the family's models (``Llama``, ``MoE``) give it their blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypedDict

import torch
from torch import Tensor, nn

from distrain.models.hf_weights import load_hf_weights


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


class Decoder(nn.Module):
    """The Llama family's decoder: embedding, ``n_layers`` blocks, final norm and LM head, shared by ``Llama`` and
    the mixture of experts (which differ in their blocks only).

    A pipeline splitter may set ``tok_embeddings``, ``norm`` or ``output`` to None and drop entries of ``layers``;
    ``forward`` then skips them, so a stage without the embedding takes hidden states instead of token ids.

    Args:
        block: builds one block, given the decoder (its sizes set, ``n_kv_heads`` resolved).
        self_initialising: module types inside the blocks that initialise their own parameters, given the init
            std and the residual std (``reset_parameters(std, residual_std)``).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        max_seq_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        init_std: float = 0.02,
        block: Callable[[Decoder], nn.Module],
        tie_embeddings: bool = False,
        self_initialising: tuple[type[nn.Module], ...] = (),
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(f"d_model {d_model} must split into {n_heads} heads of even size")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads}")
        self.vocab_size, self.max_seq_len, self.d_model = vocab_size, max_seq_len, d_model
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = n_layers, n_heads, n_kv_heads, d_model // n_heads
        self.norm_eps, self.rope_theta, self.init_std = norm_eps, rope_theta, init_std
        self.tie_embeddings, self.self_initialising = tie_embeddings, self_initialising

        self.tok_embeddings = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleDict({str(i): block(self) for i in range(n_layers)})
        self.norm = RMSNorm(d_model, norm_eps)
        self.output = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def initialise(self, init_from: str | None) -> None:
        """Initialise the parameters, then load a Hugging Face directory's weights over them (``init_from``)."""
        self.reset_parameters()
        if init_from and not self.output.weight.is_meta:  # on the meta device (validation) there is nothing to fill
            load_hf_weights(self, init_from)  # renamed by the family's spec (from_hf)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise in place, on whatever device the parameters live (meta included).

        Residual-branch outputs (``wo``, ``w2``) get ``init_std / sqrt(2 * n_layers)`` so the residual stream's
        variance does not grow with depth; a self-initialising module (the experts) is given both stds.
        """
        residual_std = self.init_std / math.sqrt(2 * self.n_layers)
        done = set()
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, self.self_initialising):
                module.reset_parameters(self.init_std, residual_std)
                done.update(id(param) for param in module.parameters())
        # named_parameters yields a tied weight once, so it is initialised once.
        for name, param in self.named_parameters():
            if param.dim() == 2 and id(param) not in done:
                std = residual_std if name.endswith(("wo.weight", "w2.weight")) else self.init_std
                nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, tokens: Tensor, documents: Tensor | None = None) -> Tensor:
        """Token ids (batch, seq), or hidden states (batch, seq, d_model) when there is no embedding, to logits
        (batch, seq, vocab), or to hidden states when ``output`` is None; all on the input's device. ``documents``
        (long, (batch, seq) of the whole sequence; document masking): each token's document inside its sequence,
        within which positions restart and attention stays."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, documents=documents)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


class DecoderArgs(TypedDict, total=False):
    """The keyword arguments every decoder of the family passes on to ``Decoder`` (its defaults apply): sizes,
    norm epsilon, RoPE base and init std."""

    vocab_size: int
    max_seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None
    norm_eps: float
    rope_theta: float
    init_std: float


def decoder_args(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` when every key is one of ``DecoderArgs`` (a family's own keys are its constructor's); TypeError
    naming the first other key, as an unexpected keyword argument of the family's constructor would."""
    unknown = sorted(set(given) - set(DecoderArgs.__annotations__))
    if unknown:
        raise TypeError(f"got an unexpected keyword argument {unknown[0]!r}")
    return given
