"""How the mixture-of-experts family is split, sharded and counted (its ``ModelSpec``).

This module does not import the model (the model imports it): the MoE layers are found by duck typing, as the
modules holding a ``last_aux_loss`` attribute, which works on the model itself, a DDP/FSDP/ZeRO wrapper of it and
a pipeline stage of it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import nn

from distrain.config.checks import ConfigError, at_least, check
from distrain.models.common.spec import DECODER_MODULES, enable_context_parallel
from distrain.models.llama.spec import check_config as check_llama_config
from distrain.models.llama.spec import check_init_from as check_llama_init_from
from distrain.models.moe.hf import from_hf, hf_config, to_hf
from distrain.models.spec import ExpertParallelPlan, HFCounterpart, ModelSpec, default_parameter_roles


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE feed-forward modules of ``model`` (or of a wrapper or stage of it), in module order."""
    return [module for module in model.modules() if hasattr(module, "last_aux_loss")]


def auxiliary_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum over the MoE layers of the last forward's auxiliary loss (load balancing + router z-loss, already scaled
    by their coefficients; a 0-dim tensor on the model's device); None before any forward."""
    losses = [layer.last_aux_loss for layer in moe_layers(model) if layer.last_aux_loss is not None]
    if not losses:
        return None
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


def metrics(model: nn.Module) -> dict[str, float]:
    """Routing statistics of this rank's last forward, as floats (one host sync per step):

    - ``moe_load_balance``: the Switch balance term ``n_experts * sum_i f_i P_i`` (1 when balanced), mean over layers;
    - ``moe_z_loss``: the router z-loss ``mean(logsumexp(logits)^2)``, mean over layers;
    - ``moe_max_load``: the busiest expert's token count over the mean count, max over layers (1 when balanced);
    - ``moe_expert{i}_frac``: the share of all token-slots (tokens x top_k, all layers) routed to expert i;
    - ``moe_all_to_all_bytes`` (expert parallelism only): bytes this rank sent to other ep ranks over the step's
      forwards and backwards (token rows, their gradients, the counts).
    """
    layers = [layer for layer in moe_layers(model) if layer.last_tokens_per_expert is not None]
    if not layers:
        return {}
    counts = torch.stack([layer.last_tokens_per_expert.float() for layer in layers])  # (layers, experts)
    balance = torch.stack([torch.as_tensor(layer.last_load_balance, dtype=torch.float32) for layer in layers])
    z_loss = torch.stack([torch.as_tensor(layer.last_z_loss, dtype=torch.float32) for layer in layers])
    max_load = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)).max()
    shares = counts.sum(dim=0) / counts.sum().clamp_min(1e-12)
    values = torch.cat([balance.mean()[None], z_loss.mean()[None], max_load[None], shares]).tolist()
    names = ["moe_load_balance", "moe_z_loss", "moe_max_load"] + [f"moe_expert{i}_frac" for i in range(len(shares))]
    routed = dict(zip(names, values, strict=True))
    if any(getattr(layer, "expert_parallel", None) is not None for layer in layers):
        from distrain.models.moe.expert_parallel import all_to_all_bytes

        routed["moe_all_to_all_bytes"] = float(all_to_all_bytes(model))  # this rank's, over the step
    return routed


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of the whole model at ``seq_len``, counting the ACTIVE weights only.

    ``6 * (attention projections + top_k experts' SwiGLU weights + router, per layer; + the output head)`` plus the
    attention term ``12 * n_layers * n_heads * head_dim * seq_len`` (as the Llama spec, how FlopCounterMode counts
    SDPA). Exact, not an average: every token goes to exactly ``top_k`` experts and no token is dropped.
    """
    d, hd = model.d_model, model.head_dim
    attn_weights = 2 * d * model.n_heads * hd + 2 * d * model.n_kv_heads * hd
    expert_weights = model.top_k * 3 * d * model.expert_hidden
    router_weights = d * model.n_experts
    matmul_weights = model.n_layers * (attn_weights + expert_weights + router_weights) + model.vocab_size * d
    attention = 12 * model.n_layers * model.n_heads * hd * seq_len
    return float(6 * matmul_weights + attention)


# No tensor plan (experts are not split across tensor-parallel ranks) and, through the auxiliary loss, no pipeline.
def check_config(cfg: DictConfig) -> None:
    """The Llama part's settings, then the experts', then ``model.init_from`` (``ConfigError`` names the first bad
    key)."""
    init_from = cfg.model.get("init_from")
    if init_from:
        # The Llama checks would read the directory as a Llama's: they run on a copy without it.
        cfg_without = copy.deepcopy(cfg)
        cfg_without.model.init_from = None
        check_llama_config(cfg_without)
    else:
        check_llama_config(cfg)
    for key in ("expert_hidden", "n_experts"):
        check(cfg, f"model.{key}", at_least(1), "an integer >= 1")
    experts = cfg.model.n_experts
    check(cfg, "model.top_k", lambda v: 1 <= v <= experts, f"1..model.n_experts ({experts})")
    for key in ("load_balance_coef", "z_loss_coef"):
        check(cfg, f"model.{key}", at_least(0), "a number >= 0")
    if init_from:
        check_llama_init_from(cfg, same_architecture=check_same_architecture)


def check_same_architecture(cfg: DictConfig, path: Path) -> None:
    """The settings that change the forward but not the weights' shapes (heads, experts per token, norm epsilon,
    RoPE base), read from the directory's config.json, equal the configured ones: weights under another top_k or
    head split would train silently wrong."""
    from distrain.artifacts.hf_directory import read_config
    from distrain.models.moe.hf import from_hf_config

    try:
        theirs = from_hf_config(read_config(path))
    except (ValueError, KeyError, AttributeError, TypeError) as err:  # ArtifactError included
        raise ConfigError("model.init_from", str(path), f"a Mixtral config.json there ({err})") from None
    model = cfg.model
    ours = {"n_kv_heads": model.n_kv_heads or model.n_heads}
    for key in ("n_heads", "n_kv_heads", "n_experts", "top_k", "norm_eps", "rope_theta"):
        value = ours.get(key, model.get(key))
        close = isinstance(value, float) and abs(value - theirs[key]) <= 1e-12 * abs(value)
        if value != theirs[key] and not close:
            raise ConfigError(f"model.{key}", value, f"{theirs[key]}, as in {path / 'config.json'} (model.init_from)")


def _parallelize_experts(model: nn.Module, ep_mesh: object, replicas_group: object) -> None:
    from distrain.models.moe.expert_parallel import parallelize_experts  # imports the model, which imports this

    parallelize_experts(model, ep_mesh, replicas_group)


def _expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    from distrain.models.moe.expert_parallel import expert_parameters

    return expert_parameters(model)


def _sync_expert_gradients(model: nn.Module) -> None:
    from distrain.models.moe.expert_parallel import sync_expert_gradients

    sync_expert_gradients(model)


def parameter_roles(model: nn.Module) -> dict[str, str]:
    """The generic roles, with the stacked expert weights of every mixture-of-experts layer as ``expert``."""
    from distrain.models.moe.expert_parallel import EXPERT_WEIGHTS
    from distrain.models.moe.model import MoEFeedForward

    experts = [
        getattr(module, name)
        for module in model.modules()
        if isinstance(module, MoEFeedForward)
        for name in EXPERT_WEIGHTS
    ]
    return default_parameter_roles(model, MOE_SPEC.after_blocks, experts)


EXPERT_PLAN = ExpertParallelPlan(
    parallelize=_parallelize_experts,
    parameters=_expert_parameters,
    sync_gradients=_sync_expert_gradients,
    num_experts=lambda model: model.n_experts,
)

MOE_SPEC = ModelSpec(
    name="moe",
    document_masking=True,
    **DECODER_MODULES,
    tensor_plan=None,
    flops_per_token=flops_per_token,
    auxiliary_loss=auxiliary_loss,
    metrics=metrics,
    check_config=check_config,
    hf=HFCounterpart(to_hf, from_hf, hf_config),
    context_parallel=enable_context_parallel,  # the family's attention, so its context parallelism
    expert_parallel=EXPERT_PLAN,
    roles=parameter_roles,
)
