"""Inspector of a local Hugging Face model directory (``config.json`` and safetensors weights), for ``model=hf``.

What it establishes, reading ``config.json`` and the weights' headers only (the model is built on the meta device):
- ``config.json`` is a JSON object transformers reads, every field of the type its config class declares, and its
  ``model_type`` is a causal language model (an encoder only when ``is_decoder`` is set);
- the weights (see ``safetensors_set``) are exactly the tensors the architecture of ``config.json`` has, after
  transformers' own renaming of checkpoint names: none missing (it would start random), none it has no place for
  (weights of another model), each of the shape the config gives it;
- the length of an absolute position table (``n_positions``, ``max_position_embeddings``) when the architecture has
  one, so the caller can compare it with ``data.seq_len``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from distrain.artifacts.safetensors_set import SafetensorsSet, inspect_safetensors
from distrain.errors import ArtifactError
from distrain.models.meta import meta_device

POSITION_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx")


@dataclass(frozen=True)
class HFDirectory:
    """A usable Hugging Face model directory: its transformers config, its weights (None when not asked for), and
    the length of its absolute position table (None: positions are rotary or relative, no table to outgrow)."""

    path: Path
    config: Any
    weights: SafetensorsSet | None
    position_table: int | None


def inspect_hf_directory(path: str | Path, *, weights: bool = True) -> HFDirectory:
    """The Hugging Face causal LM directory at ``path``; ``ArtifactError`` naming the file and the problem otherwise.
    ``weights``: also inspect the safetensors against the architecture (not for ``model.random_init``)."""
    path = Path(str(path)).expanduser()
    if not path.is_dir():
        raise ArtifactError(str(path), "a file, not a model directory" if path.exists() else "no such directory")
    config = read_config(path)
    model = meta_model(config, path)
    found = inspect_safetensors(path) if weights else None
    if found is not None:
        check_weights(model, found, path)
    return HFDirectory(path, config, found, position_table(model, config))


def read_config(path: Path) -> Any:
    """``config.json`` as transformers reads it, its fields of their declared types, a causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ArtifactError(str(path), "no config.json in it (not a Hugging Face model directory)")
    try:
        body = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(str(config_file), f"not JSON ({err})") from None
    if not isinstance(body, dict) or not isinstance(body.get("model_type"), str):
        raise ArtifactError(str(config_file), "not a model config (a JSON object with a model_type string)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers' own validation errors, KeyError for an unknown model_type, ...
        raise ArtifactError(str(config_file), f"transformers cannot read it ({_joined(err)})") from None
    _check_field_types(config_file, body, type(config))
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ArtifactError(str(config_file), f"model_type {config.model_type!r} is not a causal language model")
    if config.model_type in bidirectional_types() and not getattr(config, "is_decoder", False):
        raise ArtifactError(
            str(config_file),
            f"model_type {config.model_type!r} attends both ways (an encoder) unless is_decoder is set",
        )
    return config


def _joined(err: BaseException) -> str:
    """The first two lines of a library's message in one (transformers puts the field's problem on the second)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    return " ".join(lines[:2])[:300]


def _check_field_types(config_file: Path, body: dict, config_class: type) -> None:
    """A field whose default in ``config_class`` is a number or a boolean is not given as a string or an object:
    classes transformers does not validate strictly keep ``"hidden_size": "64"`` and fail inside a rank. (Lists
    stay allowed: ``eos_token_id`` is an int or a list of them.)"""
    try:
        defaults = vars(config_class())
    except Exception:  # a config class that needs arguments: transformers' own validation is all there is
        return
    for key, value in body.items():
        default = defaults.get(key)
        if isinstance(default, bool | int | float) and isinstance(value, str | dict):
            wanted = f"not {type(default).__name__} as {config_class.__name__} declares it"
            raise ArtifactError(str(config_file), f"{key} is {json.dumps(value)}, {wanted}")


def bidirectional_types() -> set[str]:
    """Model types transformers lists as causal LMs whose attention is bidirectional unless ``is_decoder`` is set
    (encoders with a language-model head); BART-like ``ForCausalLM`` classes run the causal decoder alone."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    return (set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) & set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)) - {"bart", "mbart", "mvp"}


def meta_model(config: Any, path: Path) -> nn.Module:
    """The causal LM ``config`` describes, on the meta device (shapes only)."""
    from transformers import AutoModelForCausalLM

    try:
        with meta_device():
            return AutoModelForCausalLM.from_config(config)
    except Exception as err:  # sizes the architecture cannot build (heads not dividing the width, ...)
        raise ArtifactError(
            str(path / "config.json"), f"transformers cannot build its model ({_joined(err)})"
        ) from None


def check_weights(model: nn.Module, found: SafetensorsSet, path: Path) -> None:
    """The weights are exactly ``model``'s tensors, after transformers' renaming of checkpoint names (its base-model
    prefix, and the conversions an architecture declares, such as per-expert weights fused on load)."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    rename = _renamer(model, expected)
    ignored = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    architecture = type(model).__name__
    produced: set[str] = set()
    for name, shape in found.shapes.items():
        target, converted = rename(name)
        if target not in expected:
            if any(pattern.search(name) for pattern in ignored):
                continue
            raise ArtifactError(
                str(_file_of(found, name)),
                f"holds {name}, which the {architecture} of config.json has no place for (weights of another model?)",
            )
        if not converted and shape != expected[target]:
            raise ArtifactError(
                str(_file_of(found, name)),
                f"{name} is {list(shape)} there, config.json makes it {list(expected[target])}",
            )
        produced.add(target)
    missing = _missing(model, expected.keys() - produced, produced)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ArtifactError(
            str(path),
            f"no weights for {missing[0]}{more} of the {architecture} config.json describes: they would start random "
            "(model.random_init=true trains from config.json alone)",
        )


def _renamer(model: nn.Module, expected: dict[str, tuple[int, ...]]) -> Any:
    """name -> (the model's name for it, whether a converter reshapes it), as transformers renames on load."""
    prefix = getattr(model, "base_model_prefix", None) or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
    except (ImportError, AttributeError, TypeError):  # another transformers: the base-model prefix alone
        return lambda name: (_with_prefix(name, prefix, expected), False)

    def rename(name: str) -> tuple[str, bool]:
        target, converter = rename_source_key(name, renamings, converters, prefix, expected)
        return target, converter is not None

    return rename


def _with_prefix(name: str, prefix: str | None, expected: dict[str, Any]) -> str:
    """``name`` under the base-model prefix when only that form is the model's (a base model's checkpoint)."""
    if prefix and name not in expected and f"{prefix}.{name}" in expected:
        return f"{prefix}.{name}"
    return name


def _patterns(model: nn.Module, attribute: str) -> list[re.Pattern]:
    """The model's ``_keys_to_ignore_on_load_*`` as regular expressions; for unexpected keys also the two that
    transformers drops for every model (``_adjust_missing_and_unexpected_keys``): old checkpoints' per-layer
    ``rotary_emb.inv_freq`` and ``position_ids``, once persistent buffers."""
    patterns = set(getattr(model, attribute, None) or ())
    if attribute == "_keys_to_ignore_on_load_unexpected":
        buffers = [name for name, _ in model.named_buffers()]
        if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
            patterns.add(r"rotary_emb\.inv_freq")
        if any(name.endswith("position_ids") for name in buffers):
            patterns.add(r"(^|\.)position_ids$")
    return [re.compile(pattern) for pattern in patterns]


def _missing(model: nn.Module, absent: set[str], produced: set[str]) -> list[str]:
    """The names in ``absent`` that nothing fills: not tied to a present tensor (a tied head is stored once), not
    among those the architecture lets start fresh (``_keys_to_ignore_on_load_missing``)."""
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    present = {id(tensors[name]) for name in produced if name in tensors}
    fresh = _patterns(model, "_keys_to_ignore_on_load_missing")
    return sorted(
        name
        for name in absent
        if id(tensors.get(name)) not in present and not any(pattern.search(name) for pattern in fresh)
    )


def _file_of(found: SafetensorsSet, name: str) -> Path:
    """The file of the set that holds tensor ``name`` (for the refusal's line)."""
    if len(found.files) == 1:
        return found.files[0]
    from distrain.artifacts.safetensors_set import read_header

    return next((file for file in found.files if name in read_header(file)), found.files[0])


def position_table(model: nn.Module, config: Any) -> int | None:
    """Positions an absolute-position model holds, else None: the length ``config.json`` declares when the model
    has an embedding table beside the token embedding that is named for positions (``wpe``, ``embed_positions``)
    or sized by that length (OPT's table is 2 longer)."""
    embeddings = model.get_input_embeddings()
    declared = [getattr(config, field) for field in POSITION_FIELDS if isinstance(getattr(config, field, None), int)]
    tables = [
        module.num_embeddings
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        and module is not embeddings
        and ("pos" in name.rsplit(".", 1)[-1] or name.endswith("wpe") or module.num_embeddings - 2 in declared)
    ]
    if not tables:
        return None
    return min(declared) if declared else min(tables)
