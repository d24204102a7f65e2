"""The ``comm`` options' checks against the parallelism, the optimizer and the world size, before any rank starts;
each method's ``check_config`` (``DDPComm`` and its subclasses) calls those that concern it. Each returns the
warnings for a combination that runs but trains worse (a list, empty when there are none)."""

from __future__ import annotations

from omegaconf import DictConfig

from distrain.config.checks import ConfigError, at_least, check, positive
from distrain.optim.capabilities import optimizer_capabilities
from distrain.parallelism.capabilities import capabilities_of


def check_averaging(cfg: DictConfig, *, as_hook: bool) -> list[str]:
    """What every comm method takes: a bucket size; a method other than plain averaging (``as_hook``) runs as a DDP
    communication hook, so the strategy must accept hooks (its ``comm_hooks`` capability)."""
    check(cfg, "comm.bucket_cap_mb", positive, "a size in MiB > 0")
    comm = cfg.comm
    if as_hook and not capabilities_of(cfg.parallelism).comm_hooks:
        raise ConfigError(
            "comm",
            comm.name,
            f"comm=default with parallelism={cfg.parallelism.name}; comm={comm.name} is a DDP communication hook "
            "and combines only with parallelism=ddp (zero, fsdp, pipeline, tensor and single have no DDP hooks)",
        )
    return []


def check_quality_guard(cfg: DictConfig) -> list[str]:
    check(cfg, "comm.quality_every", at_least(0), "an integer >= 0 (0 turns the quality guard off)")
    check(cfg, "comm.quality_threshold", positive, "a relative error > 0")
    return []


def check_powersgd(cfg: DictConfig) -> list[str]:
    check(cfg, "comm.rank", at_least(1), "an integer >= 1 (rank of the gradient approximation)")
    check(cfg, "comm.start_iter", at_least(2), "an integer >= 2 (DDP rebuilds its buckets after step 1)")
    check(cfg, "comm.min_compression_rate", positive, "a number > 0")
    return []


def check_hierarchical(cfg: DictConfig, world_size: int) -> list[str]:
    if cfg.comm.ranks_per_node is not None:
        check(
            cfg,
            "comm.ranks_per_node",
            lambda v: v >= 1 and world_size % v == 0,
            f"a divisor of the world size ({world_size}), or null for the launcher's ranks per node",
        )
    return []


def check_topk(cfg: DictConfig) -> list[str]:
    """Top-k's density, warm-up, momentum correction and feedback against the optimizer and the precision;
    returns the warning for a combination that runs but trains worse."""
    comm = cfg.comm
    check(cfg, "comm.density", lambda v: v is not None and 0 < v <= 1, "a fraction in (0, 1]")
    check(cfg, "comm.warmup_steps", at_least(0), "an integer >= 0")
    if comm.warmup_steps > 0:  # without a warm-up the start density is unused
        check(
            cfg,
            "comm.warmup_start_density",
            lambda v: v is not None and comm.density <= v <= 1,
            f"a fraction in [comm.density ({comm.density}), 1] with comm.warmup_steps > 0",
        )
    check(cfg, "comm.momentum", lambda v: v is not None and 0 <= v < 1, "a number in [0, 1)")
    optimizer = cfg.optimizer._target_
    if comm.momentum > 0 and not (
        comm.feedback == "residual"
        and optimizer_capabilities(cfg.optimizer).linear
        and not cfg.optimizer.get("momentum")
    ):
        raise ConfigError(
            "comm.momentum",
            comm.momentum,
            "0 unless comm.feedback=residual optimizer=sgd optimizer.momentum=0 (momentum correction moves the "
            "optimizer's momentum into the compressor)",
        )
    check(cfg, "comm.sync_every", at_least(0), "an integer >= 0 (0: the residual is never sent whole)")
    if (
        comm.feedback in ("update", "estimate")
        and cfg.precision.get("grad_scaler")
        and cfg.precision.compute_dtype != "float16"
    ):
        raise ConfigError(
            "precision.grad_scaler",
            True,
            f"false with comm=topk comm.feedback={comm.feedback} (a loss scaler skips steps and rescales what the "
            "feedback holds), or comm.feedback=residual",
        )
    if comm.feedback in ("update", "estimate") and cfg.precision.compute_dtype == "float16":
        held = {
            "update": "each rank's loss scale would skip its own steps",
            "estimate": "estimates hold loss-scaled gradients, and the scale changes",
        }[comm.feedback]
        raise ConfigError(
            "comm.feedback",
            comm.feedback,
            f"residual under precision=fp16 ({held}); or keep it and use precision=bf16",
        )
    if comm.feedback == "residual" and optimizer_capabilities(cfg.optimizer).adaptive:
        return [
            f"comm.feedback=residual with {optimizer.rsplit('.', 1)[-1]}: classic error feedback is sound for SGD; "
            "Adam-type optimizers shrink the delayed sums it delivers (on the default job 1% ended 24% above "
            "dense, comm.feedback=update's default +0.9%)"
        ]
    return []
