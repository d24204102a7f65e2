"""The ``comm`` group's schemas: how DDP averages gradients (``distrain.comm``)."""

from __future__ import annotations

from dataclasses import dataclass

from distrain.config.choices import choices

CommDtype = choices("CommDtype", "bfloat16", "float16")
TopKFeedback = choices("TopKFeedback", "update", "estimate", "residual")
OuterCompression = choices("OuterCompression", "none", "topk", "powersgd")


@dataclass(kw_only=True)
class DDPCommConfig:
    """Settings of DDP's gradient reducer (used by strategies that all-reduce gradients through DDP)."""

    _target_: str = "distrain.comm.ddp_comm.DDPComm"
    name: str = "default"
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False


@dataclass(kw_only=True)
class CompressedCommConfig(DDPCommConfig):
    """A hook that sends less than the gradient, with the quality guard (``distrain.comm.quality``)."""

    quality_every: int = 50  # compare the applied gradient with the dense one every N steps; 0: never
    quality_threshold: float = 0.9  # warn once when the relative error stays above this (2 checks in a row)


@dataclass(kw_only=True)
class CastCommConfig(CompressedCommConfig):
    """Gradients all-reduced in 16 bits (half the bytes), then cast back to fp32."""

    _target_: str = "distrain.comm.compression.CastComm"
    name: str = "bf16"
    dtype: CommDtype = CommDtype.bfloat16  # bfloat16 | float16


@dataclass(kw_only=True)
class PowerSGDCommConfig(CompressedCommConfig):
    """PyTorch's PowerSGD hook: gradient matrices sent as rank-``rank`` factors, with error feedback."""

    _target_: str = "distrain.comm.compression.PowerSGDComm"
    name: str = "powersgd"
    rank: int = 4  # rank of the low-rank approximation
    start_iter: int = 10  # dense all-reduce for the first steps (>= 2: DDP rebuilds its buckets after step 1)
    min_compression_rate: float = 2.0  # a matrix is compressed only when that saves at least this factor
    error_feedback: bool = True
    warm_start: bool = True  # reuse the last step's Q as the starting point (one power iteration per step)


@dataclass(kw_only=True)
class TopKCommConfig(CompressedCommConfig):
    """Top-k sparsification with error feedback: each rank sends only the ``density`` fraction of entries that
    matter most, of its optimizer update (``feedback=update``) or of its gradient (``estimate``, ``residual``)."""

    _target_: str = "distrain.comm.topk_update.topk_comm"
    name: str = "topk"
    density: float = 0.01  # fraction of entries sent per step, in (0, 1]
    # update: top-k of each rank's optimizer update (any optimizer) | estimate: EF21 on gradients |
    # residual: classic error feedback on gradients (sound for SGD)
    feedback: TopKFeedback = TopKFeedback.update
    sync_every: int = 50  # update only: all-reduce the whole unsent residual every N steps; 0: never
    warmup_steps: int = 0  # density decays exponentially from warmup_start_density to density over these steps
    warmup_start_density: float = 0.25
    momentum: float = 0.0  # residual only: momentum correction (then optimizer=sgd optimizer.momentum=0)


@dataclass(kw_only=True)
class HierarchicalCommConfig(DDPCommConfig):
    """Two-level all-reduce: reduce inside each node, all-reduce across node leaders, broadcast inside nodes."""

    _target_: str = "distrain.comm.hierarchical.HierarchicalComm"
    name: str = "hierarchical"
    ranks_per_node: int | None = None  # None: the launcher's LOCAL_WORLD_SIZE (torchrun, SLURM tasks per node)


@dataclass(kw_only=True)
class DiLoCoCommConfig(DDPCommConfig):
    """DiLoCo: each rank takes ``sync_every`` inner steps on its own, then the ranks average their pseudo-gradients
    and an outer Nesterov SGD steps the shared model; ``fragments`` > 1 is Streaming DiLoCo."""

    _target_: str = "distrain.comm.diloco.DiLoCoComm"
    name: str = "diloco"
    sync_every: int = 50  # inner steps between outer steps (H)
    outer_lr: float = 0.7  # the DiLoCo paper's outer learning rate
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1  # > 1: streaming, fragment f syncs after inner step (f+1)*H/fragments of each cycle
    compression: OuterCompression = OuterCompression.none  # of the pseudo-gradient: none | topk | powersgd
    density: float = 0.01  # compression=topk: share of entries sent, with error feedback
    rank: int = 4  # compression=powersgd: rank of each weight matrix's factors, with error feedback
