"""Consolidate a sharded checkpoint (DCP from ddp/fsdp, DeepSpeed's from zero) into one ``torch.save`` file of the
model's full parameters, loadable with ``model.load_state_dict`` without distrain, torch.distributed or DeepSpeed.

    python -m distrain.checkpoint.export outputs/.../checkpoints/step_00000200 model.pt
    python -m distrain.checkpoint.export outputs/.../checkpoints/step_00000200 hf_dir --format hf

``--format hf`` writes a Hugging Face model directory instead (``model.safetensors`` and ``config.json``) for a
family whose spec maps its names to Hugging Face's (``ModelSpec.hf``), so
``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads it. The family is read from the checkpoint's own
``config.yaml``. The tokenizer goes beside the weights, so ``AutoTokenizer.from_pretrained(out)`` works too: the
one beside the run's dataset (``data=tokens``), else the tokenizer files of the Hugging Face directory the run
started from (``model.name_or_path`` or ``model.init_from``), when it has them.

Runs in one process without a process group. It holds one copy of the model in memory: only the model's entries
are read (not the optimizer state), one tensor at a time, into tensors allocated once at their full shape;
DeepSpeed's shards are memory-mapped and gathered tensor by tensor. The output is written to a temporary sibling and
renamed when complete.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from distrain.artifacts.char_vocab import FILE as CHAR_VOCAB
from distrain.artifacts.char_vocab import is_char_vocab
from distrain.artifacts.checkpoint import inspect_checkpoint
from distrain.artifacts.outputs import check_writable
from distrain.checkpoint.data_only import DataOnlyLoadPlanner, DataOnlyReader, load_dcp_metadata
from distrain.checkpoint.steps import checkpoint_problem
from distrain.data.tokens import dataset_path
from distrain.errors import ArtifactError
from distrain.models.meta import meta_device
from distrain.models.spec import spec_of
from distrain.parallelism.checks import root_cause
from distrain.parallelism.zero import CHECKPOINT_TAG, import_deepspeed

EXPORT_MARK = "distrain_export.json"  # in an hf export: what --overwrite may replace (names its checkpoint)
MODEL_KEY = "model"  # the strategies save {"model": ..., "optimizer": ..., ...}; DCP flattens it to "model.<name>"
# What save_pretrained writes for a tokenizer (fast or slow, with its chat template), copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


# Every name an hf export writes: a directory holding another name is not replaced.
EXPORT_FILES = {EXPORT_MARK, "model.safetensors", "config.json", "generation_config.json", *TOKENIZER_FILES, CHAR_VOCAB}


def _dcp_model_state(path: Path) -> dict[str, torch.Tensor]:
    metadata = load_dcp_metadata(Path(path) / ".metadata")
    prefix = MODEL_KEY + "."
    model = {
        key[len(prefix) :]: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"{path} has no model entries")
    # Loading into plain tensors of the global shape gathers every shard of each one; optimizer keys are not read.
    with warnings.catch_warnings():  # one process without a process group is what this tool is for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({MODEL_KEY: model}, storage_reader=DataOnlyReader(path), planner=DataOnlyLoadPlanner(), no_dist=True)
    return model


def _deepspeed_model_state(path: Path) -> dict[str, torch.Tensor]:
    import_deepspeed("cuda" if torch.cuda.is_available() else "cpu")  # selects DeepSpeed's CPU accelerator if need be
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=CHECKPOINT_TAG, lazy_mode=True)
    return {name: tensor.contiguous() for name, tensor in lazy.items()}  # fp32 master weights, one at a time


def consolidated_model_state(path: Path, *, inspected: bool = False) -> dict[str, torch.Tensor]:
    """The full model state dict stored in checkpoint ``path`` (a ``step_*`` directory), on CPU; ``inspected``:
    its inspector already checked its files against the manifest (each is hashed once)."""
    problem = None if inspected else checkpoint_problem(path)
    if problem:
        raise ValueError(f"{path} is not a usable checkpoint: {problem}")
    if (path / CHECKPOINT_TAG).is_dir():
        return _deepspeed_model_state(path)
    return _dcp_model_state(path)


def output_problem(out: Path, hf: bool, overwrite: bool) -> str | None:
    """Why ``out`` must not be written (None: it may): a path that cannot be written as the format's kind (a file
    for torch, a directory for hf; ``distrain.artifacts.outputs``), or one that exists and is not replaced: without
    ``overwrite`` nothing is, and even with it only what an earlier export wrote (a torch file, or a directory
    holding the mark an hf export leaves)."""
    try:
        check_writable(out, directory=hf)
    except ArtifactError as err:
        return str(err)
    if not out.exists() or (hf and not any(out.iterdir())):
        return None
    if not overwrite:
        return f"{out} exists; pass --overwrite to replace it"
    if hf and not (out / EXPORT_MARK).is_file():
        return f"{out} is not an earlier --format hf export (it has no {EXPORT_MARK}): not replaced"
    if hf and (added := sorted(set(child.name for child in out.iterdir()) - EXPORT_FILES)):
        return f"{out / added[0]} was not written by export: not replaced (move it out of {out} first)"
    if not hf and not _torch_file(out):
        return f"{out} is not a file torch.save wrote (an earlier export): not replaced"
    return None


def _torch_file(path: Path) -> bool:
    """Whether ``path`` is a ``torch.save`` archive (a zip holding ``<name>/data.pkl``)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/data.pkl") for name in archive.namelist())


