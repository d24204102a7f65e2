"""Consolidate a sharded checkpoint (DCP from ddp/fsdp, DeepSpeed's from zero) into one ``torch.save`` file of the
model's full parameters, loadable with ``model.load_state_dict`` without distrain, torch.distributed or DeepSpeed.

    python -m distrain.checkpoint.export outputs/.../checkpoints/step_00000200 model.pt
    python -m distrain.checkpoint.export outputs/.../checkpoints/step_00000200 hf_dir --format hf

``--format hf`` writes a Hugging Face model directory instead (``model.safetensors`` and ``config.json``) for a
family whose spec maps its names to Hugging Face's (``ModelSpec.to_hf`` and ``hf_config``: the Llama family), so
``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads it. The family is read from the checkpoint's own
``config.yaml``.

Runs in one process without a process group. It holds one copy of the model in memory: only the model's entries
are read (not the optimizer state), one tensor at a time, into tensors allocated once at their full shape;
DeepSpeed's shards are memory-mapped and gathered tensor by tensor. The output is written to ``<out>.tmp`` and
renamed when complete.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from distrain.checkpoint.checkpointer import checkpoint_problem
from distrain.checkpoint.data_only import DataOnlyLoadPlanner, DataOnlyReader, load_dcp_metadata
from distrain.models.spec import spec_of
from distrain.parallelism.zero import CHECKPOINT_TAG, import_deepspeed

MODEL_KEY = "model"  # the strategies save {"model": ..., "optimizer": ..., ...}; DCP flattens it to "model.<name>"


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
    dcp.load({MODEL_KEY: model}, storage_reader=DataOnlyReader(path), planner=DataOnlyLoadPlanner(), no_dist=True)
    return model


def _deepspeed_model_state(path: Path) -> dict[str, torch.Tensor]:
    import_deepspeed("cuda" if torch.cuda.is_available() else "cpu")  # selects DeepSpeed's CPU accelerator if need be
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=CHECKPOINT_TAG, lazy_mode=True)
    return {name: tensor.contiguous() for name, tensor in lazy.items()}  # fp32 master weights, one at a time


def consolidated_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The full model state dict stored in checkpoint ``path`` (a ``step_*`` directory), on CPU."""
    problem = checkpoint_problem(path)
    if problem:
        raise ValueError(f"{path} is not a usable checkpoint: {problem}")
    if (path / CHECKPOINT_TAG).is_dir():
        return _deepspeed_model_state(path)
    return _dcp_model_state(path)


def export_checkpoint(path: Path, out: Path) -> dict[str, int]:
    """Write the consolidated model state of ``path`` to ``out`` atomically; returns tensor and byte counts."""
    state = consolidated_model_state(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".tmp")
    torch.save(state, partial)
    partial.replace(out)
    return {"tensors": len(state), "bytes": sum(t.numel() * t.element_size() for t in state.values())}


def export_hf(path: Path, out: Path) -> dict[str, int]:
    """Write checkpoint ``path`` as a Hugging Face model directory ``out`` (``model.safetensors``, ``config.json``),
    atomically (a sibling ``.tmp`` directory renamed when complete); returns tensor and byte counts."""
    from safetensors.torch import save_file

    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.yaml naming its model")
    model_cfg = OmegaConf.load(config_file).model
    if "init_from" in model_cfg:
        model_cfg.init_from = None  # the checkpoint holds the weights
    with torch.device("meta"):
        model = instantiate(model_cfg)
    spec = spec_of(model)
    if spec.to_hf is None or spec.hf_config is None:
        raise ValueError(
            f"{spec.label} has no Hugging Face counterpart (ModelSpec.to_hf, hf_config); use the default format"
        )
    hf_config = spec.hf_config(model)
    state = spec.to_hf(consolidated_model_state(path))
    if getattr(hf_config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # transformers ties it to the embedding; safetensors stores no shared tensors
    partial = out.with_name(out.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(
        {name: tensor.contiguous() for name, tensor in state.items()}, partial / "model.safetensors", {"format": "pt"}
    )
    hf_config.save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.replace(out)
    return {"tensors": len(state), "bytes": sum(t.numel() * t.element_size() for t in state.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distrain.checkpoint.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a step_* checkpoint directory")
    parser.add_argument("out", type=Path, help="output file (torch format) or directory (hf format)")
    parser.add_argument("--format", choices=("torch", "hf"), default="torch", help="torch.save file or HF directory")
    args = parser.parse_args(argv)
    try:
        export = export_hf if args.format == "hf" else export_checkpoint
        counts = export(args.checkpoint, args.out)
    except (ValueError, FileNotFoundError) as err:
        print(f"distrain export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {counts['tensors']} tensors, {counts['bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
