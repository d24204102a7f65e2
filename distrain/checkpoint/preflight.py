"""What the launching process settles about the checkpoint directory before any rank starts.

Takes the directory's lock, refuses a directory holding ``step_*`` entries distrain did not write (a save would
replace them), removes saves a crash interrupted, refuses a fresh run into a directory that holds
another run's checkpoints (their pruning would delete this run's saves, and ``resume=auto`` would mix the two), and
refuses a resume whose checkpoint was written for another model, optimizer or checkpoint format. Returns the
checkpoint of a run that is already complete, when there is nothing to train.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from distrain.checkpoint.directory import foreign_entries, remove_partial_saves
from distrain.checkpoint.lock import CheckpointDirLock
from distrain.checkpoint.steps import (
    checkpoint_step,
    checkpoint_world_size,
    newest_valid,
    step_directories,
    uses_checkpoint_dir,
)
from distrain.config.checks import ConfigError, as_typed
from distrain.parallelism.capabilities import capabilities_of
from distrain.parallelism.layout import layout_of

log = logging.getLogger("distrain.train")
# Optimizer settings a checkpoint's optimizer state carries (per parameter group): a resumed run keeps the saved ones.
FORMAT_NAMES = {"deepspeed": "DeepSpeed's format (parallelism=zero)", "dcp": "DCP's format"}
RESTORED_OPTIMIZER_KEYS = ("lr", "weight_decay", "betas", "eps", "momentum", "nesterov")


def prepare_checkpoint_dir(
    cfg: DictConfig,
    *,
    directory: Path,
    resume: str,
    run_dir: str,
    take_lock: bool,
    held: ExitStack,
    world_size: int,
) -> Path | None:
    """Lock ``directory`` for this job (released when ``held`` closes) and check it against ``cfg`` on
    ``world_size`` ranks.

    Returns the checkpoint of a run already at ``trainer.max_steps`` (None: there is training to do). Raises
    ``ConfigError`` for a directory or a checkpoint this config cannot use, ``CheckpointDirInUse`` when another
    job holds the directory.
    """
    if not uses_checkpoint_dir(cfg.checkpoint) and resume == "never":
        return None
    if take_lock:
        try:
            held.enter_context(CheckpointDirLock(directory, run_dir))
        except OSError as err:
            raise ConfigError("checkpoint.dir", str(directory), f"a directory this job can create ({err})") from None
        # Only the lock holder looks: another task of this job could see a save being removed as it reads.
        if foreign := foreign_entries(directory):  # a save would replace it: never a file distrain did not write
            raise ConfigError(
                "checkpoint.dir",
                str(directory),
                f"a directory whose step_* entries are distrain's saves: {foreign[0]} holds what a save does not "
                "write (or is not a directory), and a save would replace it; move it, or choose another "
                "checkpoint.dir",
            )
        remove_partial_saves(directory)
    if resume == "never":
        earlier = step_directories(directory)
        if earlier:
            raise ConfigError(
                "checkpoint.resume",
                "never",
                f"auto, or another checkpoint.dir: {directory} holds an earlier run's checkpoints (newest "
                f"{earlier[-1].name}), which a fresh run would mix with its own",
            )
        return None
    source = newest_valid(directory, report=False) if resume == "auto" else Path(resume)
    if source is None:
        return None
    check_resumable(cfg, source, world_size)
    return source if checkpoint_step(source) >= cfg.trainer.max_steps else None


def pipeline_stages(parallelism: DictConfig, world_size: int) -> tuple[int, int, tuple[int, ...]] | None:
    """How a layout splits the model into pipeline stages on ``world_size`` ranks: (pp resolved, stages per rank,
    split points), or None when it has no pipeline. What a pipeline checkpoint's per-stage optimizer state needs."""
    configured = parallelism.get("pp")  # -1: a pipeline over the rest of the ranks, even of one stage
    if configured == 1:
        return None
    try:
        pp = layout_of(parallelism, world_size).pp
    except ValueError:
        return (-1, 1, ())  # degrees that do not fit: validation names them
    if configured is None and pp == 1:  # no pp key (ddp, zero, ...): a pipeline only where its strategy makes one
        return None
    virtual = int(parallelism.virtual_stages) if parallelism.get("schedule") == "interleaved" else 1
    return (int(pp), virtual, tuple(parallelism.get("split_points", ())))


def describe_pipeline(parallelism: DictConfig, world_size: int) -> str:
    layout = pipeline_stages(parallelism, world_size)
    if layout is None:
        return f"parallelism={parallelism.name} without a pipeline"
    pp, virtual, split = layout
    per_rank = f" x {virtual} virtual stages per rank" if virtual > 1 else ""
    at = f" split at blocks {list(split)}" if split else ""
    return f"parallelism={parallelism.name} with {pp} pipeline stages{per_rank}{at} on {world_size} ranks"


