"""Inspector of a checkpoint to read (``checkpoint.resume``, ``export``, ``generate``): a ``step_*`` directory, or a
run directory (or its ``checkpoints/``) whose newest complete checkpoint is taken, as ``checkpoint.resume=auto``
takes it.

What it establishes: the directory is a complete checkpoint (its ``manifest.json`` lists every file with its size
and SHA-256 and each matches; no pickled code), its ``config.yaml`` (the run's resolved config, which rebuilds the
model) is readable YAML with a ``model`` entry, and the Hugging Face directory a ``model=hf`` run was built from is
still where the config says (its config.json describes the model; the checkpoint holds the weights).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from distrain.checkpoint.steps import checkpoint_problem, newest_valid, step_directories
from distrain.errors import ArtifactError


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint and the resolved config of the run that wrote it."""

    path: Path
    config: DictConfig


def resolve_checkpoint(path: str | Path, *, tool: str) -> Path:
    """A ``step_*`` directory as given; a run directory or its ``checkpoints/``: the newest complete checkpoint
    there (``tool`` names the command in the note printed when newer ones fail their check)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ArtifactError(str(path), "no such checkpoint or run directory")
    if (path / "manifest.json").is_file() or (path / "config.yaml").is_file():
        return path
    for directory in (path / "checkpoints", path):
        if steps := step_directories(directory):
            newest = newest_valid(directory, report=False)
            if newest is None:
                raise ArtifactError(
                    str(directory), "holds no complete checkpoint (every step_* fails its manifest check)"
                )
            if newest != steps[-1]:
                print(f"distrain {tool}: using {newest.name}; newer checkpoints fail their check", file=sys.stderr)
            return newest
    raise ArtifactError(str(path), "no checkpoint there (a step_* directory, or a run directory with checkpoints/)")


def inspect_checkpoint(path: str | Path, *, tool: str = "") -> Checkpoint:
    """The checkpoint at ``path`` (see ``resolve_checkpoint``) and its run's config; ``ArtifactError`` otherwise."""
    checkpoint = resolve_checkpoint(path, tool=tool)
    problem = checkpoint_problem(checkpoint)
    if problem:
        raise ArtifactError(str(checkpoint), f"not a usable checkpoint: {problem}")
    config_file = checkpoint / "config.yaml"
    try:
        config = OmegaConf.load(config_file)
    except Exception as err:  # YAML's own error types for a damaged file
        raise ArtifactError(str(config_file), f"unreadable ({type(err).__name__})") from None
    if not isinstance(config, DictConfig) or not isinstance(config.get("model"), DictConfig):
        raise ArtifactError(str(config_file), "not a run's config (no model entry to rebuild the model from)")
    _check_model_source(config, config_file)
    return Checkpoint(checkpoint, config)


def _check_model_source(config: DictConfig, config_file: Path) -> None:
    """A ``model=hf`` run's model is rebuilt from its Hugging Face directory's config.json: it must still be there."""
    from distrain.artifacts.hf_directory import inspect_hf_directory

    source = config.model.get("name_or_path")
    if not source:
        return
    try:
        inspect_hf_directory(source, weights=False)
    except ArtifactError as err:
        raise ArtifactError(
            err.where,
            f"{err.problem}: the Hugging Face directory this run trained from (model.name_or_path in {config_file}) "
            "describes its model; put it back at that path",
        ) from None
