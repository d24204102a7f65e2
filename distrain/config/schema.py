"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each option in ``conf/<group>/`` extends one of these schemas (see ``SCHEMAS``), so a misspelt key or a wrongly
typed value is refused at
composition time, before any rank starts. Defaults live here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from distrain.comm.config import (
    CastCommConfig,
    DDPCommConfig,
    DiLoCoCommConfig,
    HierarchicalCommConfig,
    PowerSGDCommConfig,
    TopKCommConfig,
)
from distrain.config.choices import choices
from distrain.data.config import MixDataConfig, StdlibDataConfig, SyntheticDataConfig, TokensDataConfig
from distrain.ft.config import NoReplicaGroupsConfig, TorchFTConfig
from distrain.models.gpt.config import GPTConfig
from distrain.models.hf.config import HFConfig
from distrain.models.llama.config import LlamaConfig
from distrain.models.mlp.config import MLPConfig
from distrain.models.moe.config import MoEConfig
from distrain.optim.config import AdamWConfig, MuonConfig, SchedulerConfig, SGDConfig

# ---------------------------------------------------------------------------------------------- choices


Device = choices("Device", "auto", "cpu", "cuda")
TargetDevice = choices("TargetDevice", "cpu", "cuda")
Backend = choices("Backend", "gloo", "nccl")
OnNonfinite = choices("OnNonfinite", "stop", "skip")
ComputeDtype = choices("ComputeDtype", "float32", "bfloat16", "float16")
Schedule = choices("Schedule", "gpipe", "1f1b", "interleaved")
DataParallelMode = choices("DataParallelMode", "fsdp", "replicate")
Offload = choices("Offload", "none", "cpu")
RecomputeMode = choices("RecomputeMode", "none", "full", "selective")
CompileScope = choices("CompileScope", "blocks", "model")
WandbMode = choices("WandbMode", "auto", "online", "offline", "disabled")

# ---------------------------------------------------------------------------------------------- model


# Each family's schema lives in its folder: distrain/models/<family>/config.py; the data group's in
# distrain/data/config.py.


# ---------------------------------------------------------------------------------------- parallelism


@dataclass(kw_only=True)
class SingleConfig:
    """One process, no gradient communication."""

    _target_: str = "distrain.parallelism.single.SingleProcessStrategy"
    name: str = "single"


@dataclass(kw_only=True)
class DDPConfig:
    """torch DistributedDataParallel: parameters replicated, gradients all-reduced in buckets."""

    _target_: str = "distrain.parallelism.ddp.DDPStrategy"
    name: str = "ddp"
    find_unused_parameters: bool = False


@dataclass(kw_only=True)
class HybridConfig:
    """Data x context x tensor x pipeline (and expert) parallelism on one device mesh; FSDP2 on the dp axis. The
    ``fsdp``, ``hsdp``, ``tensor`` and ``pipeline`` options are presets of it (conf/parallelism/<name>.yaml)."""

    _target_: str = "distrain.parallelism.hybrid.HybridStrategy"
    name: str = "hybrid"
    dp_replicate: int = 1  # copies of the dp-sharded model (HSDP when > 1); -1: one per node
    dp: int = -1  # data-parallel (FSDP sharding) degree; -1: the world size / (dp_replicate x cp x tp x pp)
    tp: int = 1  # tensor-parallel degree; -1: the rest of the world size (one of dp, tp, pp may be -1)
    pp: int = 1  # pipeline stages (ranks), -1 as tp; with pp != 1 the pipeline keys below apply
    cp: int = 1  # context-parallel degree: every sequence split over cp ranks (pp = 1 only)
    ep: int = 1  # expert-parallel degree: a model's experts split over ep of the dp ranks (ep divides dp)
    fsdp_stage: int = "${stage_or:3}"  # FSDP on dp: 2 keeps gathered parameters forward to backward; 3 reshards
    dp_mode: DataParallelMode = DataParallelMode.fsdp  # replicate: whole copies, gradients all-reduced
    sequence_parallel: bool = False  # tp: norms, dropout and residual stream split along the sequence (pp=1 only)
    loss_parallel: bool = False  # tp: cross-entropy on vocabulary-sharded logits, never gathered (pp=1 only)
    schedule: Schedule = Schedule["1f1b"]  # gpipe | 1f1b | interleaved
    pipeline_microbatches: int = 4  # pipeline micro-batches per optimizer step (not data.micro_batch_size)
    virtual_stages: int = 2  # stages per pipeline rank with schedule=interleaved
    split_points: list[int] = field(default_factory=list)  # block indices where stages begin; empty: balanced
    recompute_stages: list[int] = field(default_factory=list)  # pipeline stages that recompute activations
    cpu_offload: bool = False  # FSDP's shards in CPU memory (GPU runs only)
    # Old names, still read (validation logs one line naming the new key): fsdp_stage, pipeline_microbatches,
    # recompute_stages.
    stage: int | None = None
    microbatches: int | None = None
    activation_checkpointing: list[int] | None = None


