"""Consolidate a sharded checkpoint (DCP from ddp/fsdp, DeepSpeed's from zero) into one ``torch.save`` file of the
model's full parameters, loadable with ``model.load_state_dict`` without distrain, torch.distributed or DeepSpeed.

    python -m distrain.checkpoint.export outputs/.../checkpoints/step_00000200 model.pt

Runs in one process without a process group. It holds one copy of the model in memory: only the model's entries
are read (not the optimizer state), one tensor at a time, into tensors allocated once at their full shape;
DeepSpeed's shards are memory-mapped and gathered tensor by tensor. The output is written to ``<out>.tmp`` and
renamed when complete.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from distrain.checkpoint.checkpointer import checkpoint_problem
from distrain.checkpoint.data_only import DataOnlyLoadPlanner, DataOnlyReader, load_dcp_metadata
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distrain.checkpoint.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a step_* checkpoint directory")
    parser.add_argument("out", type=Path, help="output file (torch.save of the model's state dict)")
    args = parser.parse_args(argv)
    try:
        counts = export_checkpoint(args.checkpoint, args.out)
    except (ValueError, FileNotFoundError) as err:
        print(f"distrain export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {counts['tensors']} tensors, {counts['bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
