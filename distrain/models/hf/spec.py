"""How a wrapped Hugging Face causal LM is split, sharded and counted: its spec is built from the model itself.

Architectures laid out like Llama (``llama``, ``mistral``, ``qwen2``, ``qwen3``) are held by the wrapper as its own
children (``embed_tokens``, ``rotary_emb``, ``layers``, ``norm``, ``lm_head``) with a forward that skips what a
pipeline stage does not hold: their decoder layers are the blocks, a tensor-parallel plan is keyed to Hugging Face's
names (``q_proj`` ... ``down_proj``) and pipelines split them (untied ones). Other architectures are wrapped whole
(``hf``): their decoder layers, found from the model's own ``_no_split_modules``, are FSDP's, activation
checkpointing's and compile's units, and tensor and pipeline parallelism refuse them in one line naming the
architecture and the strategies that train it. Both map their state dict to the transformers model's names.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import nn

from distrain.config.checks import ConfigError, check
from distrain.errors import ArtifactError
from distrain.models.spec import (
    ConfigProblem,
    HFCounterpart,
    ModelSpec,
    default_parameter_roles,
    matmul_flops_per_token,
)
from distrain.models.tensor_plans import DecoderNames, decoder_plan

ROOT = "hf"  # the wrapper's child holding a transformers model wrapped whole
LLAMA_LAYOUT = ("llama", "mistral", "qwen2", "qwen3")  # model_type of architectures taken apart
ATTENTION_KINDS = ("full_attention", "sliding_attention")  # the layer types whose masks the wrapper builds
DATA_PARALLEL = "single, ddp, zero, fsdp"
NAMES = DecoderNames(
    blocks="layers",
    column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    row=("self_attn.o_proj", "mlp.down_proj"),
    norms=(),
    sublayers=(),
    final_norm="norm",
    head="lm_head",
)
# Our names of a Llama-layout wrapper's top-level pieces -> the transformers model's.
_TO_HF = {
    "embed_tokens.": "model.embed_tokens.",
    "layers.": "model.layers.",
    "norm.": "model.norm.",
    "lm_head.": "lm_head.",
}


def check_config(cfg: DictConfig) -> None:
    """``model.name_or_path`` is a local Hugging Face causal LM directory that passes its inspector (config.json,
    and unless ``random_init`` weights that are exactly its architecture's), and ``data.seq_len`` fits an absolute
    position table; document masking only for Llama-layout architectures."""
    from distrain.artifacts.hf_directory import inspect_hf_directory

    kernels = ("sdpa", "eager")
    check(cfg, "model.attn_implementation", lambda v: v in kernels, f"one of {', '.join(kernels)}")
    path = str(cfg.model.name_or_path)
    try:
        found = inspect_hf_directory(path, weights=not cfg.model.random_init)
    except ArtifactError as err:
        where = "" if err.where == str(Path(path).expanduser()) else f"{err.where}: "
        raise ConfigError(
            "model.name_or_path", path, f"a usable Hugging Face model directory ({where}{err.problem})"
        ) from None
    model_type = getattr(found.config, "model_type", None)
    if cfg.data.get("document_masking") and model_type not in LLAMA_LAYOUT:
        raise ConfigError(
            "data.document_masking",
            True,
            f"false for a Hugging Face {model_type} model: only Llama-layout architectures ({', '.join(LLAMA_LAYOUT)}) "
            "take documents (distrain runs their layers with restarted position ids and packed masks)",
        )
    table = found.position_table
    if table is not None:
        check(cfg, "data.seq_len", lambda v: v <= table, f"at most {table}, the positions {path}/config.json holds")


def attention_kinds(config: object) -> tuple[str, ...]:
    """Each decoder layer's attention kind, as the architecture's own forward picks its mask: ``layer_types``
    (Qwen2, Qwen3), sliding everywhere when ``sliding_window`` is set (Mistral), else full (Llama, whose forward
    ignores a ``sliding_window`` key its config.json may carry)."""
    kinds = getattr(config, "layer_types", None)
    if kinds and config.model_type in ("qwen2", "qwen3"):
        return tuple(kinds)
    sliding = config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None
    return ("sliding_attention" if sliding else "full_attention",) * config.num_hidden_layers


def has_llama_layout(model: nn.Module) -> bool:
    """Whether the transformers ``model`` is laid out like Llama, so the wrapper can hold its pieces: a listed
    ``model_type``, ``model.{embed_tokens, layers, norm, rotary_emb}`` and ``lm_head``, and only full or sliding
    attention layers (whose masks the wrapper builds)."""
    inner = getattr(model, "model", None)
    pieces = [getattr(inner, name, None) for name in ("embed_tokens", "norm", "rotary_emb")]
    return (
        model.config.model_type in LLAMA_LAYOUT
        and isinstance(getattr(inner, "layers", None), nn.ModuleList)
        and all(isinstance(piece, nn.Module) for piece in [*pieces, getattr(model, "lm_head", None)])
        and set(attention_kinds(model.config)) <= set(ATTENTION_KINDS)
    )


def layers_path(model: nn.Module) -> str | None:
    """Path (below the transformers model) of the ModuleList of its decoder layers, from ``_no_split_modules``."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for path, module in model.named_modules():
        children = list(module.children()) if isinstance(module, nn.ModuleList) else []
        if children and all(type(child).__name__ in layer_classes for child in children):
            return path
    return None


def hf_spec(model: nn.Module) -> ModelSpec:
    """The spec of an ``HFCausalLM`` ``model``: taken apart (Llama layout) or wrapped whole."""
    return llama_layout_spec(model) if model.split else whole_spec(model)


def llama_layout_spec(model: nn.Module) -> ModelSpec:
    """Blocks ``layers``, embedding first, final norm and head last, a tensor plan keyed to Hugging Face's names."""

    def to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_renamed(name, _TO_HF): tensor for name, tensor in state.items()}

    def from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        back = {hf: ours for ours, hf in _TO_HF.items()}
        return _with_ties({_renamed(name, back): tensor for name, tensor in state.items()}, ties)

    ties = tied_names(model)
    return ModelSpec(
        name=f"Hugging Face {model.config.model_type} ({model.architecture})",
        blocks="layers",
        before_blocks=("embed_tokens",),
        after_blocks=("norm", "lm_head"),
        width="hidden_size",
        tensor_plan=tensor_plan,
        tensor_problem=tensor_problem,
        pipeline_problem=pipeline_problem,
        flops_per_token=flops_per_token,
        check_config=check_config,
        hf=HFCounterpart(to_hf, from_hf, hf_config),
        document_masking=True,
    )


