"""The mixture-of-experts family: ``model=moe_tiny``, ``mixtral_8x7b``.

A Llama-style decoder (the Llama family's attention and norms) whose MLP is top-k routed SwiGLU experts. ``model``
holds the model code, ``spec`` its ``ModelSpec`` (auxiliary loss, routing metrics, active-parameter FLOPs), ``config``
its schema. It trains under the data-parallel strategies; tensor and pipeline parallelism refuse it.
"""

from distrain.models.moe.model import MoE

__all__ = ["MoE"]
