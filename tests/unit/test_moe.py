"""The mixture-of-experts family: routing against a dense reference, the auxiliary losses, the objective's gradient,
the active-parameter FLOPs formula and meta-device construction (train.py with model=moe_tiny:
tests/integration/test_expert_parallel_training.py)."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distrain.models.moe.model import MoE, MoEFeedForward
from distrain.models.moe.spec import MOE_SPEC, auxiliary_loss
from distrain.models.moe.spec import flops_per_token as moe_flops_per_token
from distrain.models.spec import next_token_loss, spec_of

TINY = dict(
    vocab_size=96, max_seq_len=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, expert_hidden=48, n_experts=6
)


def _tiny(**overrides):
    torch.manual_seed(0)
    return MoE(**(TINY | {"top_k": 2} | overrides))


def _ffn(d_model=32, n_experts=6, top_k=2, **kwargs):
    torch.manual_seed(0)
    ffn = MoEFeedForward(d_model, 40, n_experts, top_k, **kwargs)
    ffn.reset_parameters(std=0.1)
    nn.init.normal_(ffn.router.weight, std=0.5)  # a router far from uniform: gates differ, tokens spread out
    return ffn


def _dense_reference(ffn, x):
    """Every expert on every token, weighted by the renormalised top-k gates (zero for the experts not chosen)."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = (tokens @ ffn.router.weight.t()).float().softmax(-1)
    top, chosen = probs.topk(ffn.top_k, dim=-1)
    gates = torch.zeros_like(probs).scatter(1, chosen, top / top.sum(-1, keepdim=True))
    out = torch.zeros_like(tokens)
    for e in range(ffn.n_experts):
        expert = (F.silu(tokens @ ffn.w1[e].t()) * (tokens @ ffn.w3[e].t())) @ ffn.w2[e].t()
        out = out + gates[:, e : e + 1] * expert
    return out.view_as(x)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_routing_matches_dense_reference(top_k):
    ffn = _ffn(top_k=top_k)
    x = torch.randn(3, 20, 32, generator=torch.Generator().manual_seed(1))
    x[..., 0] = 1.0
    x.requires_grad_()
    with torch.no_grad():  # expert 5's logit is -20 for every token: never chosen, so the empty-group path runs
        ffn.router.weight[5] = 0.0
        ffn.router.weight[5, 0] = -20.0
    got = ffn(x)
    counts = ffn.last_tokens_per_expert
    assert counts[5] == 0 and (counts[:5] > 0).all() and counts.sum() == 60 * top_k
    reference = _dense_reference(ffn, x)
    diff = (got - reference).abs().max().item()
    print(f"top_k={top_k}: max |sparse - dense| = {diff:.2e}")
    assert got.shape == x.shape and diff <= 1e-5
    # The gradients agree too (the router's through the gates, the experts' through their groups only).
    grads = torch.autograd.grad(got.square().sum(), [x, ffn.router.weight, ffn.w1, ffn.w2, ffn.w3])
    expected = torch.autograd.grad(reference.square().sum(), [x, ffn.router.weight, ffn.w1, ffn.w2, ffn.w3])
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    assert grads[2][5].abs().max() == 0  # the unused expert's slice of w1


def test_uniform_router_gives_exactly_one_load_balance_and_log_n_z_loss():
    """Zero router weights: every probability is 1/E, so n_experts * sum_i f_i P_i = sum_i f_i = 1 whichever experts
    topk's tie-breaking picks; logsumexp of zero logits is log E."""
    ffn = _ffn(n_experts=8, load_balance_coef=0.01, z_loss_coef=0.001)
    nn.init.zeros_(ffn.router.weight)
    ffn(torch.randn(50, 32))
    assert ffn.last_load_balance.item() == pytest.approx(1.0, abs=1e-6)
    assert ffn.last_z_loss.item() == pytest.approx(math.log(8) ** 2, rel=1e-6)
    assert ffn.last_aux_loss.item() == pytest.approx(0.01 + 0.001 * math.log(8) ** 2, rel=1e-6)


def test_balanced_routing_gives_one_and_skewed_routing_grows():
    n_experts = 8
    ffn = MoEFeedForward(n_experts, 16, n_experts, top_k=2, load_balance_coef=0.5, z_loss_coef=0.0)
    tokens = torch.eye(n_experts)  # token t is the one-hot vector t, so router column t is token t's logits
    with torch.no_grad():
        ffn.router.weight.zero_()
        for t in range(n_experts):  # token t picks experts t and t+1, with uneven probabilities
            ffn.router.weight[t, t] = 3.0 + 0.2 * t
            ffn.router.weight[(t + 1) % n_experts, t] = 2.0
    ffn(tokens)
    assert ffn.last_tokens_per_expert.tolist() == [2] * n_experts  # f uniform, P not
    assert ffn.last_load_balance.item() == pytest.approx(1.0, abs=1e-6)

    with torch.no_grad():
        ffn.router.weight.zero_()
        ffn.router.weight[:2] = 4.0  # every token to experts 0 and 1
    ffn(tokens)
    probs = ffn.router.weight.t().softmax(-1)
    fraction = torch.tensor([0.5, 0.5] + [0.0] * (n_experts - 2))
    expected = n_experts * (fraction * probs.mean(0)).sum().item()
    assert ffn.last_load_balance.item() == pytest.approx(expected, rel=1e-6)
    assert ffn.last_load_balance.item() > 3.5  # tends to n_experts / top_k = 4 as the two experts take everything
    assert ffn.last_aux_loss.item() == pytest.approx(0.5 * expected, rel=1e-6)