def export_checkpoint(path: Path, out: Path) -> dict[str, int]:
    """Write the consolidated model state of ``path`` to ``out`` atomically (a temporary sibling of a name of its
    own, renamed when complete); returns tensor and byte counts."""
    state = consolidated_model_state(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _partial(out, directory=False) as partial:
        torch.save(state, partial)
        partial.replace(out)
    return {"tensors": len(state), "bytes": sum(t.numel() * t.element_size() for t in state.values())}


@contextlib.contextmanager
def _partial(out: Path, *, directory: bool) -> Iterator[Path]:
    """A new temporary sibling of ``out`` (a name no one else has: nothing existing is replaced or removed),
    removed again if the export fails before renaming it to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.export-"
    if directory:
        partial = Path(tempfile.mkdtemp(dir=out.parent, prefix=prefix))
    else:
        descriptor, name = tempfile.mkstemp(dir=out.parent, prefix=prefix)
        os.close(descriptor)
        partial = Path(name)
    try:
        yield partial
    except BaseException:
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink(missing_ok=True)
        raise


def export_hf(path: Path, out: Path) -> dict[str, int]:
    """Write checkpoint ``path`` as a Hugging Face model directory ``out`` (``model.safetensors``, ``config.json``),
    atomically (a sibling ``.tmp`` directory renamed when complete); returns tensor and byte counts."""
    from safetensors.torch import save_file

    problem = output_problem(out, hf=True, overwrite=True)  # never deletes what an export did not write
    if problem:
        raise ValueError(problem)
    found = inspect_checkpoint(path, tool="export")  # model=hf: its source directory must still be there
    config_file, run_cfg = found.path / "config.yaml", found.config
    model_cfg = run_cfg.model
    data_tokenizer = data_tokenizer_file(run_cfg)
    tokenizer = [] if data_tokenizer else tokenizer_files(model_cfg)
    token_ids = special_token_ids(run_cfg, data_tokenizer)
    if "init_from" in model_cfg:
        model_cfg.init_from = None  # the checkpoint holds the weights
    try:
        with meta_device():
            model = instantiate(model_cfg)
    except Exception as err:  # e.g. model=hf whose directory moved: Hydra wraps the constructor's error
        cause = root_cause(err)
        raise ValueError(f"cannot build the model {config_file} describes: {type(cause).__name__}: {cause}") from None
    spec = spec_of(model)
    if spec.hf is None:
        raise ValueError(f"{spec.label} has no Hugging Face counterpart (ModelSpec.hf); use the default format")
    hf_config = spec.hf.config(model)
    hf_config.dtype = torch.float32  # the weights written; a source saved in bf16 would otherwise load as bf16
    for name, token_id in token_ids.items():
        setattr(hf_config, name, token_id)
    state = spec.hf.to_hf(consolidated_model_state(found.path, inspected=True))
    if getattr(hf_config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # transformers ties it to the embedding; safetensors stores no shared tensors
    with _partial(out, directory=True) as partial:
        (partial / EXPORT_MARK).write_text(json.dumps({"checkpoint": str(found.path.resolve())}) + "\n")
        tensors = {name: tensor.contiguous() for name, tensor in state.items()}
        save_file(tensors, partial / "model.safetensors", {"format": "pt"})
        hf_config.save_pretrained(partial)
        for tokenizer_file in tokenizer:
            shutil.copy2(tokenizer_file, partial / tokenizer_file.name)
        if data_tokenizer:
            write_data_tokenizer(data_tokenizer, token_ids["eos_token_id"], partial)
        shutil.rmtree(out, ignore_errors=True)  # empty, or an earlier export (output_problem)
        partial.replace(out)
    return {"tensors": len(state), "bytes": sum(t.numel() * t.element_size() for t in state.values())}


def data_tokenizer_file(run_cfg: DictConfig) -> Path | None:
    """The tokenizer the run's token ids came from: the one beside its dataset (``data=tokens``, or a mixture's
    sources), if any."""
    path = dataset_path(run_cfg.data)
    if not path:
        return None
    from distrain.data.tokens import tokenizer_path

    try:
        return tokenizer_path(path)
    except ValueError:  # the dataset moved or is gone: the export goes on without a tokenizer
        return None


SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_ids(run_cfg: DictConfig, data_tokenizer: Path | None) -> dict[str, object]:
    """The ``config.json`` token ids that agree with the tokenizer exported beside the weights, so that
    ``generate`` stops where training's documents ended: a dataset's end-of-document id (no beginning or padding
    id: documents were joined by it alone); else the ids of the Hugging Face directory the model came from; else
    none (a config class's own defaults, e.g. Llama's 1 and 2, name tokens of a tokenizer the run never used)."""
    ids: dict[str, object] = dict.fromkeys(SPECIAL_TOKEN_IDS)
    if data_tokenizer is not None:
        if not is_char_vocab(data_tokenizer):
            from distrain.data.token_format import read_index
            from distrain.data.tokens import dataset_directory

            ids["eos_token_id"] = read_index(dataset_directory(dataset_path(run_cfg.data)), "train").eos_id
        return ids
    model_cfg = run_cfg.model
    source = model_cfg.get("name_or_path") or model_cfg.get("init_from")
    if source and (Path(source) / "config.json").is_file():
        source_config = json.loads((Path(source) / "config.json").read_text())
        ids |= {name: source_config.get(name) for name in SPECIAL_TOKEN_IDS}
    return ids


def write_data_tokenizer(tokenizer_file: Path, eos_id: int | None, out: Path) -> None:
    """The dataset's ``tokenizer.json`` and a ``tokenizer_config.json`` naming its end-of-document token, which is
    what ``AutoTokenizer.from_pretrained(out)`` reads. A nanoGPT dataset's character-level ``meta.pkl`` is no
    ``tokenizers`` file: it is copied as it is, beside the weights, for nanoGPT's ``sample.py``."""
    import json

    from tokenizers import Tokenizer

    if is_char_vocab(tokenizer_file):
        shutil.copy2(tokenizer_file, out / CHAR_VOCAB)
        return
    shutil.copy2(tokenizer_file, out / "tokenizer.json")
    eos = Tokenizer.from_file(str(tokenizer_file)).id_to_token(eos_id) if eos_id is not None else None
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": 1 << 30}
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=1) + "\n")


