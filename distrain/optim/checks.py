"""Checks of the ``optimizer`` group and the ``scheduler`` block, before any rank starts."""

from __future__ import annotations

from omegaconf import DictConfig

from distrain.config.checks import ConfigError, at_least, check, positive
from distrain.optim.groups import GroupRuleError, GroupRules, resolve
from distrain.optim.schedule import decay_steps
from distrain.parallelism.capabilities import capabilities_of


def rules_of(optimizer: DictConfig) -> GroupRules:
    """The parameter-group rules of an ``optimizer`` config."""
    return GroupRules(
        weight_decay=optimizer.get("weight_decay", 0.0),  # an optimizer of the user's may have none
        no_decay=list(optimizer.get("no_decay") or ()),
        lr_multipliers={str(rule): float(factor) for rule, factor in (optimizer.get("lr_multipliers") or {}).items()},
        muon=list(optimizer.get("muon") or ()),
    )


def validate_schedule(cfg: DictConfig) -> None:
    """The warm-up, the floor and, for wsd, a decay that starts after the warm-up."""
    check(cfg, "scheduler.warmup_steps", at_least(0), "an integer >= 0")
    check(cfg, "scheduler.min_lr_ratio", lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
    if cfg.scheduler.decay != "wsd":
        return
    check(cfg, "scheduler.decay_fraction", lambda v: 0 < v <= 1, "a fraction in (0, 1] of trainer.max_steps")
    total, warmup = cfg.trainer.max_steps, cfg.scheduler.warmup_steps
    if warmup >= total:
        raise ConfigError(
            "scheduler.warmup_steps", warmup, f"fewer than trainer.max_steps ({total}) with scheduler.decay=wsd"
        )
    length = decay_steps(total, cfg.scheduler.decay_fraction)
    if total - length < warmup:
        raise ConfigError(
            "scheduler.decay_fraction",
            cfg.scheduler.decay_fraction,
            f"a fraction whose decay fits after the {warmup}-step warm-up: round(fraction x {total}) = {length} decay "
            f"steps, at most {total - warmup} fit",
        )


def _validate_deepspeed_muon(cfg: DictConfig) -> None:
    """What DeepSpeed's Muon, which ``parallelism=zero`` runs, fixes: Nesterov momentum, 5 Newton-Schulz steps, and
    no offloading (not a path distrain has checked)."""
    from distrain.optim.deepspeed_muon import DEEPSPEED_NS_STEPS

    if not cfg.optimizer.nesterov:
        raise ConfigError("optimizer.nesterov", False, "true with optimizer=muon parallelism=zero (DeepSpeed's Muon)")
    if cfg.optimizer.ns_steps != DEEPSPEED_NS_STEPS:
        raise ConfigError(
            "optimizer.ns_steps",
            cfg.optimizer.ns_steps,
            f"{DEEPSPEED_NS_STEPS} with optimizer=muon parallelism=zero (DeepSpeed's Muon fixes it)",
        )
    for key in ("offload_optimizer", "offload_param"):
        if cfg.parallelism.get(key, "none") != "none":
            raise ConfigError(
                f"parallelism.{key}",
                cfg.parallelism[key],
                "none with optimizer=muon (DeepSpeed's Muon with offloading is not supported by distrain)",
            )


def unapplied_clipping(cfg: DictConfig) -> str | None:
    """Why ``trainer.grad_clip_norm`` is not applied to this run, or None when it is.

    DeepSpeed's Muon writes each matrix's orthogonalised update where ZeRO keeps the gradient, so DeepSpeed's
    clipping would scale the norm of the updates (about 50 on llama_tiny), not the gradients': Muon's steps shrink
    by that factor (val 2.396 after 60 steps against 2.297 for distrain's Muon under ddp, measured side by side).
    Under ``parallelism=zero`` with Muon distrain therefore gives DeepSpeed no clipping (val 2.320, as ddp without
    clipping)."""
    deepspeed = capabilities_of(cfg.parallelism).deepspeed_optimizer
    if "muon" in cfg.optimizer and deepspeed and cfg.trainer.grad_clip_norm > 0:
        return (
            f"trainer.grad_clip_norm={cfg.trainer.grad_clip_norm} is not applied with optimizer=muon "
            "parallelism=zero: DeepSpeed's Muon would clip its orthogonalised updates, not the gradients "
            "(trainer.grad_clip_norm=0 says so and silences this)"
        )
    return None


def validate_optimizer(cfg: DictConfig, model: object | None) -> list[str]:
    """Refuse impossible optimizer settings in one line (ConfigError); return one warning line per rule that names
    no parameter of ``model`` (the configured model on the meta device; None: rules not checked)."""
    optimizer = cfg.optimizer
    check(cfg, "optimizer.lr", positive, "a learning rate > 0")
    if "weight_decay" in optimizer:
        check(cfg, "optimizer.weight_decay", at_least(0), "a number >= 0")
    for rule, factor in (optimizer.get("lr_multipliers") or {}).items():
        if not positive(factor):
            raise ConfigError(f"optimizer.lr_multipliers.{rule}", factor, "a factor > 0 on the learning rate")
    if "muon" in optimizer:
        check(cfg, "optimizer.ns_steps", at_least(1), "an integer >= 1 (Newton-Schulz iterations; 5 is usual)")
        check(cfg, "optimizer.bucket_mb", positive, "a size in MiB > 0")
        if cfg.parallelism.get("cpu_offload"):
            raise ConfigError(
                "parallelism.cpu_offload",
                True,
                "false with optimizer=muon (Muon gathers its sharded matrices over the device's process group; "
                "offloaded shards live in CPU memory)",
            )
        if capabilities_of(cfg.parallelism).deepspeed_optimizer:
            _validate_deepspeed_muon(cfg)
    validate_schedule(cfg)
    notes = [note] if (note := unapplied_clipping(cfg)) else []
    if model is None:
        return notes
    from distrain.models.spec import spec_of

    try:
        _, warnings = resolve(model, spec_of(model).parameter_roles(model), rules_of(optimizer))
    except GroupRuleError as err:
        raise ConfigError(err.key, err.rule, err.allowed) from None
    return notes + warnings
