"""Checks of a composed config that types alone cannot express, run once before any rank starts.

Each failure is a ``ConfigError`` that train.py prints as one line naming the key, the value and what is
allowed, then exits with status 2.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from distrain.artifacts.outputs import check_writable
from distrain.artifacts.token_dataset import PendingChecksums, inspect_token_dataset
from distrain.checkpoint.steps import checkpoint_problem, checkpoint_world_size
from distrain.config.checks import ConfigError, at_least, check, positive  # noqa: F401 (ConfigError: re-exported)
from distrain.config.global_batch import derive_accumulation, validate_data_fits
from distrain.config.options import Placement, own_checks
from distrain.data.mixture import source_settings
from distrain.data.mixture_checks import check_mixture
from distrain.data.packing_checks import check_document_masking
from distrain.data.token_format import DataError
from distrain.data.tokens import largest_token_id as dataset_largest_token_id
from distrain.errors import ArtifactError
from distrain.ft.config import launcher_count, replica_group_count
from distrain.launch.process_group import resolve_device_type
from distrain.launch.ranks import default_nproc_per_node, inside_launcher
from distrain.optim.checks import validate_optimizer
from distrain.parallelism.capabilities import capabilities_of
from distrain.parallelism.checks import (
    adopt_renamed_keys,
    meta_model,
    spec_for_config,
    validate_sharding,
)
from distrain.parallelism.compile import backend_problem
from distrain.precision.policy import autocast_supported
from distrain.trackers.base import TrackerSetupError

log = logging.getLogger(__name__)


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
    world_size: int  # all ranks of the job (every node's)

    @property
    def start_method(self) -> str:
        """How ``run_ranks`` starts this node's ranks: CPU ranks fork from a server that imported torch and
        distrain once; CUDA ranks start as fresh interpreters (CUDA must not be forked)."""
        return "forkserver" if self.device_type == "cpu" else "spawn"


def validate(cfg: DictConfig, target: Target | None = None) -> LaunchPlan:
    """Raise ``ConfigError`` for the first invalid value; return the resolved launch plan.

    With ``target`` (a dry run) the world size, ranks per node and device type are the target's, and the checks
    that are about this machine (a GPU visible here, how many, autocast probed on it) are skipped; every other
    check is the one the real launch runs.
    """
    checksums = _validate_dataset(cfg)  # first: data=tokens reads the model's vocabulary from the dataset
    try:
        plan = _validate_config(cfg, target)
        checksums.wait()
    except DataError as err:
        raise ConfigError(checksums.key, checksums.value, f"a readable dataset: {err}") from None
    finally:
        checksums.cancel()  # after a refusal nobody waits for them: the process exits at once
    return plan


def _validate_config(cfg: DictConfig, target: Target | None) -> LaunchPlan:
    """Every check but the dataset's (``validate``)."""
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
    check(
        cfg,
        "distributed.nproc_per_node",
        lambda v: v is None or v >= 1,
        "an integer >= 1 (or null: automatic)",
    )
    check(cfg, "distributed.timeout_s", positive, "a number of seconds > 0")
    check(cfg, "distributed.max_restarts", at_least(0), "an integer >= 0")
    check(cfg, "distributed.max_requeues", at_least(0), "an integer >= 0")
    check(cfg, "distributed.threads_per_rank", lambda v: v is None or v >= 1, "an integer >= 1 (or null)")
    if not target:  # a dry run plans memory on another machine; its trackers are that machine's business
        validate_trackers(cfg)

    nproc = _ranks_per_node(cfg, target, device_type)
    _validate_training(cfg)
    model = _validate_model_and_data(cfg)
    for note in validate_optimizer(cfg, model):
        log.warning(note)
    # A cuda target without a GPU here is assumed to be a current GPU (bf16 and fp16 autocast).
    probe_here = not target or device_type == "cpu" or torch.cuda.is_available()
    supported, reason = autocast_supported(device_type, cfg.precision.compute_dtype) if probe_here else (True, "")
    if not supported:
        raise ConfigError("precision", cfg.precision.name, f"not available on {device_type}: {reason}")

    if target:
        world_size = target.world_size
    else:
        world_size = int(os.environ["WORLD_SIZE"]) if inside_launcher() else nproc * launcher_count(cfg)
    _validate_checkpoint(cfg, world_size)
    check(cfg, "activation_checkpointing_every", at_least(1), "an integer >= 1 (every n-th block)")
    if cfg.compile:
        problem = backend_problem(cfg.compile_backend, device_type)
        if problem:
            raise ConfigError("compile_backend", cfg.compile_backend, problem)
    # Under an outer launcher the ranks of a node are its LOCAL_WORLD_SIZE, as the strategy will see them.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", nproc)) if inside_launcher() and not target else nproc
    for note in adopt_renamed_keys(cfg):
        log.warning(note)
    derive_accumulation(cfg, world_size, local)  # before the pipeline checks, which divide the step's sequences
    validate_sharding(cfg)
    placement = Placement(
        world_size, local, device_type, planning=target is not None, replica_groups=replica_group_count(cfg)
    )
    for note in own_checks(cfg, placement):  # each option's check_config, distrain's or the user's own
        log.warning(note)
    validate_data_fits(cfg, world_size, local)  # after the degrees are known to be valid
    return LaunchPlan(device_type=device_type, nproc_per_node=nproc, world_size=world_size)