def test_z_loss_and_aux_loss_follow_their_formulas():
    ffn = _ffn(load_balance_coef=0.01, z_loss_coef=0.001)
    x = torch.randn(40, 32)
    ffn(x)
    logits = x @ ffn.router.weight.t()
    z_loss = torch.logsumexp(logits, -1).square().mean()
    fraction = ffn.last_tokens_per_expert.float() / 80
    load_balance = 6 * (fraction * logits.softmax(-1).mean(0)).sum()
    assert ffn.last_z_loss.item() == pytest.approx(z_loss.item(), rel=1e-5)
    assert ffn.last_load_balance.item() == pytest.approx(load_balance.item(), rel=1e-5)
    assert ffn.last_aux_loss.item() == pytest.approx(0.01 * load_balance.item() + 0.001 * z_loss.item(), rel=1e-5)
    assert ffn.last_aux_loss.requires_grad and not ffn.last_load_balance.requires_grad


def test_objective_adds_token_weighted_aux_loss_and_trains_the_router_alone():
    model = _tiny()
    assert spec_of(model) is MOE_SPEC and auxiliary_loss(model) is None  # nothing before the first forward
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = model(tokens)
    aux = model.layers["0"].moe.last_aux_loss + model.layers["1"].moe.last_aux_loss
    objective, loss = MOE_SPEC.objective(model, logits.detach(), targets)
    assert torch.equal(loss, next_token_loss(logits.detach(), targets))
    assert objective.item() == pytest.approx((loss + aux * 32).item(), rel=1e-6)
    objective.backward()  # the LM loss is detached: only the auxiliary loss sends gradients
    for layer in model.layers.values():
        assert layer.moe.router.weight.grad.abs().sum() > 0
    # Layer 1's aux loss reaches layer 0's experts through the residual stream; nothing reaches the last experts.
    assert all(getattr(model.layers["1"].moe, w).grad is None for w in ("w1", "w2", "w3"))
    assert model.output.weight.grad is None and model.norm.weight.grad is None

    metrics = MOE_SPEC.step_metrics(nn.Sequential(model))  # found inside a wrapper, as under DDP
    assert metrics["moe_load_balance"] >= 1.0 - 1e-6 and metrics["moe_max_load"] >= 1.0
    assert sum(metrics[f"moe_expert{i}_frac"] for i in range(6)) == pytest.approx(1.0)
    assert metrics["moe_z_loss"] == pytest.approx(
        sum(layer.moe.last_z_loss.item() for layer in model.layers.values()) / 2
    )


def test_flops_per_token_matches_flop_counter():
    seq, batch = 64, 2
    model = _tiny(vocab_size=128, n_layers=4, top_k=2).train()
    attention = 12 * 4 * 4 * 16 * seq
    active = (2 * 64 * 64 + 2 * 64 * 32) + 2 * 3 * 64 * 48 + 64 * 6
    assert moe_flops_per_token(model, seq) == 6 * (4 * active + 128 * 64) + attention
    tokens = torch.randint(0, 128, (batch, seq))
    # The CPU flash kernel is invisible to FlopCounterMode; the math backend decomposes into counted bmm's.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    measured = counter.get_total_flops() / (batch * seq)
    ratio = moe_flops_per_token(model, seq) / measured
    print(f"formula / FlopCounterMode = {ratio:.4f}")
    assert ratio == pytest.approx(1.0, rel=0.05)
    all_experts = 6 * 4 * (6 - 2) * 3 * 64 * 48
    assert all_experts / measured > 0.10, "counting every expert must be visibly wrong at these sizes"


def test_builds_and_runs_on_meta_device():
    """The dry-run planner builds the model on meta and runs one forward there (routing assumed balanced)."""
    with torch.device("meta"):
        model = MoE(**(TINY | {"top_k": 2, "n_layers": 1}))
    assert all(p.is_meta for p in model.parameters()) and not list(model.buffers())
    assert model.layers["0"].moe.w2.shape == (6, 64, 48)
    logits = model(torch.zeros(2, 16, dtype=torch.long, device="meta"))
    assert logits.shape == (2, 16, 96) and logits.is_meta


@pytest.mark.parametrize(
    "override, words",
    [
        ({"expert_hidden": 0}, "expert_hidden is 0"),
        ({"n_experts": 0}, "n_experts is 0"),
        ({"top_k": 7}, "1..n_experts (6)"),
        ({"load_balance_coef": -1.0}, "load_balance_coef is -1.0"),
        ({"z_loss_coef": -1.0}, "z_loss_coef is -1.0"),
    ],
)
def test_constructor_refuses_bad_sizes(override, words):
    with pytest.raises(ValueError, match=re.escape(words)), torch.device("meta"):
        MoE(**(TINY | {"top_k": 2} | override))


def test_init_std():
    model = _tiny(n_layers=8, d_model=256, expert_hidden=512)
    moe = model.layers["0"].moe
    assert moe.w1.std().item() == pytest.approx(0.02, rel=0.05)
    assert moe.w2.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert model.layers["0"].attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
