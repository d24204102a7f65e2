"""How the Llama family is split, sharded and counted (its ``ModelSpec``), keyed to its module names."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from omegaconf import DictConfig
from torch import nn

from distrain.config.checks import ConfigError, at_least, check, positive
from distrain.errors import ArtifactError
from distrain.models.common.spec import (
    DECODER_MODULES,
    enable_context_parallel,
    tied_head_problem,
    tied_pipeline_problem,
)
from distrain.models.llama.hf import from_hf, hf_config, to_hf
from distrain.models.meta import meta_device
from distrain.models.spec import ConfigProblem, HFCounterpart, ModelSpec
from distrain.models.tensor_plans import DecoderNames, decoder_plan

NAMES = DecoderNames(
    blocks="layers",
    column=("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
    row=("attention.wo", "feed_forward.w2"),
    norms=("attention_norm", "ffn_norm"),
    sublayers=("attention", "feed_forward"),
    final_norm="norm",
    head="output",
)


tensor_plan = partial(decoder_plan, names=NAMES)


def tensor_problem(model: nn.Module, degree: int, split_head: bool) -> ConfigProblem | None:
    """Query heads, key/value heads and the MLP's hidden units split evenly over the ranks; a tied head cannot be
    split over the vocabulary while its embedding stays whole."""
    for key in ("n_heads", "n_kv_heads", "ffn_hidden"):
        if getattr(model, key) % degree:
            return ConfigProblem(
                f"model.{key}", getattr(model, key), f"a multiple of the {degree} tensor-parallel ranks"
            )
    return tied_head_problem(model, split_head)


def check_config(cfg: DictConfig) -> None:
    """Sizes and settings of ``cfg.model`` a Llama (or a mixture of experts built on it) can be built with."""
    model = cfg.model
    for key in ("d_model", "n_layers", "n_heads"):
        check(cfg, f"model.{key}", at_least(1), "an integer >= 1")
    if "ffn_hidden" in model:
        check(cfg, "model.ffn_hidden", at_least(1), "an integer >= 1")
    if model.n_kv_heads is not None:
        heads = model.n_heads
        check(cfg, "model.n_kv_heads", lambda v: v >= 1 and heads % v == 0, f"a divisor of model.n_heads ({heads})")
    for key in ("norm_eps", "rope_theta", "init_std"):
        check(cfg, f"model.{key}", positive, "a number > 0")
    if model.get("init_from"):
        check_init_from(cfg)
    if "rope_scaling" in model:
        check(
            cfg,
            "model.rope_scaling",
            lambda v: not v or v.get("rope_type", v.get("type")) == "llama3",
            "empty (plain RoPE) or Hugging Face's llama3 scaling: {rope_type: llama3, factor, low_freq_factor, "
            "high_freq_factor, original_max_position_embeddings}",
        )


def check_init_from(cfg: DictConfig, same_architecture: Callable[[DictConfig, Path], None] | None = None) -> None:
    """``model.init_from`` is a directory of Hugging Face weights that fit the configured sizes, saved with the
    configured settings (``same_architecture``: the family's check of them; default the Llama one)."""
    from hydra.utils import instantiate

    from distrain.models.hf_weights import weights_problem

    path = Path(cfg.model.init_from)
    if not path.is_dir():
        raise ConfigError("model.init_from", str(path), "a local Hugging Face model directory (no such directory)")
    with meta_device():
        model = instantiate(cfg.model, init_from=None)
    try:
        problem = weights_problem(model, path)
    except ArtifactError as err:  # the files themselves: a missing shard, a truncated file
        raise ConfigError("model.init_from", str(path), f"readable Hugging Face weights ({err})") from None
    if problem:
        raise ConfigError("model.init_from", str(path), f"Hugging Face weights that fit this config: {problem}")
    (same_architecture or check_same_architecture)(cfg, path)


def check_same_architecture(cfg: DictConfig, path: Path) -> None:
    """The settings the weights were trained with (heads, norm epsilon, RoPE, tying), read from the directory's
    config.json, equal the configured ones: weights of the right shapes under another head split, epsilon or RoPE
    base would train silently wrong."""
    from distrain.artifacts.hf_directory import read_config
    from distrain.models.llama.hf import from_hf_config

    try:
        theirs = from_hf_config(read_config(path))
    except (ValueError, KeyError, AttributeError, TypeError) as err:  # ArtifactError included
        raise ConfigError("model.init_from", str(path), f"a Llama config.json there ({err})") from None
    for key in ("n_heads", "n_kv_heads", "norm_eps", "rope_theta", "rope_scaling", "tie_embeddings"):
        ours = cfg.model.get(key)
        ours = (dict(ours) or None) if key == "rope_scaling" and ours is not None else ours
        ours = cfg.model.n_heads if key == "n_kv_heads" and ours is None else ours  # None: as many as query heads
        if key == "tie_embeddings" and theirs[key] and not ours:
            continue  # untying is exact at the start (the head starts as a copy of the embedding): pipelines need it
        if ours != theirs[key] and not (isinstance(ours, float) and abs(ours - theirs[key]) <= 1e-12 * abs(ours)):
            raise ConfigError(f"model.{key}", ours, f"{theirs[key]}, as in {path / 'config.json'} (model.init_from)")


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of the whole (unsplit, unsharded) model at ``seq_len``.

    ``6 * matmul weights`` (forward 2, backward 4; the LM head counts even when tied, the embedding lookup never)
    plus attention scores and values, ``12 * n_layers * n_heads * head_dim * seq_len`` with no causal discount,
    which is how ``torch.utils.flop_counter`` counts SDPA. Read from the model's attributes, so it is the same on
    every pipeline stage and tensor-parallel rank.
    """
    d, hd = model.d_model, model.head_dim
    attn_weights = 2 * d * model.n_heads * hd + 2 * d * model.n_kv_heads * hd
    ffn_weights = 3 * d * model.ffn_hidden
    matmul_weights = model.n_layers * (attn_weights + ffn_weights) + model.vocab_size * d
    attention = 12 * model.n_layers * model.n_heads * hd * seq_len
    return float(6 * matmul_weights + attention)


LLAMA_SPEC = ModelSpec(
    name="llama",
    document_masking=True,
    **DECODER_MODULES,
    tensor_plan=tensor_plan,
    tensor_options=("sequence_parallel", "loss_parallel"),
    tensor_problem=tensor_problem,
    pipeline_problem=tied_pipeline_problem,
    flops_per_token=flops_per_token,
    check_config=check_config,
    hf=HFCounterpart(to_hf, from_hf, hf_config),
    context_parallel=enable_context_parallel,
)