def _ranks_per_node(cfg: DictConfig, target: Target | None, device_type: str) -> int:
    """The ranks this launch starts per node: the target's, 1 for ``parallelism=single``, else
    ``distributed.nproc_per_node`` or the device's default; refused where they cannot run."""
    nproc = cfg.distributed.nproc_per_node
    if target:
        nproc = target.ranks_per_node
        if capabilities_of(cfg.parallelism).one_rank and target.world_size > 1:
            key, value = ("target.nodes", target.nodes) if target.nodes > 1 else (target.ranks_key, nproc)
            raise ConfigError(key, value, "parallelism=single runs one rank; use parallelism=ddp for more")
    elif capabilities_of(cfg.parallelism).one_rank:
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
    return nproc


def _validate_training(cfg: DictConfig) -> None:
    """Steps, logging, clipping, the optimizer, the schedule and the monitor."""
    for key in ("trainer.max_steps", "trainer.grad_accum_steps", "trainer.log_every", "trainer.eval_batches"):
        check(cfg, key, at_least(1), "an integer >= 1")
    check(cfg, "trainer.eval_every", at_least(0), "an integer >= 0 (0: only at the end)")
    check(cfg, "trainer.grad_clip_norm", at_least(0), "a number >= 0 (0: no clipping)")
    check(cfg, "trainer.overfit_batches", at_least(0), "an integer >= 0 (0: the whole dataset)")
    if cfg.trainer.on_nonfinite == "skip" and not capabilities_of(cfg.parallelism).can_skip_step:
        raise ConfigError(
            "trainer.on_nonfinite",
            "skip",
            f"stop with parallelism={cfg.parallelism.name} (it applies every step; it cannot skip one)",
        )

    if "momentum" in cfg.optimizer:
        check(cfg, "optimizer.momentum", lambda v: 0 <= v < 1, "a number in [0, 1)")
        if cfg.optimizer.nesterov and cfg.optimizer.momentum == 0:
            raise ConfigError(
                "optimizer.nesterov", True, "false when optimizer.momentum is 0 (Nesterov needs momentum)"
            )
    if "betas" in cfg.optimizer:
        check(
            cfg,
            "optimizer.betas",
            lambda v: len(v) == 2 and all(0 <= beta < 1 for beta in v),
            "two numbers in [0, 1), e.g. [0.9,0.95]",
        )
        check(cfg, "optimizer.eps", positive, "a number > 0")

    check(cfg, "monitor.straggler_threshold", positive, "a fraction > 0 (0.5: 50% slower than the median)")
    check(
        cfg,
        "monitor.peak_flops",
        lambda v: v is None or v > 0,
        "FLOP/s > 0, or null (a GPU's datasheet peak; none on CPU)",
    )
    check(cfg, "monitor.profile_start_step", at_least(0), "an integer >= 0")
    check(cfg, "monitor.profile_steps", at_least(1), "an integer >= 1")


def _validate_model_and_data(cfg: DictConfig) -> nn.Module | None:
    """Model sizes, the data's shape, the data against the model (sequence length, largest token id), and that the
    model builds (on the meta device); returns that meta model (None: it cannot be built on the meta device). Keys
    a model's config lacks are not checked."""
    model_cfg = cfg.model
    for key in ("vocab_size", "max_seq_len"):  # the two keys every model config may have (the data reads them)
        if model_cfg.get(key) is not None:
            check(cfg, f"model.{key}", at_least(1), "an integer >= 1")
    check(cfg, "data.micro_batch_size", at_least(1), "an integer >= 1 (sequences per rank per micro-step)")
    max_seq_len = model_cfg.get("max_seq_len") or cfg.data.seq_len
    check(cfg, "data.seq_len", lambda v: 1 <= v <= max_seq_len, f"1..model.max_seq_len ({max_seq_len})")
    if "val_fraction" in cfg.data.corpus:
        check(cfg, "data.corpus.val_fraction", lambda v: 0 < v <= 0.5, "a fraction in (0, 0.5]")
    for key in ("max_bytes", "num_tokens"):
        if key in cfg.data.corpus:
            check(cfg, f"data.corpus.{key}", at_least(1), "an integer >= 1")
    vocab_size = model_cfg.get("vocab_size")
    if "vocab_size" in cfg.data.corpus and vocab_size:
        check(cfg, "data.corpus.vocab_size", lambda v: 2 <= v <= vocab_size, f"2..model.vocab_size ({vocab_size})")

    family = spec_for_config(cfg)
    if family.check_config:
        family.check_config(cfg)  # the family's own keys (heads, widths, ...), next to its model
    check_document_masking(cfg, family)
    largest_token = largest_token_id(cfg.data.corpus)
    if vocab_size and largest_token >= vocab_size:
        raise ConfigError(
            "model.vocab_size",
            vocab_size,
            f"at least {largest_token + 1}, more than the data's largest token id ({largest_token})",
        )
    built = meta_model(cfg, strict=False)  # the constructor's own refusals (bad sizes, unknown keys), before any rank
    return built[0] if built else None


