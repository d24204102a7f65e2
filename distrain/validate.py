"""Checks of a composed config that types alone cannot express, run once before any rank starts.

Each failure is a ``ConfigError`` that train.py prints as one line naming the key, the value and what is
allowed, then exits with status 2.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from distrain.checkpoint.checkpointer import checkpoint_problem, checkpoint_world_size
from distrain.dist import resolve_device_type
from distrain.launch import default_nproc_per_node, inside_launcher
from distrain.parallelism.compile import backend_problem
from distrain.precision.policy import autocast_supported

# Strategies that take a sharding stage (top-level `stage=` or `parallelism.stage=`), and the stages each allows.
STAGES: dict[str, tuple[int, ...]] = {"zero": (1, 2, 3), "fsdp": (2, 3), "hybrid": (2, 3)}


class ConfigError(ValueError):
    """A configuration value that is not allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r} is not allowed: {allowed}")


@dataclass(frozen=True)
class Target:
    """The job a dry run validates for instead of this machine: ``nodes x ranks_per_node`` ranks of ``device_type``.

    ``ranks_key`` is the config key the ranks per node came from (``target.ranks_per_node`` or
    ``distributed.nproc_per_node``), so errors about it name what the user wrote.
    """

    nodes: int
    ranks_per_node: int
    device_type: str
    device_memory_bytes: int
    ranks_key: str = "target.ranks_per_node"

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class LaunchPlan:
    """What validation resolved for starting the ranks."""

    device_type: str
    nproc_per_node: int


def _check(cfg: DictConfig, key: str, ok: Callable[[Any], bool], allowed: str) -> None:
    value = OmegaConf.select(cfg, key)
    if not ok(value):
        raise ConfigError(key, value, allowed)


def _at_least(minimum: float) -> Callable[[Any], bool]:
    return lambda value: value is not None and value >= minimum


def _positive(value: Any) -> bool:
    return value is not None and value > 0


def validate(cfg: DictConfig, target: Target | None = None) -> LaunchPlan:
    """Raise ``ConfigError`` for the first invalid value; return the resolved launch plan.

    With ``target`` (a dry run) the world size, ranks per node and device type are the target's, and the checks
    that are about this machine (a GPU visible here, how many, autocast probed on it) are skipped; every other
    check is the one the real launch runs.
    """
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as err:  # interpolation or missing-value errors carry the key in their message
        key = getattr(err, "full_key", None) or "config"
        raise ConfigError(key, "?", str(err).splitlines()[0]) from None

    device_type = target.device_type if target else resolve_device_type(cfg.distributed.device)
    if device_type == "cuda" and not target and not torch.cuda.is_available():
        raise ConfigError("distributed.device", "cuda", "no CUDA device is visible here; use auto or cpu")
    if cfg.distributed.backend == "nccl" and device_type != "cuda":
        raise ConfigError("distributed.backend", "nccl", "nccl needs CUDA devices; use gloo on cpu")
    _check(
        cfg,
        "distributed.nproc_per_node",
        lambda v: v is None or v >= 1,
        "an integer >= 1 (or null: automatic)",
    )
    _check(cfg, "distributed.timeout_s", _positive, "a number of seconds > 0")
    _check(cfg, "distributed.max_restarts", _at_least(0), "an integer >= 0")
    _check(cfg, "distributed.max_requeues", _at_least(0), "an integer >= 0")
    _check(cfg, "distributed.threads_per_rank", lambda v: v is None or v >= 1, "an integer >= 1 (or null)")

    nproc = cfg.distributed.nproc_per_node
    if target:
        nproc = target.ranks_per_node
        if cfg.parallelism.name == "single" and target.world_size > 1:
            key, value = ("target.nodes", target.nodes) if target.nodes > 1 else (target.ranks_key, nproc)
            raise ConfigError(key, value, "parallelism=single runs one rank; use parallelism=ddp for more")
    elif cfg.parallelism.name == "single":
        if nproc not in (None, 1) or (inside_launcher() and int(os.environ.get("WORLD_SIZE", "1")) > 1):
            raise ConfigError(
                "distributed.nproc_per_node",
                nproc,
                "parallelism=single runs one rank; use parallelism=ddp for more",
            )
        nproc = 1
    elif nproc is None:
        nproc = default_nproc_per_node(device_type)
    if device_type == "cuda" and not target and nproc > torch.cuda.device_count():
        raise ConfigError("distributed.nproc_per_node", nproc, f"at most the {torch.cuda.device_count()} visible GPUs")

    _validate_training(cfg)
    _validate_model_and_data(cfg)
    # A cuda target without a GPU here is assumed to be a current GPU (bf16 and fp16 autocast).
    probe_here = not target or device_type == "cpu" or torch.cuda.is_available()
    supported, reason = autocast_supported(device_type, cfg.precision.compute_dtype) if probe_here else (True, "")
    if not supported:
        raise ConfigError("precision", cfg.precision.name, f"not available on {device_type}: {reason}")

    _check(cfg, "comm.bucket_cap_mb", _positive, "a size in MiB > 0")
    if target:
        world_size = target.world_size
    else:
        world_size = int(os.environ["WORLD_SIZE"]) if inside_launcher() else nproc
    _validate_checkpoint(cfg, world_size)
    _check(cfg, "activation_checkpointing_every", _at_least(1), "an integer >= 1 (every n-th block)")
    if cfg.compile:
        problem = backend_problem(cfg.compile_backend, device_type)
        if problem:
            raise ConfigError("compile_backend", cfg.compile_backend, problem)
    _validate_comm(cfg, world_size)
    _validate_sharding(cfg, device_type)
    if cfg.parallelism.name == "pipeline":
        _validate_pipeline(cfg, world_size)
    if cfg.parallelism.name == "tensor":
        _validate_tensor(cfg, world_size)
    if cfg.parallelism.name == "hybrid":
        _validate_hybrid(cfg, world_size)
    return LaunchPlan(device_type=device_type, nproc_per_node=nproc)


