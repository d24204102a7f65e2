"""The small GPT family: ``model=gpt_tiny`` and ``model=gpt_small``."""

from distrain.models.gpt.model import GPT

__all__ = ["GPT"]