def _validate_checkpoint(cfg: DictConfig, world_size: int) -> None:
    """Periods, paths, the checkpoint to resume from (its files, and for zero its world size), async saves."""
    check(cfg, "checkpoint.every_n_steps", at_least(0), "an integer >= 0 (0: no periodic checkpoints)")
    if cfg.checkpoint.dir:
        try:
            check_writable(cfg.checkpoint.dir, directory=True)
        except ArtifactError as err:
            raise ConfigError("checkpoint.dir", cfg.checkpoint.dir, f"a writable directory ({err})") from None
    check(cfg, "checkpoint.keep_last", at_least(0), "an integer >= 0 (0: keep all)")
    resume = cfg.checkpoint.resume
    problem = None if resume in ("never", "auto") else checkpoint_problem(Path(resume))
    if problem:
        raise ConfigError("checkpoint.resume", resume, f"never, auto, or a valid step_* checkpoint ({problem})")
    check(cfg, "checkpoint.emergency_timeout_s", positive, "a number of seconds > 0")
    strategy = capabilities_of(cfg.parallelism)
    if cfg.checkpoint.async_save and not strategy.async_save:
        allowed = f"false with parallelism={cfg.parallelism.name} (its saves are synchronous)"
        raise ConfigError("checkpoint.async_save", True, allowed)
    saved_world_size = None if resume in ("never", "auto") else checkpoint_world_size(Path(resume))
    if not strategy.reshards_on_resume and saved_world_size not in (None, world_size):
        raise ConfigError(
            "checkpoint.resume",
            resume,
            f"a {cfg.parallelism.name} checkpoint saved by {world_size} ranks (it was saved by {saved_world_size}; "
            f"ddp and fsdp checkpoints reshard, {cfg.parallelism.name} ones do not)",
        )


def largest_token_id(corpus: DictConfig) -> int:
    """The largest token id a corpus can hold, known from its config (or a dataset's index) without reading it."""
    if "path" in corpus:
        return dataset_largest_token_id(corpus.path)
    if "sources" in corpus:  # a mixture: its sources' largest
        return max(dataset_largest_token_id(path) for path, _ in source_settings(corpus.sources).values())
    return corpus.vocab_size - 1 if "vocab_size" in corpus else 255  # the stdlib corpus is bytes


PATH_KEYS = ("data.path", "model.name_or_path", "model.init_from")  # each tracker names its own (absolute_paths)


def validate_trackers(cfg: DictConfig) -> None:
    """Each selected tracker's own check (its package, its URI or path), as ``logger.<name>.<key>``."""
    for name, tracker_cfg in cfg.logger.items():
        try:
            instantiate(tracker_cfg).check()  # constructors only keep their settings: nothing starts here
        except TrackerSetupError as err:
            key = f"logger.{name}.{err.key}" if err.key else "logger"
            raise ConfigError(key, err.value, err.allowed) from None


def make_paths_absolute(cfg: DictConfig) -> None:
    """Make the relative paths of ``PATH_KEYS`` and of each tracker's ``absolute_paths`` absolute (from this
    process's directory), in place: the run's saved config (each checkpoint's config.yaml) then names the same files
    wherever ``export`` or ``generate`` runs, and a requeued job finds the same tracker stores."""
    sources = cfg.data.get("sources") if "sources" in cfg.data.keys() else None
    for key in (*PATH_KEYS, *(f"data.sources.{name}.path" for name in sources or ())):
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            OmegaConf.update(cfg, key, str(Path(value).expanduser().resolve()), merge=False)
    for name, tracker_cfg in cfg.logger.items():
        located = getattr(instantiate(tracker_cfg), "absolute_paths", None)  # constructors only keep settings
        for key, value in (located() if callable(located) else {}).items():
            OmegaConf.update(cfg, f"logger.{name}.{key}", value, merge=False)


def _validate_dataset(cfg: DictConfig) -> PendingChecksums:
    """A dataset on disk (``data.path``): readable, its shards whole, its tokenizer readable; one line naming
    ``data.path`` and the file otherwise. With ``data.verify_checksums`` the shards' checksums are checked on a
    thread while the rest of the config is validated (the returned ``PendingChecksums``)."""
    if "path" not in cfg.data.keys():  # keys(), not `in`: a missing (???) value is not `in` a DictConfig
        return check_mixture(cfg) if "sources" in cfg.data.keys() else PendingChecksums()
    path = None if OmegaConf.is_missing(cfg.data, "path") else cfg.data.path
    if not path:
        raise ConfigError("data.path", path, "a dataset directory (python -m distrain.data.prepare's output)")
    try:
        dataset = inspect_token_dataset(path, checksums=False)
    except DataError as err:
        raise ConfigError("data.path", path, f"a readable dataset: {err}") from None
    return PendingChecksums([(dataset, "data.path", path)] if cfg.data.get("verify_checksums", True) else [])
