"""``model=hf``: a local Hugging Face causal LM (``model.py`` wraps it, ``spec.py`` builds its spec)."""

from distrain.models.hf.model import HFCausalLM

__all__ = ["HFCausalLM"]