def tokenizer_files(model_cfg: DictConfig) -> list[Path]:
    """The tokenizer files in the Hugging Face directory the model was built from (``name_or_path``) or started
    from (``init_from``), if any: the tokenizer the weights were trained with."""
    source = model_cfg.get("name_or_path") or model_cfg.get("init_from")
    if not source:
        return []
    return [Path(source) / name for name in TOKENIZER_FILES if (Path(source) / name).is_file()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distrain.checkpoint.export",
        description="Consolidate a checkpoint of any strategy into one torch file or a Hugging Face directory.",
    )
    parser.add_argument("checkpoint", type=Path, help="a step_* checkpoint directory")
    parser.add_argument("out", type=Path, help="output file (torch format) or directory (hf format)")
    parser.add_argument("--format", choices=("torch", "hf"), default="torch", help="torch.save file or HF directory")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT when an earlier export wrote it")
    args = parser.parse_args(argv)
    try:  # where it writes first (nothing read yet), then what it reads
        problem = output_problem(args.out, args.format == "hf", args.overwrite)
        if problem:
            raise ValueError(problem)
        checkpoint = inspect_checkpoint(args.checkpoint, tool="export").path
        export = export_hf if args.format == "hf" else export_checkpoint
        counts = export(checkpoint, args.out)
    except (ValueError, FileNotFoundError) as err:  # ArtifactError included
        print(f"distrain export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {counts['tensors']} tensors, {counts['bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