def group_rule(optimizer: DictConfig, key: str) -> object:
    """An optimizer's group rules under ``key`` in a form that compares by meaning: rule lists as sorted lists,
    learning-rate multipliers without the factors of 1 (no rule); None when the config has no such key (a
    checkpoint from before the rules)."""
    if key not in optimizer:
        return None
    value = OmegaConf.to_container(optimizer[key])
    if key == "lr_multipliers":
        return {rule: float(factor) for rule, factor in value.items() if float(factor) != 1.0}
    return sorted(value)


def _check_data_position(cfg: DictConfig, saved: DictConfig, where: str) -> None:
    """The data position a checkpoint holds fits the run's data: a mixture's (sequences drawn per source, by name)
    or one dataset's (epoch and sequences into it)."""
    ours = cfg.data.get("sources") if "sources" in cfg.data.keys() else None
    theirs = saved.data.get("sources") if "data" in saved and "sources" in saved.data else None
    if (ours is None) != (theirs is None):
        value, allowed = ("one dataset", "data=mix") if ours is None else (dict(ours), "one dataset, not data=mix")
        raise ConfigError("data", value, f"{allowed} {where} (it resumes that data's position; start a new run)")
    if ours is not None and set(ours) != set(theirs):
        raise ConfigError(
            "data.sources", ", ".join(ours), f"the sources {', '.join(theirs)} {where} (it holds how many sequences "
            "each has given; their weights may change, their names not: start a new run to change them)"
        )  # fmt: skip


def check_resumable(cfg: DictConfig, checkpoint: Path, world_size: int) -> None:
    """Refuse to resume ``checkpoint`` on ``world_size`` ranks with a different model, optimizer (or parameter
    group rules) or checkpoint format (DeepSpeed's own for zero, DCP's for the others) than the one it was saved with
    (its ``config.yaml``), or with another split into pipeline stages."""
    saved_file = checkpoint / "config.yaml"
    if not saved_file.is_file():
        return
    saved = OmegaConf.load(saved_file)
    where = f"as in the checkpoint {checkpoint}"
    for key, value in OmegaConf.to_container(cfg.model, resolve=True).items():
        # Regularisation may change on resume (fine-tuning), and where the first weights came from (init_from:
        # the checkpoint holds the weights now, so a moved or dropped directory is fine); what shapes or names the
        # parameters may not.
        if key not in ("dropout", "init_from") and key in saved.model and saved.model[key] != value:
            saved_value = as_typed(saved.model[key])
            raise ConfigError(f"model.{key}", value, f"{saved_value} {where} (it resumes the model it holds)")
    if saved.optimizer._target_ != cfg.optimizer._target_:
        saved_name = saved.optimizer._target_.rsplit(".", 1)[1]
        raise ConfigError("optimizer", cfg.optimizer._target_.rsplit(".", 1)[1], f"{saved_name} {where}")
    for key in ("no_decay", "lr_multipliers", "muon"):  # they make the parameter groups the state is saved by
        ours, theirs = group_rule(cfg.optimizer, key), group_rule(saved.optimizer, key)
        if theirs is not None and ours != theirs:
            raise ConfigError(
                f"optimizer.{key}",
                ours,
                f"{theirs} {where}: the optimizer's state and learning rates are saved by "
                "parameter group, so a resumed run keeps the groups (start a new run to change them)",
            )
    changed = [
        f"optimizer.{key}={cfg.optimizer[key]} (the checkpoint's: {saved.optimizer[key]})"
        for key in RESTORED_OPTIMIZER_KEYS
        if key in cfg.optimizer and key in saved.optimizer and cfg.optimizer[key] != saved.optimizer[key]
    ]
    if changed:
        log.warning(
            "%s: ignored on resume; the optimizer state restored from %s carries its own (start a new run to "
            "change them)",
            ", ".join(changed),
            checkpoint,
        )
    _check_data_position(cfg, saved, where)
    saved_format = capabilities_of(saved.parallelism).checkpoint_format
    if saved_format != capabilities_of(cfg.parallelism).checkpoint_format:
        formats = FORMAT_NAMES.get(saved_format, f"the {saved_format} format")
        raise ConfigError("parallelism", cfg.parallelism.name, f"a strategy that reads {formats}, {where}")
    saved_ranks = checkpoint_world_size(checkpoint) or world_size
    saved_stages, stages = pipeline_stages(saved.parallelism, saved_ranks), pipeline_stages(cfg.parallelism, world_size)
    if (saved_stages or stages) and saved_stages != stages:
        raise ConfigError(
            "parallelism",
            cfg.parallelism.name,
            f"{describe_pipeline(saved.parallelism, saved_ranks)} {where}: a pipeline's optimizer state is saved per "
            "stage, so it resumes under the same stages only",
        )
