"""The ``model=hf`` config schema."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING


@dataclass(kw_only=True)
class HFConfig:
    """A local Hugging Face causal LM (``AutoModelForCausalLM``), trained under distrain's strategies."""

    _target_: str = "distrain.models.hf.HFCausalLM"
    name_or_path: str = MISSING  # a local directory: config.json and *.safetensors (nothing is downloaded)
    max_seq_len: int = 128  # the longest sequence trained on (the default data.seq_len)
    random_init: bool = False  # build from config.json with Hugging Face's initialisation, no weights read
    attn_implementation: str = "sdpa"  # sdpa | eager
    vocab_size: int | None = None  # None: config.json's
