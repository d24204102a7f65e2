"""Building one rank's run from the resolved config: model, strategy (which wraps or shards the model and builds
the optimizer), data, reporting, checkpoints and the logging window. Collectives: what the strategy's ``setup``
runs (process groups, parameter broadcast or sharding, a comm hook's groups) and, with ``checkpoint.async_save``,
the checkpointer's own process group."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.config.schema import TrainerConfig
from distrain.data.packing import mask_documents
from distrain.data.sampler import TrainBatches, sampler_for, token_windows
from distrain.data.validation import ValidationSets, validation_sets
from distrain.ft.config import has_replica_groups
from distrain.ft.replicas import ReplicaGroups
from distrain.launch.process_group import DistEnv
from distrain.models.spec import spec_of
from distrain.monitor.flops import peak_flops_per_device
from distrain.monitor.timing import Clock
from distrain.monitor.window import LogWindow
from distrain.optim import groups
from distrain.optim.checks import rules_of
from distrain.parallelism.base import Strategy, StrategyContext
from distrain.parallelism.compile import apply_compile
from distrain.parallelism.recompute import apply_activation_checkpointing
from distrain.trackers.reporter import RunReporter
from distrain.trainer.seeding import seed_everything

log = logging.getLogger("distrain.train")


@dataclass
class RankRun:
    """The components of one rank, built in dependency order and handed to the loop."""

    strategy: Strategy
    data: TrainBatches
    validation: ValidationSets
    reporter: RunReporter
    checkpointer: Checkpointer
    settings: TrainerConfig
    window: LogWindow
    model_parameters: int
    replica_groups: ReplicaGroups | None = None  # ft=torchft: this rank's side of the replica groups


def build(cfg: DictConfig, env: DistEnv, run_dir: str) -> RankRun:
    """Build model, strategy (which wraps or shards it and builds the optimizer), data, reporting, checkpoints."""
    settings = TrainerConfig(**cfg.trainer)
    seed_everything(settings.seed)
    torch.autograd.set_detect_anomaly(settings.detect_anomaly)
    model = instantiate(cfg.model)
    model_parameters = sum(p.numel() for p in model.parameters())
    flops_per_token = spec_of(model).flops_per_token(model, cfg.data.seq_len)
    roles = spec_of(model).parameter_roles(model)  # by the unwrapped model's names, which wrappers keep
    if env.is_main:
        optimizer_name = cfg.optimizer._target_.rsplit(".", 1)[-1]
        groups.announce(model, roles, rules_of(cfg.optimizer), optimizer_name, run_dir)
    # Before any strategy wraps the model: it changes no names, and recomputation then runs inside TP and FSDP.
    apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.activation_checkpointing_every)
    strategy = instantiate(cfg.parallelism)
    if cfg.compile and strategy.compile_unsupported:
        if env.is_main:
            log.warning(
                "compile=true ignored with parallelism=%s, running eagerly: %s",
                strategy.name,
                strategy.compile_unsupported,
            )
    elif cfg.compile:  # compiles lazily at the first forward, inside whatever the strategy wraps around it
        apply_compile(model, cfg.compile_scope, cfg.compile_backend)
    precision = instantiate(cfg.precision)
    comm = instantiate(cfg.comm)
    replica_groups = instantiate(cfg.ft) if has_replica_groups(cfg) else None
    if replica_groups is not None and comm.syncs_replica_groups:  # DiLoCo: the groups are its workers
        comm.sync_replica_groups(replica_groups)
    strategy.setup(
        model,
        StrategyContext(
            env=env,
            build_optimizer=partial(instantiate(cfg.optimizer), roles=roles),
            build_scheduler=partial(instantiate(cfg.scheduler), total_steps=settings.max_steps),
            precision=precision,
            comm=comm,
            grad_clip_norm=settings.grad_clip_norm,
            on_nonfinite=settings.on_nonfinite,
            micro_batch_size=cfg.data.micro_batch_size,
            grad_accum_steps=settings.grad_accum_steps,
            run_dir=run_dir,
            clock=Clock(env.device),
            replica_groups=replica_groups,
        ),
    )
    data, validation = build_data(
        cfg, settings, strategy.data_parallel, replica_groups, pin_memory=env.device.type == "cuda"
    )
    reporter = _reporter(cfg, env, run_dir, settings, replica_groups)
    checkpointer = instantiate(cfg.checkpoint)(
        run_dir=run_dir, config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    )
    # The steps the loop evaluates or checkpoints after, from the loop's own rules: a comm option that holds
    # updates back sends everything there.
    comm.set_schedule(
        lambda step: settings.evaluates_after(step) or checkpointer.due(step, final=step == settings.max_steps)
    )
    return RankRun(
        strategy=strategy,
        data=data,
        validation=validation,
        reporter=reporter,
        checkpointer=checkpointer,
        settings=settings,
        window=LogWindow(
            device=env.device,
            tokens_per_step=data.sampler.global_batch_size * cfg.data.seq_len,
            samples_per_step=data.sampler.global_batch_size,
            flops_per_token=flops_per_token,
            peak_flops=_peak_flops(env, precision.compute_dtype, cfg.monitor.peak_flops),
            straggler_threshold=cfg.monitor.straggler_threshold,
        ),
        model_parameters=model_parameters,
        replica_groups=replica_groups,
    )


def _reporter(
    cfg: DictConfig, env: DistEnv, run_dir: str, settings: TrainerConfig, replica_groups: ReplicaGroups | None
) -> RunReporter:
    """metrics.jsonl, summary.json and the trackers, on rank 0. Under ft=torchft every group's rank 0 writes its own
    metrics.jsonl; the trackers follow group 0's (the run's)."""
    tracked = replica_groups is None or replica_groups.group == 0
    return RunReporter(
        run_dir=run_dir,
        trackers={name: instantiate(tracker) for name, tracker in cfg.logger.items()} if tracked else {},
        enabled=env.is_main,
        max_steps=settings.max_steps,
        progress_bar=settings.progress_bar,
    )


def _peak_flops(env: DistEnv, compute_dtype: torch.dtype, configured: float | None) -> float | None:
    """One device's peak FLOP/s for MFU; None (said once, on rank 0) where it is unknown: CPUs, unlisted GPUs."""
    peak = peak_flops_per_device(env.device, compute_dtype, configured)
    if peak is None and env.is_main:
        log.info("mfu: not reported, the peak FLOP/s of this %s is unknown (set monitor.peak_flops)", env.device.type)
    return peak