def _validate_training(cfg: DictConfig) -> None:
    """Steps, logging, clipping, the optimizer, the schedule and the monitor."""
    for key in ("trainer.max_steps", "trainer.grad_accum_steps", "trainer.log_every", "trainer.eval_batches"):
        _check(cfg, key, _at_least(1), "an integer >= 1")
    _check(cfg, "trainer.eval_every", _at_least(0), "an integer >= 0 (0: only at the end)")
    _check(cfg, "trainer.grad_clip_norm", _at_least(0), "a number >= 0 (0: no clipping)")
    if cfg.trainer.on_nonfinite == "skip" and cfg.parallelism.name == "zero":
        raise ConfigError("trainer.on_nonfinite", "skip", "stop with parallelism=zero (DeepSpeed applies every step)")

    _check(cfg, "optimizer.lr", _positive, "a learning rate > 0")
    _check(cfg, "optimizer.weight_decay", _at_least(0), "a number >= 0")
    if "momentum" in cfg.optimizer:
        _check(cfg, "optimizer.momentum", lambda v: 0 <= v < 1, "a number in [0, 1)")
        if cfg.optimizer.nesterov and cfg.optimizer.momentum == 0:
            raise ConfigError(
                "optimizer.nesterov", True, "false when optimizer.momentum is 0 (Nesterov needs momentum)"
            )
    if "betas" in cfg.optimizer:
        _check(
            cfg,
            "optimizer.betas",
            lambda v: len(v) == 2 and all(0 <= beta < 1 for beta in v),
            "two numbers in [0, 1), e.g. [0.9,0.95]",
        )
        _check(cfg, "optimizer.eps", _positive, "a number > 0")
    _check(cfg, "scheduler.warmup_steps", _at_least(0), "an integer >= 0")
    _check(cfg, "scheduler.min_lr_ratio", lambda v: 0 <= v <= 1, "a fraction in [0, 1]")

    _check(cfg, "monitor.straggler_threshold", _positive, "a fraction > 0 (0.5: 50% slower than the median)")
    _check(cfg, "monitor.peak_flops", lambda v: v is None or v > 0, "FLOP/s > 0, or null (measured)")
    _check(cfg, "monitor.profile_start_step", _at_least(0), "an integer >= 0")
    _check(cfg, "monitor.profile_steps", _at_least(1), "an integer >= 1")


