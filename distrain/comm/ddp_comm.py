"""How a DDP-wrapped model communicates gradients: reducer bucket settings (and, later, hooks)."""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel


class DDPComm:
    """DDP's default bucketed all-reduce, overlapped with backward.

    Args:
        name: the comm option's name.
        bucket_cap_mb: gradients are all-reduced in buckets of about this many MiB, each launched as soon as
            all its gradients are ready during backward (overlap).
        gradient_as_bucket_view: gradients alias the flat bucket buffers (saves one copy and its memory).
        static_graph: the set of used parameters never changes, letting DDP skip per-step bookkeeping.
    """

    def __init__(self, *, name: str, bucket_cap_mb: float, gradient_as_bucket_view: bool, static_graph: bool) -> None:
        self.name = name
        self.bucket_cap_mb, self.gradient_as_bucket_view, self.static_graph = (
            bucket_cap_mb,
            gradient_as_bucket_view,
            static_graph,
        )

    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel``."""
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph,
        }

    def register(self, model: DistributedDataParallel) -> None:
        """Install a communication hook on ``model``; the default reducer needs none."""
        del model