@dataclass(kw_only=True)
class ZeroConfig:
    """DeepSpeed ZeRO. ``stage`` defaults to the top-level ``stage`` (``parallelism=zero stage=3``) or 2.

    Sizes are in elements, as in DeepSpeed's ``zero_optimization`` section.
    """

    _target_: str = "distrain.parallelism.zero.ZeroStrategy"
    name: str = "zero"
    stage: int = "${stage_or:2}"
    overlap_comm: bool = False  # overlap gradient reduction with backward (uses extra buffers)
    contiguous_gradients: bool = True  # copy gradients into one contiguous buffer as they are produced
    # Communication buffers, in elements; None: sized to the model (its parameter count), capped at DeepSpeed's
    # defaults (5e8, 5e8, 5e7, 1e9), so a small model does not pay for gigabytes of buckets.
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    offload_optimizer: Offload = Offload.none  # cpu: optimizer state and step on the CPU (GPU runs)
    offload_param: Offload = Offload.none  # none | cpu: parameters in CPU memory between uses (stage 3, GPU runs)
    stage3_prefetch_bucket_size: int | None = None
    # 0, not DeepSpeed's 1e5: distrain's small models would otherwise keep every tensor resident, unsharded.
    stage3_param_persistence_threshold: int = 0
    stage3_max_live_parameters: int | None = None


# The optimizer group's schemas and the scheduler block live in distrain/optim/config.py.


# ------------------------------------------------------------------------------------------ precision


@dataclass(kw_only=True)
class PrecisionConfig:
    """Autocast compute dtype over fp32 master weights; fp16 adds a dynamic gradient scaler."""

    _target_: str = "distrain.precision.policy.PrecisionPolicy"
    name: str = "fp32"
    compute_dtype: ComputeDtype = ComputeDtype.float32  # float32 (no autocast) | bfloat16 | float16
    grad_scaler: bool = False


# ----------------------------------------------------------------------------------------- checkpoint


@dataclass(kw_only=True)
class CheckpointConfig:
    """Periodic sharded checkpoints (torch.distributed.checkpoint), written atomically."""

    _target_: str = "distrain.checkpoint.checkpointer.Checkpointer"
    _partial_: bool = True
    every_n_steps: int = 100  # 0: no periodic checkpoints
    keep_last: int = 2  # older complete checkpoints are deleted; 0 keeps all
    dir: str | None = None  # default: <run dir>/checkpoints
    save_final: bool = True
    resume: str = "never"  # never | auto (newest complete checkpoint in dir) | <path of a step_* directory>
    async_save: bool = False  # periodic saves written in the background (DCP async_save); not with zero
    emergency: bool = True  # after an exception, save if every rank agrees its state is consistent
    emergency_timeout_s: float = 30.0  # how long a failed rank waits for the others to agree


# --------------------------------------------------------------------------------------------- logger


@dataclass(kw_only=True)
class JsonlTrackerConfig:
    """Also append every record, tagged with the run's name, to one shared JSON-lines file."""

    _target_: str = "distrain.trackers.base.JsonlTracker"
    path: str = "runs.jsonl"  # relative to the directory train.py was started from


