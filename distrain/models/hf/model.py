"""``model=hf``: a local Hugging Face causal LM behind the model contract (token ids in, logits out)."""

from __future__ import annotations

import torch
from torch import nn

from distrain.models.hf.spec import HF_CONFIG_SPEC, hf_spec


class HFCausalLM(nn.Module):
    """``AutoModelForCausalLM`` from a local directory (never the hub), in fp32, as ``self.hf``.

    Args:
        name_or_path: a local directory with ``config.json`` and ``*.safetensors`` weights.
        max_seq_len: the longest sequence trained on (the default ``data.seq_len``).
        random_init: build from ``config.json`` with Hugging Face's initialisation instead of loading the weights.
        attn_implementation: transformers' attention kernel (``sdpa``, ``eager``).
        vocab_size: the model config's vocabulary (None: ``config.json``'s); a different number is refused.
    """

    parallel_spec = HF_CONFIG_SPEC  # replaced per instance by the architecture's spec

    def __init__(
        self,
        *,
        name_or_path: str,
        max_seq_len: int,
        random_init: bool = False,
        attn_implementation: str = "sdpa",
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
        if vocab_size is not None and vocab_size != config.vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is not the model's {config.vocab_size} ({name_or_path})")
        on_meta = torch.empty(()).is_meta  # validation builds shapes only: no weights to read
        if random_init or on_meta:
            self.hf = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        else:
            self.hf = AutoModelForCausalLM.from_pretrained(
                name_or_path, local_files_only=True, attn_implementation=attn_implementation, dtype=torch.float32
            )
        self.hf.float()
        self.max_seq_len, self.vocab_size = max_seq_len, config.vocab_size
        self.parallel_spec = hf_spec(self.hf)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) of ``tokens`` (batch, seq), on the tokens' device; no key/value cache."""
        return self.hf(input_ids=tokens, use_cache=False).logits
