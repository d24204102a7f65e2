"""What the launching process settles about the checkpoint directory before any rank starts.

Takes the directory's lock, removes saves a crash interrupted, refuses a fresh run into a directory that holds
another run's checkpoints (their pruning would delete this run's saves, and ``resume=auto`` would mix the two), and
refuses a resume whose checkpoint was written for another model, optimizer or checkpoint format. Returns the
checkpoint of a run that is already complete, when there is nothing to train.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from distrain.checkpoint.checkpointer import (
    checkpoint_step,
    newest_valid,
    remove_partial_saves,
    step_directories,
    uses_checkpoint_dir,
)
from distrain.checkpoint.lock import CheckpointDirLock
from distrain.config_checks import ConfigError


def prepare_checkpoint_dir(
    cfg: DictConfig, *, directory: Path, resume: str, run_dir: str, take_lock: bool, held: ExitStack
) -> Path | None:
    """Lock ``directory`` for this job (released when ``held`` closes) and check it against ``cfg``.

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
    check_resumable(cfg, source)
    return source if checkpoint_step(source) >= cfg.trainer.max_steps else None


def pipeline_layout(parallelism: DictConfig) -> tuple[str, int] | None:
    """A layout's pipeline (its option's name and its ``pp``; -1 spans the rest of the ranks, as the ``pipeline``
    preset does), or None when it has none."""
    pp = -1 if parallelism.name == "pipeline" else int(parallelism.get("pp", 1))  # older configs had no pp key
    return (str(parallelism.name), pp) if pp == -1 or pp > 1 else None


def describe_pipeline(parallelism: DictConfig) -> str:
    layout = pipeline_layout(parallelism)
    if layout is None:
        return f"parallelism={parallelism.name} without a pipeline"
    return f"parallelism={layout[0]}" if layout[1] == -1 else f"parallelism={layout[0]} parallelism.pp={layout[1]}"


def check_resumable(cfg: DictConfig, checkpoint: Path) -> None:
    """Refuse to resume ``checkpoint`` with a different model, optimizer or checkpoint format (DeepSpeed's own
    for zero, DCP's for the others) than the one it was saved with (its ``config.yaml``)."""
    saved_file = checkpoint / "config.yaml"
    if not saved_file.is_file():
        return
    saved = OmegaConf.load(saved_file)
    where = f"as in the checkpoint {checkpoint}"
    for key, value in OmegaConf.to_container(cfg.model, resolve=True).items():
        # Regularisation may change on resume (fine-tuning); what shapes or names the parameters may not.
        if key != "dropout" and key in saved.model and saved.model[key] != value:
            raise ConfigError(f"model.{key}", value, f"{saved.model[key]!r} {where} (it resumes the model it holds)")
    if saved.optimizer._target_ != cfg.optimizer._target_:
        saved_name = saved.optimizer._target_.rsplit(".", 1)[1]
        raise ConfigError("optimizer", cfg.optimizer._target_.rsplit(".", 1)[1], f"{saved_name} {where}")
    if (saved.parallelism.name == "zero") != (cfg.parallelism.name == "zero"):
        formats = "DeepSpeed's format (parallelism=zero)" if saved.parallelism.name == "zero" else "DCP's format"
        raise ConfigError("parallelism", cfg.parallelism.name, f"a strategy that reads {formats}, {where}")
    saved_stages, stages = pipeline_layout(saved.parallelism), pipeline_layout(cfg.parallelism)
    if (saved_stages or stages) and saved_stages != stages:
        raise ConfigError(
            "parallelism",
            cfg.parallelism.name,
            f"{describe_pipeline(saved.parallelism)} {where}: a pipeline's optimizer state is saved per stage, so it "
            "resumes under the same pipeline layout only",
        )