def _validate_model_and_data(cfg: DictConfig) -> None:
    """Model sizes, the data's shape, and the data against the model (sequence length, largest token id)."""
    for key in ("model.d_model", "model.n_layers", "model.vocab_size", "model.max_seq_len"):
        _check(cfg, key, _at_least(1), "an integer >= 1")
    _check(cfg, "data.micro_batch_size", _at_least(1), "an integer >= 1 (sequences per rank per micro-step)")
    _check(
        cfg,
        "data.seq_len",
        lambda v: 1 <= v <= cfg.model.max_seq_len,
        f"1..model.max_seq_len ({cfg.model.max_seq_len})",
    )
    _check(cfg, "data.corpus.val_fraction", lambda v: 0 < v <= 0.5, "a fraction in (0, 0.5]")
    for key in ("max_bytes", "num_tokens"):
        if key in cfg.data.corpus:
            _check(cfg, f"data.corpus.{key}", _at_least(1), "an integer >= 1")
    if "vocab_size" in cfg.data.corpus:
        _check(
            cfg,
            "data.corpus.vocab_size",
            lambda v: 2 <= v <= cfg.model.vocab_size,
            f"2..model.vocab_size ({cfg.model.vocab_size})",
        )

    for key in ("model.mlp_ratio", "model.hidden"):
        if key.split(".")[1] in cfg.model:
            _check(cfg, key, _at_least(1), "an integer >= 1")
    if "dropout" in cfg.model:
        _check(cfg, "model.dropout", lambda v: 0 <= v < 1, "a probability in [0, 1)")
    largest_token = largest_token_id(cfg.data.corpus)
    if largest_token >= cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"more than the data's largest token id ({largest_token})",
        )
    if "n_heads" in cfg.model:
        _check(
            cfg,
            "model.n_heads",
            lambda v: v >= 1 and cfg.model.d_model % v == 0,
            f"a divisor of model.d_model ({cfg.model.d_model})",
        )


def _validate_checkpoint(cfg: DictConfig, world_size: int) -> None:
    """Periods, paths, the checkpoint to resume from (its files, and for zero its world size), async saves."""
    _check(cfg, "checkpoint.every_n_steps", _at_least(0), "an integer >= 0 (0: no periodic checkpoints)")
    _check(cfg, "checkpoint.dir", lambda v: v is None or not Path(v).is_file(), "a directory (this path is a file)")
    if "path" in cfg.logger:
        _check(cfg, "logger.path", lambda v: bool(v) and not Path(v).is_dir(), "a file path (not a directory)")
    _check(cfg, "checkpoint.keep_last", _at_least(0), "an integer >= 0 (0: keep all)")
    resume = cfg.checkpoint.resume
    problem = None if resume in ("never", "auto") else checkpoint_problem(Path(resume))
    if problem:
        raise ConfigError("checkpoint.resume", resume, f"never, auto, or a valid step_* checkpoint ({problem})")
    _check(cfg, "checkpoint.emergency_timeout_s", _positive, "a number of seconds > 0")
    if cfg.checkpoint.async_save and cfg.parallelism.name == "zero":
        raise ConfigError("checkpoint.async_save", True, "false with parallelism=zero (DeepSpeed saves synchronously)")
    saved_world_size = None if resume in ("never", "auto") else checkpoint_world_size(Path(resume))
    if cfg.parallelism.name == "zero" and saved_world_size not in (None, world_size):
        raise ConfigError(
            "checkpoint.resume",
            resume,
            f"a zero checkpoint saved by {world_size} ranks (it was saved by {saved_world_size}; ddp and fsdp "
            "checkpoints reshard, zero ones do not)",
        )


def largest_token_id(corpus: DictConfig) -> int:
    """The largest token id a corpus can hold, known from its config without reading it."""
    return corpus.vocab_size - 1 if "vocab_size" in corpus else 255  # the stdlib corpus is bytes


def _validate_comm(cfg: DictConfig, world_size: int) -> None:
    """Compression and hierarchical all-reduce are DDP communication hooks: only parallelism=ddp has them."""
    comm = cfg.comm
    if comm.name != "default" and cfg.parallelism.name != "ddp":
        raise ConfigError(
            "comm",
            comm.name,
            f"comm=default with parallelism={cfg.parallelism.name}; comm={comm.name} is a DDP communication hook "
            "and combines only with parallelism=ddp (zero, fsdp, pipeline, tensor and single have no DDP hooks)",
        )
    if comm.name == "powersgd" or "start_iter" in comm:
        _check(cfg, "comm.rank", _at_least(1), "an integer >= 1 (rank of the gradient approximation)")
        _check(cfg, "comm.start_iter", _at_least(2), "an integer >= 2 (DDP rebuilds its buckets after step 1)")
        _check(cfg, "comm.min_compression_rate", _positive, "a number > 0")
    if "density" in comm:
        _check(cfg, "comm.density", lambda v: v is not None and 0 < v <= 1, "a fraction in (0, 1]")
        _check(cfg, "comm.warmup_steps", _at_least(0), "an integer >= 0")
        _check(
            cfg,
            "comm.warmup_start_density",
            lambda v: v is not None and comm.density <= v <= 1,
            f"a fraction in [comm.density ({comm.density}), 1]",
        )
        _check(cfg, "comm.momentum", lambda v: v is not None and 0 <= v < 1, "a number in [0, 1)")
        uses_momentum = cfg.optimizer._target_.endswith(".sgd") and cfg.optimizer.momentum == 0
        if comm.momentum > 0 and not uses_momentum:
            raise ConfigError(
                "comm.momentum",
                comm.momentum,
                "0 unless optimizer=sgd optimizer.momentum=0 (momentum correction moves momentum into the compressor)",
            )
    if "ranks_per_node" in comm and comm.ranks_per_node is not None:
        _check(
            cfg,
            "comm.ranks_per_node",
            lambda v: v >= 1 and world_size % v == 0,
            f"a divisor of the world size ({world_size}), or null for the launcher's ranks per node",
        )


