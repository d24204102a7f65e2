"""How the GPT family is split, sharded and counted (its ``ModelSpec``)."""

from __future__ import annotations

from functools import partial

from omegaconf import DictConfig
from torch import nn

from distrain.config.checks import at_least, check
from distrain.models.common.spec import tied_head_problem, tied_pipeline_problem
from distrain.models.gpt.hf import from_hf, hf_config, to_hf
from distrain.models.spec import ConfigProblem, HFCounterpart, ModelSpec
from distrain.models.tensor_plans import DecoderNames, decoder_plan

NAMES = DecoderNames(
    blocks="blocks",
    column=("attn.wq", "attn.wk", "attn.wv", "mlp.w_in"),
    row=("attn.wo", "mlp.w_out"),
    norms=("attn_norm", "mlp_norm"),
    sublayers=("attn", "mlp"),
    final_norm="norm",
    head="head",
)


tensor_plan = partial(decoder_plan, names=NAMES)


def tensor_problem(model: nn.Module, degree: int, split_head: bool) -> ConfigProblem | None:
    """Heads and MLP units must split evenly over the ranks (the vocabulary, for loss_parallel, is checked for
    every model)."""
    if model.n_heads % degree:
        return ConfigProblem("model.n_heads", model.n_heads, f"a multiple of the {degree} tensor-parallel ranks (tp)")
    if model.mlp_ratio * model.d_model % degree:
        return ConfigProblem("model.mlp_ratio", model.mlp_ratio, f"mlp_ratio x d_model divisible by {degree} ranks")
    return tied_head_problem(model, split_head)


def check_config(cfg: DictConfig) -> None:
    """Sizes of ``cfg.model`` a GPT can be built with (``ConfigError`` names the first that is not)."""
    for key in ("d_model", "n_layers", "mlp_ratio"):
        check(cfg, f"model.{key}", at_least(1), "an integer >= 1")
    width = cfg.model.d_model
    check(cfg, "model.n_heads", lambda v: v >= 1 and width % v == 0, f"a divisor of model.d_model ({width})")
    check(cfg, "model.dropout", lambda v: 0 <= v < 1, "a probability in [0, 1)")


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight plus attention scores and values (PaLM appendix B). Counted by
    module, so a head tied to the embedding (one parameter, named as the embedding) still counts."""
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6.0 * matmul + 12.0 * model.n_layers * model.d_model * seq_len


GPT_SPEC = ModelSpec(
    name="gpt",
    document_masking=True,
    blocks="blocks",
    before_blocks=("tok_emb", "pos_emb"),
    after_blocks=("norm", "head"),
    width="d_model",
    tensor_plan=tensor_plan,
    tensor_options=("sequence_parallel", "loss_parallel"),
    tensor_problem=tensor_problem,
    pipeline_problem=tied_pipeline_problem,
    flops_per_token=flops_per_token,
    check_config=check_config,
    hf=HFCounterpart(to_hf, from_hf, hf_config),
)
