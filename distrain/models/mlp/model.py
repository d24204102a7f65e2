"""A position-wise residual MLP language model: each token predicts the next from itself alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from distrain.config.checks import at_least, check
from distrain.models.spec import ModelSpec


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.w_in = nn.Linear(d_model, hidden)
        self.w_out = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w_out(F.gelu(self.w_in(self.norm(x))))


# No tensor-parallel plan: the family is the smallest model every data-parallel strategy and the pipeline take.
# FLOPs: the default (6 per linear weight; no attention, so no dependence on the context length).
def check_config(cfg: DictConfig) -> None:
    for key in ("d_model", "hidden", "n_layers"):
        check(cfg, f"model.{key}", at_least(1), "an integer >= 1")


MLP_SPEC = ModelSpec(
    name="mlp",
    blocks="blocks",
    before_blocks=("tok_emb",),
    after_blocks=("norm", "head"),
    width="d_model",
    check_config=check_config,
)


class MLPLanguageModel(nn.Module):
    """Embedding, ``n_layers`` residual MLP blocks, output head. Same (batch, seq) -> logits contract as GPT."""

    parallel_spec = MLP_SPEC

    def __init__(self, *, vocab_size: int, max_seq_len: int, d_model: int, hidden: int, n_layers: int) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.d_model, self.n_layers = d_model, n_layers
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleDict({str(i): MLPBlock(d_model, hidden) for i in range(n_layers)})
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        for param in self.parameters():
            if param.dim() >= 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of ``tokens``; as a pipeline stage (children set to None) it takes or returns hidden states."""
        x = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x