@dataclass(kw_only=True)
class WandbTrackerConfig:
    """Weights & Biases: one run per training job (rank 0), offline when no credentials are found."""

    _target_: str = "distrain.trackers.base.WandbTracker"
    project: str = "distrain"
    entity: str | None = None
    group: str | None = None  # None: the multirun sweep, or the SLURM job, this run belongs to
    tags: list[str] = field(default_factory=list)
    name: str | None = None  # None: the run directory's name under outputs/ or multirun/
    mode: WandbMode = WandbMode.auto  # auto (online with credentials, else offline) | online | offline | disabled


@dataclass(kw_only=True)
class TensorBoardTrackerConfig:
    """TensorBoard event files, written by rank 0: ``tensorboard --logdir <run dir>/tensorboard``."""

    _target_: str = "distrain.trackers.tensorboard_tracker.TensorBoardTracker"
    dir: str | None = None  # None: <run dir>/tensorboard; else <dir>/<run name>, so many runs share one logdir


@dataclass(kw_only=True)
class MlflowTrackerConfig:
    """MLflow: one run per training job (rank 0) with params, metrics, and config and summary artifacts."""

    _target_: str = "distrain.trackers.mlflow_tracker.MlflowTracker"
    tracking_uri: str | None = None  # None: sqlite:///<run dir>/mlflow.db; else sqlite:///..., http(s)://..., a path
    experiment_name: str = "distrain"
    run_name: str | None = None  # None: the run directory's name under outputs/ or multirun/
    tags: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- root


@dataclass(kw_only=True)
class TrainerConfig:
    max_steps: int = 200
    seed: int = 0
    grad_accum_steps: int = 1  # micro-steps per optimizer step; gradients sync on the last only
    grad_clip_norm: float = 1.0  # global L2 norm; 0 disables clipping (the norm is still reported)
    on_nonfinite: OnNonfinite = OnNonfinite.stop  # a NaN/inf gradient norm stops training, or skips that update
    log_every: int = 10
    eval_every: int = 100  # 0: evaluate only at the end
    eval_batches: int = 8  # validation micro-batches per rank
    progress_bar: bool = True
    overfit_batches: int = 0  # >0: train on only the first N global batches, over and over (a model that learns)
    detect_anomaly: bool = False  # autograd anomaly detection: the op that made a NaN/inf, with its traceback (slow)

    def evaluates_after(self, step: int) -> bool:
        """Whether the loop evaluates after optimizer step ``step`` (every ``eval_every``, and the last)."""
        return (self.eval_every > 0 and step % self.eval_every == 0) or step == self.max_steps


@dataclass(kw_only=True)
class MonitorConfig:
    """Per-step measurements (distrain/monitor/); written with every logged step."""

    straggler_threshold: float = 0.5  # name the busiest rank when it exceeds the median of the others by this fraction
    peak_flops: float | None = None  # one device's peak FLOP/s for MFU; None: GPU table (no MFU on CPU)
    profile_start_step: int = 3  # with profile=true: first traced step
    profile_steps: int = 3  # with profile=true: number of traced steps


@dataclass(kw_only=True)
class DistributedConfig:
    nproc_per_node: int | None = None  # None: one rank per GPU, else 2 on CPU (1 for parallelism=single)
    device: Device = Device.auto  # auto | cpu | cuda
    backend: Backend | None = None  # None: nccl on cuda, gloo on cpu
    timeout_s: float = 300.0  # collective timeout
    max_restarts: int = 0  # elastic restarts of all ranks after a rank fails
    max_requeues: int = 3  # SLURM: requeues after a pre-timeout signal or preemption (checkpoint, then requeue)
    threads_per_rank: int | None = None  # CPU intra-op threads; None: cores / local ranks


@dataclass(kw_only=True)
class DryRunTarget:
    """The job ``dry_run=true`` plans for: ``nodes x ranks_per_node`` ranks, each with ``device_memory_gib``."""

    nodes: int = 1
    ranks_per_node: int | None = None  # None: distributed.nproc_per_node, else visible GPUs, else 8 (cuda) / 2 (cpu)
    device: TargetDevice | None = None  # cuda | cpu; None: distributed.device as resolved on this machine
    device_memory_gib: float | None = None  # None: this machine's GPU, else 80 (cuda) or RAM / ranks per node (cpu)


