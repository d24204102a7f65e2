"""Hugging Face weights in and out, for families whose spec renames their state dict (``ModelSpec.hf``).

Weights are safetensors only (nothing pickled): a Hugging Face model directory's ``*.safetensors`` files (one, or
the shards ``save_pretrained`` writes) are read on the CPU; their headers alone give the shapes a config check
compares, without reading any tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from distrain.artifacts.safetensors_set import inspect_safetensors
from distrain.models.spec import spec_of


def hf_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the directory's safetensors files (through its index when it has one), read
    from their headers only; ``ArtifactError`` naming the file when the set is incomplete or damaged."""
    return inspect_safetensors(directory).shapes


def weights_problem(model: nn.Module, directory: str | Path) -> str | None:
    """Why the Hugging Face weights in ``directory`` cannot initialise ``model`` (any device, meta included): names
    the family's mapping does not know, tensors missing or of another shape. None: they fit. A damaged or
    incomplete set of files is an ``ArtifactError`` (``distrain.artifacts.safetensors_set``)."""
    spec = spec_of(model)
    if spec.hf is None:
        return f"{spec.label} has no Hugging Face counterpart (ModelSpec.hf)"
    shapes = hf_shapes(directory)
    try:
        ours = spec.hf.from_hf({name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    except KeyError as err:
        return f"a tensor the {spec.name} family does not have: {err.args[0]}"
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    missing = sorted(expected.keys() - ours.keys())
    if missing:
        return f"no weights for {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    for name, shape in expected.items():
        if tuple(ours[name].shape) != shape:
            return f"{name} has shape {list(ours[name].shape)} there, {list(shape)} in this config"
    return None


@torch.no_grad()
def load_hf_weights(model: nn.Module, directory: str | Path) -> None:
    """Copy the Hugging Face weights in ``directory`` into ``model`` (on the CPU, before any strategy shards it);
    ValueError when they do not fit (``weights_problem``)."""
    problem = weights_problem(model, directory)
    if problem:
        raise ValueError(f"model.init_from={directory}: {problem}")
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in inspect_safetensors(directory).files:
        state |= load_file(str(file), device="cpu")
    model.load_state_dict(spec_of(model).hf.from_hf(state), strict=True)  # weights_problem: hf is set
