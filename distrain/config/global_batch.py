"""The global batch, checked before any rank starts: the gradient accumulation that makes
``data.global_batch_size`` sequences per optimizer step under the run's layout, and a corpus that holds one such
batch of training windows and a validation window."""

from __future__ import annotations

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from distrain.config.checks import ConfigError, at_least, check
from distrain.data.corpus import CorpusTooSmall
from distrain.data.sampler import GlobalBatchSampler, longest_window, sampler_for, token_windows
from distrain.ft.config import replica_group_count
from distrain.parallelism.layout import layout_of


def derive_accumulation(cfg: DictConfig, world_size: int, ranks_per_node: int | None = None) -> None:
    """With ``data.global_batch_size`` set, write ``trainer.grad_accum_steps`` = global batch / (micro-batch x
    data-parallel degree) into ``cfg``: the same sequences per optimizer step under any layout. A value the layout
    cannot divide, or an accumulation set by hand to another number, is a ConfigError."""
    wanted = cfg.data.get("global_batch_size")
    if wanted is None:
        return
    check(cfg, "data.global_batch_size", at_least(1), "an integer >= 1 (sequences per optimizer step), or null")
    check(cfg, "data.micro_batch_size", at_least(1), "an integer >= 1")
    hybrid = cfg.parallelism
    try:
        data_parallel = layout_of(
            cfg.parallelism, world_size, ranks_per_node, replica_groups=replica_group_count(cfg)
        ).data_parallel
    except (TypeError, ValueError, ZeroDivisionError):
        return  # degrees that do not fit: validate_hybrid names the bad one
    per_micro_step = cfg.data.micro_batch_size * data_parallel
    if wanted % per_micro_step:
        raise ConfigError(
            "data.global_batch_size",
            wanted,
            f"a multiple of data.micro_batch_size x the data-parallel degree = {cfg.data.micro_batch_size} x "
            f"{data_parallel} = {per_micro_step} sequences per micro-step with parallelism={hybrid.name} on "
            f"{world_size} ranks",
        )
    accumulation = wanted // per_micro_step
    if cfg.trainer.grad_accum_steps not in (1, accumulation):
        derived = f"{accumulation}, derived from data.global_batch_size={wanted} on this layout (1 means: derive it)"
        raise ConfigError("trainer.grad_accum_steps", cfg.trainer.grad_accum_steps, derived)
    cfg.trainer.grad_accum_steps = accumulation


def validate_data_fits(cfg: DictConfig, world_size: int, ranks_per_node: int | None = None) -> GlobalBatchSampler:
    """The corpus holds one global batch of training windows, and its validation split at least one window.

    Builds the corpus (what every rank will read; the built-in ones take well under a second) and returns the
    sampler the ranks will use, for the dry run's report.
    """
    data_parallel = layout_of(
        cfg.parallelism, world_size, ranks_per_node, replica_groups=replica_group_count(cfg)
    ).data_parallel
    try:
        corpus = instantiate(cfg.data.corpus)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, CorpusTooSmall):
            raise ConfigError(f"data.corpus.{cause.key}", cause.value, cause.allowed) from None
        raise
    train_windows = token_windows(corpus.train, cfg.data.seq_len)
    if len(train_windows) < 1:
        raise ConfigError(
            "data.seq_len",
            cfg.data.seq_len,
            f"at most {longest_window(corpus.train)}, the train split's longest run of tokens",
        )
    try:
        sampler = sampler_for(
            train_windows,
            micro_batch_size=cfg.data.micro_batch_size,
            grad_accum_steps=cfg.trainer.grad_accum_steps,
            dp_rank=0,
            dp_size=data_parallel,
            seed=0,
        )
    except ValueError as err:
        raise ConfigError(
            "data.micro_batch_size", cfg.data.micro_batch_size, f"a smaller global batch: {err}"
        ) from None
    if len(token_windows(corpus.val, cfg.data.seq_len)) < 1:
        raise ConfigError(
            "data.seq_len",
            cfg.data.seq_len,
            f"at most {longest_window(corpus.val)}, the validation split's longest run of tokens",
        )
    return sampler