def build_data(
    cfg: DictConfig,
    settings: TrainerConfig,
    data_parallel: tuple[int, int],
    replica_groups: ReplicaGroups | None = None,
    *,
    pin_memory: bool,
) -> tuple[TrainBatches, ValidationSets]:
    """This rank's training batches (its share of each global batch) and validation batches, for its position
    ``(dp_rank, dp_size)`` on the data-parallel axis.

    With replica groups the groups are the outer part of that axis for training; each group validates on the whole
    validation set (the one a plain job of all the ranks would use), so every group reports the job's validation
    loss whichever groups are alive."""
    corpus = instantiate(cfg.data.corpus)
    val_rank, val_size = data_parallel
    groups = replica_groups.count if replica_groups else 1
    dp_rank, dp_size = replica_groups.data_parallel(data_parallel) if replica_groups else data_parallel
    train_windows = token_windows(corpus.train, cfg.data.seq_len)
    sampler = sampler_for(
        train_windows,
        limit_batches=settings.overfit_batches,
        micro_batch_size=cfg.data.micro_batch_size,
        grad_accum_steps=settings.grad_accum_steps,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=settings.seed,
    )
    validation = validation_sets(
        corpus.val,
        cfg.data.seq_len,
        micro_batch_size=cfg.data.micro_batch_size,
        num_batches=settings.eval_batches,
        dp_rank=val_rank,
        dp_size=val_size,
        replica_groups=groups,
    )
    # Checked before any rank starts: masking is asked only of data with an end-of-document id.
    masking = partial(mask_documents, eos_id=corpus.eos_id) if cfg.data.get("document_masking") else None
    train = TrainBatches(
        train_windows, sampler, prefetch=cfg.data.get("prefetch", False), pin_memory=pin_memory, transform=masking
    )
    return train, validation if masking is None else validation.transformed(masking)
