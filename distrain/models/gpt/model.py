"""A small GPT: token + learned position embeddings, pre-norm blocks, an output head (tied to the token embedding
with ``tie_embeddings``), biases in every projection and norm unless ``bias=False`` (nanoGPT's recipes).

Layout chosen for the parallel strategies: blocks live in a ``ModuleDict`` keyed by index so a pipeline stage can
drop the blocks it does not own without renaming the others, and attention uses separate q/k/v projections whose
output width may be a tensor-parallel shard (heads are inferred from the local width).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from distrain.models.common.documents import document_attention_mask, document_positions
from distrain.models.gpt.spec import GPT_SPEC


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.wq = nn.Linear(d_model, d_model, bias=bias)
        self.wk = nn.Linear(d_model, d_model, bias=bias)
        self.wv = nn.Linear(d_model, d_model, bias=bias)
        self.wo = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention over ``x`` (batch, seq, d_model) on its device, kept inside each token's document when
        ``documents`` (batch, seq) is given; no collective."""
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        mask = None if documents is None else document_attention_mask(documents)
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.w_in = nn.Linear(d_model, hidden, bias=bias)
        self.w_out = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, bias)
        self.mlp_norm = nn.LayerNorm(d_model, bias=bias)
        self.mlp = FeedForward(d_model, mlp_ratio * d_model, bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), documents=documents))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Args:
        vocab_size: number of token ids.
        max_seq_len: longest sequence the position embedding covers.
        d_model: residual width.
        n_layers: number of transformer blocks.
        n_heads: attention heads; must divide ``d_model``.
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        dropout: dropout on attention and residual branches.
        bias: biases in the projections and LayerNorms (nanoGPT's recipes turn them off).
        tie_embeddings: the output head is the token embedding's weight (one tensor, as nanoGPT and GPT-2 do).
    """

    parallel_spec = GPT_SPEC

    def __init__(
        self,
        *,
        vocab_size: int,
        max_seq_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        bias: bool = True,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.d_model, self.n_layers = d_model, n_layers
        self.n_heads, self.mlp_ratio, self.dropout = n_heads, mlp_ratio, dropout
        self.bias, self.tie_embeddings = bias, tie_embeddings
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        block = partial(Block, d_model, n_heads, mlp_ratio, dropout, bias)
        self.blocks = nn.ModuleDict({str(i): block() for i in range(n_layers)})
        self.norm = nn.LayerNorm(d_model, bias=bias)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2 initialisation: residual output projections scaled by depth to keep the stream's variance flat.
        # named_parameters yields a tied head once (as the embedding), so it is initialised once.
        for name, param in self.named_parameters():
            if param.dim() < 2:
                continue
            std = 0.02 / math.sqrt(2 * self.n_layers) if name.endswith(("wo.weight", "w_out.weight")) else 0.02
            nn.init.normal_(param, mean=0.0, std=std)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) of ``tokens`` (batch, seq). A pipeline stage is this model with the children
        it does not hold set to None: it then takes or returns hidden states (batch, seq, d_model). ``documents``
        (long, (batch, seq); document masking): each token's document, where positions restart and attention
        stays."""
        x = tokens
        if self.tok_emb is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            if documents is not None:
                positions = document_positions(documents)
            x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks.values():
            x = block(x, documents=documents)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x