@dataclass(kw_only=True)
class Config:
    model: Any = MISSING
    data: Any = MISSING
    parallelism: Any = MISSING
    optimizer: Any = MISSING
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = MISSING
    comm: Any = MISSING
    checkpoint: CheckpointConfig = MISSING
    ft: Any = MISSING  # fault tolerance across replica groups: none | torchft
    logger: dict[str, Any] = field(default_factory=dict)  # tracker name -> its config; logger=[wandb,mlflow]
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    profile: bool = False  # torch.profiler trace of monitor.profile_steps steps into <run dir>/profile/
    stage: int | None = None  # ZeRO/FSDP sharding stage, written top-level: `parallelism=zero stage=3`
    activation_checkpointing: RecomputeMode = RecomputeMode.none  # full: every block; selective: every n-th
    activation_checkpointing_every: int = 2  # n for selective: blocks 0, n, 2n, ... recompute their activations
    compile: bool = False  # torch.compile (ddp, fsdp, tensor, hybrid without pp, single; others warn and run eager)
    compile_scope: CompileScope = CompileScope.blocks  # blocks: each block; model: one graph
    compile_backend: str = "inductor"  # any torch.compile backend; aot_eager traces without generating kernels
    dry_run: bool = False  # validate for target.*, print predicted per-rank memory, exit without training
    target: DryRunTarget = field(default_factory=lambda: DryRunTarget())


# Schemas live in ``schema/<group>`` (not offered as options); each option's YAML extends one with
# ``defaults: [/schema/<group>/<name>@_here_, _self_]``.
SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"gpt": GPTConfig, "mlp": MLPConfig, "llama": LlamaConfig, "hf": HFConfig, "moe": MoEConfig},
    "data": {
        "stdlib": StdlibDataConfig,
        "synthetic": SyntheticDataConfig,
        "tokens": TokensDataConfig,
        "mix": MixDataConfig,
    },
    "parallelism": {
        "single": SingleConfig,
        "ddp": DDPConfig,
        "zero": ZeroConfig,
        "hybrid": HybridConfig,
    },
    "optimizer": {"adamw": AdamWConfig, "sgd": SGDConfig, "muon": MuonConfig},
    "precision": {"autocast": PrecisionConfig},
    "comm": {
        "ddp": DDPCommConfig,
        "cast": CastCommConfig,
        "powersgd": PowerSGDCommConfig,
        "topk": TopKCommConfig,
        "hierarchical": HierarchicalCommConfig,
        "diloco": DiLoCoCommConfig,
    },
    "checkpoint": {"dcp": CheckpointConfig},
    "ft": {"none": NoReplicaGroupsConfig, "torchft": TorchFTConfig},
    "logger": {
        "jsonl": JsonlTrackerConfig,
        "wandb": WandbTrackerConfig,
        "tensorboard": TensorBoardTrackerConfig,
        "mlflow": MlflowTrackerConfig,
    },
}

CONFIG_GROUPS = ("model", "data", "parallelism", "optimizer", "precision", "comm", "checkpoint", "ft", "logger")


def _stage_or(default: int, *, _root_: DictConfig) -> int:
    """``${stage_or:N}``: the top-level ``stage`` if set, else N (so ``parallelism=zero stage=3`` works)."""
    return _root_.stage if _root_.stage is not None else default


def _data_vocab(path: Any) -> int:
    """``${data_vocab:PATH}``: the vocabulary of the dataset at PATH, or of a mixture's sources (``data.sources``:
    the largest); 0 when one is unreadable: data validation, which runs first, reports why in one line."""
    from distrain.data.tokens import data_vocab_size

    if isinstance(path, Mapping):  # a mixture's sources, which must share their tokenizer (data=mix checks it)
        sizes = [data_vocab_size(source.get("path")) for source in path.values()]
        return max(sizes) if sizes and all(sizes) else 0
    return data_vocab_size(path) or 0


def register_configs() -> None:
    """Store the root schema and every group's base schemas in Hydra's ConfigStore (idempotent)."""
    if not OmegaConf.has_resolver("stage_or"):
        OmegaConf.register_new_resolver("stage_or", _stage_or)
    if not OmegaConf.has_resolver("data_vocab"):
        OmegaConf.register_new_resolver("data_vocab", _data_vocab)
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=node)