def whole_spec(model: nn.Module) -> ModelSpec:
    """Blocks from ``_no_split_modules`` (data-parallel units only); no tensor plan, no pipeline split."""
    name = f"Hugging Face {model.config.model_type} ({model.architecture}; data-parallel only: {DATA_PARALLEL})"
    layers = layers_path(model.get_submodule(ROOT))
    ties = tied_names(model)

    def to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_renamed(key, {f"{ROOT}.": ""}): tensor for key, tensor in state.items()}

    def from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _with_ties({f"{ROOT}.{key}": tensor for key, tensor in state.items()}, ties)

    return ModelSpec(
        name=name,
        blocks=f"{ROOT}.{layers}" if layers else None,
        pipeline_problem=lambda _: (
            f"the {name} model has no pipeline split: only Llama-layout architectures ({', '.join(LLAMA_LAYOUT)}) "
            "have one"
        ),
        flops_per_token=flops_per_token,
        check_config=check_config,
        hf=HFCounterpart(to_hf, from_hf, hf_config),
        roles=whole_model_roles,
    )


def whole_model_roles(wrapper: nn.Module) -> dict[str, str]:
    """The generic roles, with the matrix of the transformers model's output embeddings (its LM head) as ``head``
    (a head tied to the input embedding stays ``embedding``): the wrapper names no ``after_blocks`` to find it by."""
    roles = default_parameter_roles(wrapper, ())
    head = wrapper.get_submodule(ROOT).get_output_embeddings()
    head_ids = {id(param) for param in head.parameters()} if head is not None else set()
    for name, param in wrapper.named_parameters():
        if id(param) in head_ids and roles[name] == "matrix":
            roles[name] = "head"
    return roles


def tensor_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, object]:
    """Column-parallel q/k/v and gate/up, row-parallel o/down in every block held (no sequence or loss parallel
    form: ``tensor_options`` is empty, so validation refuses those options)."""
    return decoder_plan(model, NAMES, sequence_parallel=False, loss_parallel=False)


def tensor_problem(model: nn.Module, degree: int, split_head: bool) -> ConfigProblem | None:
    """Query heads, key/value heads and the MLP's hidden units split evenly over the ranks."""
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(model.config, key)
        if value % degree:
            return ConfigProblem("model.name_or_path", value, f"config.json's {key} a multiple of {degree}")
    return None


def pipeline_problem(model: nn.Module) -> str | None:
    """A tied head is one weight in the first and the last stage."""
    if model.config.tie_word_embeddings:
        return (
            f"{model.config.model_type} ties lm_head to embed_tokens (tie_word_embeddings in config.json): one weight "
            f"would be in the first and the last stage; {DATA_PARALLEL} and tensor train it"
        )
    return None


def hf_config(model: nn.Module) -> object:
    """The transformers config of the wrapped model (a plain attribute: also on the meta device, and on a stage)."""
    return model.config


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of state-dict names sharing one parameter (a tied head and embedding)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _renamed(name: str, prefixes: dict[str, str]) -> str:
    for old, new in prefixes.items():
        if name.startswith(old):
            return new + name.removeprefix(old)
    raise KeyError(f"no Hugging Face state-dict mapping for key {name!r}")


def _with_ties(state: dict[str, torch.Tensor], ties: list[list[str]]) -> dict[str, torch.Tensor]:
    """``state`` with each tied name it lacks filled from a present one (safetensors store a tied tensor once)."""
    for names in ties:
        present = [name for name in names if name in state]
        for name in names:
            if present and name not in state:
                state[name] = state[present[0]]
    return state


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """6 per linear (or Conv1D) weight plus attention scores and values (12 x layers x hidden x seq, as for the
    Llama family)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads_width = config.num_attention_heads * head_dim
    # GPT-2-like models keep their projections in transformers' Conv1D (an (in, out) weight), not nn.Linear.
    conv1d = 6.0 * sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "Conv1D")
    attention = 12.0 * config.num_hidden_layers * heads_width * seq_len
    return matmul_flops_per_token(model, seq_len) + conv1d + attention


# Before the model is built (validation): the directory's checks only.
# Document masking is checked against the directory's architecture by check_config.
HF_CONFIG_SPEC = ModelSpec(name="Hugging Face", check_config=check_config, document_masking=True)
