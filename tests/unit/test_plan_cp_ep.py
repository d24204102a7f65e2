"""The dry run's per-rank memory for context- and expert-parallel layouts (planned in-process on the fake group), and
the layouts it refuses."""

import math

import pytest
import torch
from helpers import compose_config
from hydra.utils import instantiate

from distrain.config.validate import ConfigError
from distrain.models.moe.expert_parallel import EXPERT_WEIGHTS
from distrain.models.moe.model import MoEFeedForward
from distrain.models.spec import spec_of
from distrain.planning.dry_run import plan

COMMON = ["data=synthetic", "target.device=cuda"]  # synthetic: no corpus to read
HYBRID = [*COMMON, "parallelism=hybrid"]
TWO, FOUR = "target.nodes=1 target.ranks_per_node=2", "target.nodes=1 target.ranks_per_node=4"


def planned(*overrides: str):
    cfg = compose_config([*HYBRID, *" ".join(overrides).split()])
    return plan(cfg), cfg


def meta_model(cfg) -> torch.nn.Module:
    with torch.device("meta"):
        return instantiate(cfg.model)


def test_cp_activations_hold_local_tokens_plus_the_gathered_keys_and_values():
    whole, cfg = planned("model=llama_tiny", TWO)  # dp 2, all 128 tokens per rank
    split, _ = planned("model=llama_tiny", FOUR, "parallelism.cp=2")  # dp 2 x cp 2: 64 each
    local, _ = planned("model=llama_tiny", TWO, "data.seq_len=64")  # 64 tokens, no gather
    full, cp_rank = whole.ranks[0].activations, split.ranks[0].activations
    assert full / 2 < cp_rank < full, (full, cp_rank)
    # Over the local tokens' own: at least the keys and values (head-repeated to every query head, fp32) of the
    # other cp rank's 64 tokens, in every layer.
    model = meta_model(cfg)
    other = cfg.data.micro_batch_size * 64 * model.d_model * 4
    assert cp_rank - local.ranks[0].activations >= model.n_layers * 2 * other
    assert "mesh: dp_replicate 1 x dp 2 x cp 2 x tp 1 x pp 1 = 4 ranks; ep 1" in split.describe()
    assert split.as_dict()["mesh"] == {"dp_replicate": 1, "dp": 2, "cp": 2, "tp": 1, "pp": 1, "ep": 1}


def test_cp_times_dp_shards_the_model_as_fsdp_over_their_product():
    split, _ = planned("model=llama_tiny", FOUR, "parallelism.cp=2")
    fsdp = plan(compose_config([*COMMON, "model=llama_tiny", "parallelism=fsdp", *FOUR.split()]))
    dp_only, _ = planned("model=llama_tiny", TWO)
    held = ("params", "grads", "optimizer", "gathered")
    assert [getattr(split.ranks[0], key) for key in held] == [getattr(fsdp.ranks[0], key) for key in held]
    assert split.ranks[0].params < dp_only.ranks[0].params


def expert_ids(model: torch.nn.Module) -> set[int]:
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    return {id(getattr(layer, name)) for layer in layers for name in EXPERT_WEIGHTS}


def fsdp_rank0_elements(param: torch.nn.Parameter, ranks: int) -> int:
    """Rank 0's share of a parameter FSDP shards on dim 0 (padded to equal shares)."""
    return math.ceil(param.shape[0] / ranks) * math.prod(param.shape[1:])


def test_ep_holds_half_the_experts_whole_and_fsdp_shards_of_the_rest():
    report, cfg = planned("model=moe_tiny", TWO, "parallelism.ep=2")
    model = meta_model(cfg)
    experts = expert_ids(model)
    expected = sum(
        (p.numel() // 2 if id(p) in experts else fsdp_rank0_elements(p, 2)) * 4 for p in model.parameters()
    )  # fp32 at rest
    row = report.ranks[0]
    assert row.params == row.grads == expected, (row.params, expected)
    # FSDP gathers only the non-expert parameters: the root's and two blocks' (all blocks are alike).
    blocks = list(spec_of(model).block_modules(model).values())
    rest = sum(p.numel() for p in model.parameters() if id(p) not in experts)
    block = sum(p.numel() for p in blocks[0].parameters() if id(p) not in experts)
    assert row.gathered == (rest - (len(blocks) - 2) * block) * 4
    assert "dp 2 x cp 1 x tp 1 x pp 1 = 2 ranks; ep 2" in report.describe()


@pytest.mark.parametrize("precision,activation_bytes", [("fp32", 4), ("bf16", 2)])
def test_ep_activations_add_the_combined_rows_the_sort_index_and_expert_casts(precision, activation_bytes):
    no_ep, cfg = planned("model=moe_tiny", TWO, f"precision={precision}")
    ep, _ = planned("model=moe_tiny", TWO, "parallelism.ep=2", f"precision={precision}")
    model = meta_model(cfg)
    slots = cfg.data.micro_batch_size * cfg.data.seq_len * model.top_k  # per layer, balanced or not
    routed = model.n_layers * slots * (model.d_model * activation_bytes + 8)
    held_experts = sum(p.numel() for p in model.parameters() if id(p) in expert_ids(model)) // 2
    casts = held_experts * activation_bytes if precision == "bf16" else 0  # autocast's copies of fp32 experts
    assert ep.ranks[0].activations == no_ep.ranks[0].activations + routed + casts


REFUSED = [
    ("model=mixtral_8x7b parallelism.ep=3 target.nodes=2 target.ranks_per_node=8 precision=bf16", "parallelism.ep"),
    ("model=llama3_8b parallelism.cp=3 target.nodes=8 target.ranks_per_node=8 data.seq_len=8192", "parallelism.cp"),
]


@pytest.mark.parametrize("overrides,key", REFUSED)
def test_dry_run_refuses_layouts_that_cannot_divide(overrides, key):
    with pytest.raises(ConfigError) as err:
        planned(*overrides.split())
    assert err.value.key == key and f"{key}=3 is not allowed" in str(err.value)
