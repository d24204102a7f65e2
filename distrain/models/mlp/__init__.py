"""The position-wise MLP language model: ``model=mlp``."""

from distrain.models.mlp.model import MLPLanguageModel

__all__ = ["MLPLanguageModel"]
