"""A position-wise residual MLP language model: each token predicts the next from itself alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.w_in = nn.Linear(d_model, hidden)
        self.w_out = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w_out(F.gelu(self.w_in(self.norm(x))))


class MLPLanguageModel(nn.Module):
    """Embedding, ``n_layers`` residual MLP blocks, output head. Same (batch, seq) -> logits contract as GPT."""

    def __init__(self, *, vocab_size: int, max_seq_len: int, d_model: int, hidden: int, n_layers: int) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len, self.d_model, self.n_layers = (
            vocab_size,
            max_seq_len,
            d_model,
            n_layers,
        )
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleDict({str(i): MLPBlock(d_model, hidden) for i in range(n_layers)})
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        for param in self.parameters():
            if param.dim() >= 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x))

    def flops_per_token(self, seq_len: int) -> float:
        del seq_len  # no attention: cost does not depend on context length
        return 6.0 * sum(p.numel() for n, p in self.named_parameters() if p.dim() == 2 and "emb" not in n)