def _validate_sharding(cfg: DictConfig, device_type: str) -> None:
    """Stages, offload and precision for the sharded strategies (zero, fsdp)."""
    strategy = cfg.parallelism.name
    takers = ", ".join(f"parallelism={name} ({'/'.join(map(str, st))})" for name, st in STAGES.items())
    if strategy not in STAGES:
        if cfg.stage is not None:
            raise ConfigError("stage", cfg.stage, f"parallelism={strategy} takes no stage; stages apply to {takers}")
        return
    stage = cfg.parallelism.stage
    key = "stage" if cfg.stage is not None else "parallelism.stage"
    if stage not in STAGES[strategy]:
        allowed = " or ".join(map(str, STAGES[strategy]))
        raise ConfigError(key, stage, f"parallelism={strategy} takes stage {allowed}")
    if strategy == "fsdp" and cfg.parallelism.cpu_offload and device_type != "cuda":
        raise ConfigError(
            "parallelism.cpu_offload", True, "offload moves shards from GPU to CPU memory; on cpu they are there"
        )
    if strategy == "zero":
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError("parallelism", "zero", "DeepSpeed is not installed (pip install deepspeed)")
        for option in ("offload_optimizer", "offload_param"):
            if cfg.parallelism[option] != "none" and device_type != "cuda":
                raise ConfigError(
                    f"parallelism.{option}", cfg.parallelism[option], "none on cpu (offload moves GPU state to CPU)"
                )
        if cfg.parallelism.offload_param != "none" and stage != 3:
            raise ConfigError("parallelism.offload_param", cfg.parallelism.offload_param, "none below stage 3")
        if device_type == "cpu" and cfg.precision.compute_dtype == "float16":
            raise ConfigError("precision", cfg.precision.name, "fp32 or bf16 with DeepSpeed on cpu (no fp16 there)")
        for size in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            _check(cfg, f"parallelism.{size}", _positive, "a number of elements > 0")
        _check(cfg, "parallelism.stage3_max_live_parameters", _positive, "a number of elements > 0")
        _check(cfg, "parallelism.stage3_param_persistence_threshold", _at_least(0), "a number of elements >= 0")


def _validate_pipeline(cfg: DictConfig, world_size: int) -> None:
    """Schedule, stage count against blocks, micro-batch divisibility and split points; ``world_size``: the ranks
    of one pipeline."""
    pp = cfg.parallelism
    _check(cfg, "parallelism.microbatches", _at_least(1), "an integer >= 1")
    virtual = pp.virtual_stages if pp.schedule == "interleaved" else 1
    if pp.schedule == "interleaved":
        _check(cfg, "parallelism.virtual_stages", _at_least(2), "an integer >= 2 with schedule=interleaved")
        if pp.microbatches % world_size:
            raise ConfigError(
                "parallelism.microbatches", pp.microbatches, f"a multiple of the {world_size} ranks with interleaved"
            )
    stages = world_size * virtual
    if stages > cfg.model.n_layers:
        raise ConfigError(
            "parallelism",
            cfg.parallelism.name,
            f"at most model.n_layers ({cfg.model.n_layers}) stages; {world_size} ranks x {virtual} virtual stages "
            f"= {stages}",
        )
    sequences = cfg.data.micro_batch_size * cfg.trainer.grad_accum_steps
    if sequences % pp.microbatches:
        raise ConfigError(
            "parallelism.microbatches",
            pp.microbatches,
            f"a divisor of the {sequences} sequences per step (data.micro_batch_size x trainer.grad_accum_steps)",
        )
    points = list(pp.split_points)
    increasing = points == sorted(set(points)) and all(0 < point < cfg.model.n_layers for point in points)
    if points and (len(points) != stages - 1 or not increasing):
        raise ConfigError(
            "parallelism.split_points",
            points,
            f"{stages - 1} increasing block indices in 1..{cfg.model.n_layers - 1} (empty: balanced)",
        )
    recompute = list(pp.activation_checkpointing)
    if any(not 0 <= stage < stages for stage in recompute):
        raise ConfigError(
            "parallelism.activation_checkpointing", recompute, f"stage indices in 0..{stages - 1} (empty: none)"
        )
    if cfg.precision.compute_dtype == "float16":
        raise ConfigError(
            "precision", cfg.precision.name, f"fp32 or bf16 with parallelism={cfg.parallelism.name} (no loss scaler)"
        )
    if cfg.trainer.on_nonfinite == "skip":
        raise ConfigError("trainer.on_nonfinite", "skip", f"stop with parallelism={cfg.parallelism.name} pipelines")
    if cfg.checkpoint.async_save:
        raise ConfigError("checkpoint.async_save", True, f"false with parallelism={cfg.parallelism.name}")


