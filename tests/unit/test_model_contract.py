"""The model contract: generic code never names a family's modules, every family's spec splits and counts its
model correctly, and a model without a spec still trains under the data-parallel strategies."""

import ast
import io
import tokenize
from pathlib import Path

import pytest
import torch
from helpers import REPO, compose_config
from hydra.utils import instantiate
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distrain.models.spec import WHOLE_MODEL, spec_of

FAMILIES = ["gpt_tiny", "mlp", "llama_tiny", "moe_tiny"]
# The generic code: strategies, planning, activation checkpointing and compile (parallelism/), monitoring,
# checkpoints and export, the loop, validation, dry runs, the entry point and the model check.
GENERIC = [
    "distrain/parallelism",
    "distrain/monitor",
    "distrain/checkpoint",
    "distrain/trainer/loop.py",
    "distrain/planning/dry_run.py",
    "distrain/config/validate.py",
    "distrain/parallelism/checks.py",
    "distrain/tools/check_model.py",
    "train.py",
]
TORCH_NAMES = {"weight", "bias"}  # torch's own parameter names, not a family's


def tiny(option: str, **overrides: int) -> nn.Module:
    cfg = compose_config([f"model={option}", *(f"model.{k}={v}" for k, v in overrides.items())])
    torch.manual_seed(0)
    return instantiate(cfg.model)


def family_names() -> set[str]:
    """Every module and parameter name (path component) of the built-in families' models."""
    names = set()
    for option in FAMILIES:
        with torch.device("meta"):
            model = tiny(option)
        for path, _ in [*model.named_modules(), *model.named_parameters()]:
            names |= {part for part in path.split(".") if part and not part.isdigit()}
    return names - TORCH_NAMES


def named_attributes(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each ``x.name`` that is not a method call and each string naming a module path with one of
    ``names`` in it (``"attn.wq"``, ``"blocks"``)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    found = []
    for index, token in enumerate(tokens):
        after = tokens[index + 1].string if index + 1 < len(tokens) else ""
        if token.type == tokenize.NAME and token.string in names and tokens[index - 1].string == "." and after != "(":
            found.append((token.start[0], token.string))
        elif token.type == tokenize.STRING:
            try:
                value = ast.literal_eval(token.string)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, str) and " " not in value and names.intersection(value.split(".")):
                found.append((token.start[0], value))
    return found


def test_generic_code_never_names_a_family_module():
    names = family_names()
    assert {"blocks", "wq", "tok_embeddings", "feed_forward", "attn_norm"} <= names
    # The scan finds what it looks for: an attribute read and a plan key, not a method call or prose.
    assert named_attributes("model.blocks.values()\nx = {'attn.wq': 1}\ny.norm()\n'a norm'", names) == [
        (1, "blocks"),
        (2, "attn.wq"),
    ]
    files = [path for entry in GENERIC for path in sorted((REPO / entry).rglob("*.py")) or [REPO / entry]]
    assert len(files) > 15
    hits = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in files
        for line, name in named_attributes(path.read_text(), names)
    ]
    assert not hits, "generic code names a model family's modules (ask the model's spec):\n" + "\n".join(hits)


@pytest.mark.parametrize("option", FAMILIES)
def test_pipeline_stages_are_the_model_with_parts_removed_and_chain_to_the_full_forward(option):
    model = tiny(option, n_layers=3)
    spec = spec_of(model)
    tokens = torch.randint(0, 256, (2, 16))
    blocks = list(spec.block_modules(model))
    stages = [
        spec.stage(model, blocks[:1], first=True, last=False),
        spec.stage(model, blocks[1:2], first=False, last=False),
        spec.stage(model, blocks[2:], first=False, last=True),
    ]
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden)
    assert torch.equal(hidden, model(tokens))
    assert len(spec.block_modules(model)) == 3  # the model itself is untouched
    names = [set(dict(stage.named_parameters())) for stage in stages]
    assert set.union(*names) == set(dict(model.named_parameters())) and not names[0] & names[1]
    assert spec.is_first_stage(stages[0]) and not spec.is_first_stage(stages[1]) and spec.is_last_stage(stages[2])
    # A hook registered on one stage (as FSDP registers its own) runs for that stage only.
    calls = []
    stages[0].register_forward_pre_hook(lambda module, args: calls.append(module))
    stages[2](stages[1](stages[0](tokens)))
    model(tokens)
    assert calls == [stages[0]]


def test_a_tied_head_is_refused_where_tensor_parallelism_would_split_it():
    model = tiny("llama_tiny", tie_embeddings="true")
    spec = spec_of(model)
    assert spec.tensor_parallel_problem(model, 2) is None  # plain: the head stays whole, the tie holds
    for options in ({"sequence_parallel": True}, {"loss_parallel": True}):
        problem = spec.tensor_parallel_problem(model, 2, **options)
        assert problem.key == "model.tie_embeddings", options
    assert "set it false" in spec.splittable_problem(model)


@pytest.mark.parametrize("option", FAMILIES)
def test_flops_per_token_match_torch_flop_counter(option):
    """Forward and backward FLOPs per token within 5% of torch's count (active parameters only for MoE)."""
    model = tiny(option, n_layers=3)
    seq = 64
    tokens = torch.randint(0, 256, (2, seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # the CPU kernel is not counted
        model(tokens).float().square().mean().backward()
    measured = counter.get_total_flops() / tokens.numel()
    predicted = spec_of(model).flops_per_token(model, seq)
    assert abs(predicted / measured - 1) < 0.05, f"{option}: predicted {predicted:.4g}, counted {measured:.4g}"


def test_a_model_without_a_spec_is_one_unit_and_splits_nowhere():
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    spec = spec_of(model)
    assert spec is WHOLE_MODEL and spec.units(model) == [model]
    assert "no tensor-parallel plan" in spec.tensor_parallel_problem(model, 2, False)
    assert "names no blocks" in spec.splittable_problem(model)
    assert spec.flops_per_token(model, 32) == 6 * 8 * 16


def test_train_py_refuses_a_layout_the_model_cannot_take_in_one_line(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "train.py", "model=mlp", "parallelism=tensor", f"hydra.run.dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "model='MLPLanguageModel'" in done.stderr and "has no tensor-parallel plan" in done.stderr


def test_generic_packages_exist():
    assert all((REPO / entry).exists() for entry in GENERIC), [e for e in GENERIC if not (REPO / e).exists()]
    assert Path(REPO / "distrain/models/spec.py").exists()


def test_fsdp_shards_stacked_experts_over_more_ranks_than_experts():
    """Mixtral's 8 experts per layer over 64 ranks: every rank holds 1/64 of the parameters (planned on the fake
    process group with FSDP's own sharding), not the 1/8 that splitting the experts' dimension would give."""
    from distrain.planning.dry_run import plan

    common = ["model=mixtral_8x7b", "dry_run=true", "target.ranks_per_node=8", "target.device=cuda"]
    common += ["parallelism=fsdp", "precision=bf16", "data.micro_batch_size=1", "data.seq_len=256"]
    params = {}
    for nodes in (1, 8):
        report = plan(compose_config([*common, f"target.nodes={nodes}"]))
        params[nodes] = report.ranks[0].params
    total = 46_702_792_704 * 4  # fp32 parameters
    assert abs(params[8] / (total / 64) - 1) < 0.01 and abs(params[1] / (total / 8) - 1) < 0.01, params
