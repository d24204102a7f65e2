"""How a wrapped Hugging Face causal LM is split, sharded and counted: its spec is built from the model itself.

The decoder layers are found from the model's own ``_no_split_modules`` (the layer classes Hugging Face never
splits): the ``ModuleList`` holding them gives FSDP's, activation checkpointing's and compile's units. Architectures
laid out like Llama (``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``gate_proj``/``up_proj``/``down_proj``) get a
tensor-parallel plan keyed to those names. Pipeline stages need a forward that skips the parts a stage does not
hold, which a Hugging Face forward does not do: pipelines are refused.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig
from torch import nn

from distrain.config_checks import ConfigError, check
from distrain.models.spec import ConfigProblem, ModelSpec, matmul_flops_per_token
from distrain.models.tensor_plans import DecoderNames, decoder_plan

ROOT = "hf"  # the wrapper's attribute holding the transformers model
# model_type -> (layers path, final norm path) of architectures laid out like Llama.
LLAMA_LAYOUT = {name: ("model.layers", "model.norm") for name in ("llama", "mistral", "qwen2", "qwen3")}


def check_config(cfg: DictConfig) -> None:
    """``model.name_or_path`` is a local directory holding a causal LM's config.json (and its safetensors weights
    unless ``random_init``)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kernels = ("sdpa", "eager")
    check(cfg, "model.attn_implementation", lambda v: v in kernels, f"one of {', '.join(kernels)}")
    path = Path(str(cfg.model.name_or_path))
    if not (path / "config.json").is_file():
        missing = "no such directory" if not path.is_dir() else "no config.json in it"
        raise ConfigError("model.name_or_path", str(path), f"a local Hugging Face model directory ({missing})")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        detail = (str(err).strip().splitlines() or [""])[0]
        raise ConfigError("model.name_or_path", str(path), f"a readable config.json ({detail})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError("model.name_or_path", str(path), f"a causal LM; model_type {config.model_type!r} is not one")
    if not cfg.model.random_init and not list(path.glob("*.safetensors")):
        raise ConfigError(
            "model.name_or_path", str(path), "weights as *.safetensors (or model.random_init=true: config.json only)"
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
    """The spec of a wrapped transformers causal LM ``model`` (``model.config.model_type`` picks the plan)."""
    config = model.config
    layers = layers_path(model)
    layout = LLAMA_LAYOUT.get(config.model_type)
    plan = problem = None
    if layout and layers == layout[0]:
        names = DecoderNames(
            blocks=f"{ROOT}.{layers}",
            column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
            row=("self_attn.o_proj", "mlp.down_proj"),
            norms=(),
            sublayers=(),
            final_norm=f"{ROOT}.{layout[1]}",
            head=f"{ROOT}.lm_head",
        )

        def plan(module: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, object]:
            return decoder_plan(module, names, sequence_parallel=False, loss_parallel=False)

        def problem(module: nn.Module, degree: int, split_head: bool) -> ConfigProblem | None:
            for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
                if getattr(config, key) % degree:
                    return ConfigProblem("model.name_or_path", getattr(config, key), f"{key} a multiple of {degree}")
            return None

    return ModelSpec(
        name=f"Hugging Face {type(model).__name__}",
        blocks=f"{ROOT}.{layers}" if layers else None,
        tensor_plan=plan,
        tensor_problem=problem,
        pipeline_problem=lambda _: (
            "a Hugging Face forward runs every layer: a pipeline stage needs a forward that skips the parts it does "
            "not hold (the built-in Llama family, with model.init_from=<HF directory>, has one)"
        ),
        flops_per_token=flops_per_token,
        check_config=check_config,
    )


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """6 per linear weight plus attention scores and values (12 x layers x hidden x seq, as for the Llama family)."""
    config = model.get_submodule(ROOT).config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads_width = config.num_attention_heads * head_dim
    return matmul_flops_per_token(model, seq_len) + 12.0 * config.num_hidden_layers * heads_width * seq_len


# Before the model is built (validation): the directory's checks only.
HF_CONFIG_SPEC = ModelSpec(name="Hugging Face", check_config=check_config)