def _validate_tensor(cfg: DictConfig, world_size: int) -> None:
    """Heads and MLP width must split evenly over the ranks."""
    if "n_heads" not in cfg.model:
        raise ConfigError("model", cfg.model._target_.rsplit(".", 1)[1], "a model with attention (gpt_*) for tensor")
    if cfg.model.n_heads % world_size:
        raise ConfigError(
            "model.n_heads", cfg.model.n_heads, f"a multiple of the {world_size} tensor-parallel ranks (tp)"
        )
    if cfg.model.mlp_ratio * cfg.model.d_model % world_size:
        raise ConfigError(
            "model.mlp_ratio", cfg.model.mlp_ratio, f"mlp_ratio x d_model divisible by {world_size} ranks"
        )
    if cfg.checkpoint.async_save:
        raise ConfigError("checkpoint.async_save", True, f"false with parallelism={cfg.parallelism.name}")
    if cfg.parallelism.sequence_parallel and cfg.data.seq_len % world_size:
        raise ConfigError(
            "data.seq_len",
            cfg.data.seq_len,
            f"a multiple of the {world_size} tensor-parallel ranks with sequence_parallel",
        )
    if cfg.parallelism.loss_parallel and cfg.model.vocab_size % world_size:
        raise ConfigError(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"a multiple of the {world_size} tensor-parallel ranks with loss_parallel",
        )


def _validate_hybrid(cfg: DictConfig, world_size: int) -> None:
    """Degrees against the world size, then the tensor and pipeline rules for their own axes."""
    hybrid = cfg.parallelism
    _check(cfg, "parallelism.tp", _at_least(1), "an integer >= 1")
    _check(cfg, "parallelism.pp", _at_least(1), "an integer >= 1")
    if hybrid.dp != -1:
        _check(cfg, "parallelism.dp", _at_least(1), "an integer >= 1, or -1 for world size / (tp x pp)")
    dp = world_size // (hybrid.tp * hybrid.pp) if hybrid.dp == -1 else hybrid.dp
    if dp * hybrid.tp * hybrid.pp != world_size or dp < 1:
        key, value = ("parallelism.dp", hybrid.dp) if hybrid.dp != -1 else ("parallelism.tp", hybrid.tp)
        shown = "world size / (tp x pp)" if hybrid.dp == -1 else str(hybrid.dp)
        raise ConfigError(
            key,
            value,
            f"degrees whose product is the world size {world_size}: dp x tp x pp = {shown} x {hybrid.tp} x {hybrid.pp}",
        )
    if "n_heads" not in cfg.model:
        raise ConfigError("model", cfg.model._target_.rsplit(".", 1)[1], "a model with attention (gpt_*) for hybrid")
    if cfg.precision.compute_dtype == "float16":
        raise ConfigError("precision", cfg.precision.name, "fp32 or bf16 with parallelism=hybrid (no loss scaler)")
    if hybrid.tp > 1:
        _validate_tensor(cfg, hybrid.tp)
    if hybrid.pp == 1 and hybrid.activation_checkpointing:
        raise ConfigError(
            "parallelism.activation_checkpointing", list(hybrid.activation_checkpointing), "[] with pp=1 (per stage)"
        )
    if hybrid.pp > 1:
        _validate_pipeline(cfg, hybrid.pp)
        for option in ("sequence_parallel", "loss_parallel"):
            if hybrid[option]:
                raise ConfigError(f"parallelism.{option}", True, "false with parallelism.pp > 1 (whole models only)")
    if cfg.checkpoint.async_save:
        raise ConfigError("checkpoint.async_save", True, "false with parallelism=hybrid")
