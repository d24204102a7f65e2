"""The built-in Llama family: ``model=llama_tiny``, ``llama3_1b``, ``llama3_8b``.

``model`` holds the model code, ``spec`` its parallel plan, ``config`` its schema, ``hf`` the Hugging Face adapter.
"""

from distrain.models.llama.model import Llama

__all__ = ["Llama"]
