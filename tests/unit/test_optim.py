"""Learning-rate schedules, parameter groups by rule, and Muon's pieces, on one process."""

import math

import pytest
import torch
from helpers import compose_config
from hydra.utils import instantiate

from distrain.models.spec import spec_of
from distrain.optim.checks import rules_of
from distrain.optim.groups import GroupRuleError, GroupRules, canonical_name, param_groups, resolve
from distrain.optim.muon import balanced_owners, buckets, chunk_sizes, orthogonalize, update_scale
from distrain.optim.schedule import warmup_decay_factor

# ------------------------------------------------------------------------------------------------ schedules


def factors(total, **schedule):
    settings = {"warmup_steps": 4, "min_lr_ratio": 0.1, **schedule}
    return [warmup_decay_factor(step, total_steps=total, **settings) for step in range(total)]


def test_wsd_warms_up_holds_then_decays_over_its_fraction():
    curve = factors(20, decay="wsd", decay_fraction=0.25, decay_shape="linear")
    assert curve[:4] == [0.25, 0.5, 0.75, 1.0]
    assert curve[4:15] == [1.0] * 11  # stable until the last 25% (5 steps) of 20
    assert curve[15:] == pytest.approx([1.0, 0.82, 0.64, 0.46, 0.28])
    assert all(a > b for a, b in zip(curve[15:], curve[16:], strict=False))


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_decay_shapes_fall_from_one_towards_the_floor(shape):
    curve = factors(100, decay="wsd", decay_fraction=0.5, decay_shape=shape)
    tail = curve[50:]
    assert tail[0] == 1.0 and all(a >= b for a, b in zip(tail, tail[1:], strict=False))
    assert 0.1 < tail[-1] < 0.2
    halfway = {"linear": 0.55, "cosine": 0.55, "1-sqrt": 0.1 + 0.9 * (1 - math.sqrt(0.5))}[shape]
    assert tail[25] == pytest.approx(halfway, abs=1e-9)


def test_wsd_stable_phase_does_not_depend_on_the_planned_length():
    """What makes a run extendable: before its decay, a shorter plan's factors are the longer plan's."""
    short, long = factors(50, decay="wsd", decay_fraction=0.2), factors(80, decay="wsd", decay_fraction=0.2)
    assert short[:40] == long[:40]
    cosine_short, cosine_long = factors(50, decay="cosine"), factors(80, decay="cosine")
    assert cosine_short[10] != cosine_long[10]  # cosine has no such phase


# ------------------------------------------------------------------------------------------------ groups


def llama(*overrides):
    cfg = compose_config(["model=llama_tiny", "model.tie_embeddings=false", *overrides])
    model = instantiate(cfg.model)
    return cfg, model, spec_of(model).parameter_roles(model)


def test_roles_of_the_llama_family():
    _, model, roles = llama()
    assert roles["tok_embeddings.weight"] == "embedding" and roles["output.weight"] == "head"
    assert roles["norm.weight"] == "norm" and roles["layers.0.attention_norm.weight"] == "norm"
    assert roles["layers.0.attention.wq.weight"] == "matrix" and roles["layers.1.feed_forward.w2.weight"] == "matrix"
    assert set(roles) == {name for name, _ in model.named_parameters()}


def test_mixture_of_experts_names_its_experts_and_gpt_its_biases():
    cfg = compose_config(["model=moe_tiny"])
    model = instantiate(cfg.model)
    roles = spec_of(model).parameter_roles(model)
    assert {roles[f"layers.0.moe.{w}"] for w in ("w1", "w2", "w3")} == {"expert"}
    assert roles["layers.0.moe.router.weight"] == "matrix"
    cfg = compose_config(["model=gpt_tiny"])
    model = instantiate(cfg.model)
    roles = spec_of(model).parameter_roles(model)
    assert roles["pos_emb.weight"] == "embedding" and roles["blocks.0.attn.wq.bias"] == "bias"


def test_groups_follow_the_rules_and_the_table_counts_every_parameter():
    cfg, model, roles = llama("optimizer.no_decay=[norm,embedding]", "optimizer.lr_multipliers.head=0.5")
    summaries, warnings = resolve(model, roles, rules_of(cfg.optimizer))
    assert not warnings
    by_group = {s.group: s for s in summaries}
    assert by_group["no_decay"].names[0] == "tok_embeddings.weight" and by_group["no_decay"].tensors == 10
    assert by_group["decay, lr x0.5 (head)"].names == ["output.weight"]
    assert sum(s.parameters for s in summaries) == sum(p.numel() for p in model.parameters())
    groups = param_groups(model.named_parameters(), roles, rules_of(cfg.optimizer), lr=0.01)
    head = next(g for g in groups if g.get("lr_multiplier") == 0.5)
    assert head["lr"] == 0.005 and head["weight_decay"] == 0.1 and head["params"] == [model.output.weight]
    assert [g["weight_decay"] for g in groups] == [0.0, 0.1, 0.1]  # embedding first (no_decay), matrices, head
    assert all("lr" not in g for g in groups if g is not head)  # the optimizer's own lr: no key old checkpoints lack


def test_a_glob_wins_over_a_role_and_two_globs_on_one_parameter_are_refused():
    _, model, roles = llama()
    rules = GroupRules(0.1, lr_multipliers={"matrix": 2.0, "layers.0.*": 0.5})
    summaries, _ = resolve(model, roles, rules)
    layer0 = next(s for s in summaries if "layers.0.*" in s.group)
    assert "layers.0.attention.wq.weight" in layer0.names and "layers.1.attention.wq.weight" not in layer0.names
    with pytest.raises(GroupRuleError, match="one learning-rate group"):
        resolve(model, roles, GroupRules(0.1, lr_multipliers={"layers.0.*": 0.5, "*.wq.weight": 2.0}))


def test_a_rule_matching_nothing_warns_unless_it_is_a_role_the_model_lacks():
    _, model, roles = llama()
    _, warnings = resolve(model, roles, GroupRules(0.1, no_decay=("norm", "bias", "layer_norm")))
    assert len(warnings) == 1 and "'layer_norm' matches no parameter" in warnings[0]  # bias: Llama has none


def test_muon_on_a_vector_is_refused_in_one_line():
    _, model, roles = llama()
    with pytest.raises(GroupRuleError, match="Muon updates matrices"):
        resolve(model, roles, GroupRules(0.1, muon=("matrix", "norm")))


def test_wrapped_names_find_their_roles():
    assert canonical_name("module.layers.0._checkpoint_wrapped_module.attention.wq.weight") == (
        "layers.0.attention.wq.weight"
    )
    assert canonical_name("_orig_mod.output.weight") == "output.weight"


# ------------------------------------------------------------------------------------------------ muon


@pytest.mark.parametrize("shape", [(32, 64), (64, 16), (3, 24, 12)])
def test_newton_schulz_makes_the_update_nearly_orthogonal(shape):
    torch.manual_seed(0)
    update = torch.randn(shape)
    result = orthogonalize(update)
    small = min(shape[-2:])
    gram = result @ result.mT if shape[-2] <= shape[-1] else result.mT @ result
    singular = torch.linalg.svdvals(result)
    assert gram.shape[-1] == small
    assert singular.min() > 0.5 and singular.max() < 1.3  # the quintic's band around 1, not exactly 1
    assert update_scale(shape) == pytest.approx(0.2 * math.sqrt(max(shape[-2:])))


def test_work_is_balanced_and_shards_split_like_dtensor():
    owners = balanced_owners([100, 10, 60, 50], ranks=2)
    assert sum(s for s, o in zip([100, 10, 60, 50], owners, strict=True) if o == 0) == 110
    assert chunk_sizes(5, 2) == [3, 2] and chunk_sizes(2, 4) == [1, 1, 0, 0]
    assert buckets([0, 1, 2, 3], lambda i: 10, limit=25) == [[0, 1], [2, 3]]
    assert buckets([0], lambda i: 100, limit=25) == [[0]]


# ------------------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize(
    "override,key",
    [
        ("optimizer.lr_multipliers.head=0.5", "optimizer.lr_multipliers"),
        ("optimizer.no_decay=[norm,bias,embedding]", "optimizer.no_decay"),
    ],
)
def test_resuming_with_other_group_rules_is_refused_in_one_line(tmp_path, override, key):
    """The optimizer state is saved by parameter group: other rules would not load (or load the old rates)."""
    from omegaconf import OmegaConf

    from distrain.checkpoint.preflight import check_resumable
    from distrain.config.checks import ConfigError

    saved = compose_config(["model=llama_tiny"])
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    check_resumable(saved, tmp_path, world_size=2)  # the same rules resume, also written otherwise:
    check_resumable(compose_config(["model=llama_tiny", "optimizer.no_decay=[bias,norm]"]), tmp_path, world_size=2)
    with pytest.raises(ConfigError) as refused:
        check_resumable(compose_config(["model=llama_tiny", override]), tmp_path, world_size=2)
    assert refused.value.key == key and "a resumed run keeps the groups" in str(refused.value)


def test_muon_refuses_what_deepspeed_fixes_and_offloaded_shards_in_one_line():
    from distrain.config.checks import ConfigError
    from distrain.optim.checks import validate_optimizer

    for overrides, key in (
        (["parallelism=zero", "optimizer.nesterov=false"], "optimizer.nesterov"),
        (["parallelism=zero", "optimizer.ns_steps=4"], "optimizer.ns_steps"),
        (["parallelism=zero", "parallelism.offload_optimizer=cpu"], "parallelism.offload_optimizer"),
        (["parallelism=zero", "parallelism.stage=3", "parallelism.offload_param=cpu"], "parallelism.offload_param"),
        (["parallelism=fsdp", "parallelism.cpu_offload=true"], "parallelism.cpu_offload"),
    ):
        with pytest.raises(ConfigError) as refused:
            validate_optimizer(compose_config(["optimizer=muon", *overrides]), None)
        assert refused.value.key == key


def test_muon_under_zero_says_once_that_clipping_is_not_applied():
    from distrain.optim.checks import validate_optimizer

    (note,) = validate_optimizer(compose_config(["optimizer=muon", "parallelism=zero"]), None)
    assert note.startswith("trainer.grad_clip_norm=1.0 is not applied with optimizer=muon parallelism=zero")
    assert (
        validate_optimizer(compose_config(["optimizer=muon", "parallelism=zero", "trainer.grad_clip_norm=0"]), None)
        == []
    )
    assert validate_optimizer(compose_config(["optimizer=muon", "parallelism=ddp"]), None) == []


def test_deepspeed_groups_carry_distrains_scale_and_decay_per_matrix_shape():
    """Per shape, DeepSpeed's lr x its own scale is distrain's lr x 0.2 sqrt(max(rows, cols)), and lr x
    weight_decay (the decay per step) is distrain's; the logged base rate stays optimizer.lr."""
    from distrain.optim import optimizers
    from distrain.optim.deepspeed_muon import deepspeed_muon, deepspeed_scale
    from distrain.optim.groups import base_lr

    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8), torch.nn.LayerNorm(8))
    optimizer = optimizers.muon(
        model.named_parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, momentum=0.95,
        nesterov=True, ns_steps=5, bucket_mb=1, lr_multipliers={"matrix": 2.0},
    )  # fmt: skip
    converted = deepspeed_muon(optimizer)
    assert base_lr(converted) == pytest.approx(0.01)
    shapes = set()
    for group in converted.param_groups:
        shape = group["params"][0].shape
        assert all(p.use_muon == group["use_muon"] for p in group["params"])
        if group["use_muon"]:
            assert all(p.shape == shape for p in group["params"])
            shapes.add(tuple(shape))
            assert group["lr"] * deepspeed_scale(shape) == pytest.approx(0.02 * update_scale(shape))
            assert group["lr"] * group["weight_decay"] == pytest.approx(0.02 * 0.1)
            assert group["momentum"] == 0.95 and group["ns_method"] == "standard"
    assert shapes == {(32, 8), (8, 32)}


def test_optimizer_settings_the_checkpoint_restores_are_named_when_changed_on_resume(tmp_path, caplog):
    from omegaconf import OmegaConf

    from distrain.checkpoint.preflight import check_resumable

    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(compose_config([])))
    with caplog.at_level("WARNING", logger="distrain.train"):
        check_resumable(compose_config(["optimizer.lr=1e-3"]), tmp_path, world_size=2)
    assert "optimizer.lr=0.001 (the checkpoint's: 0.003): ignored on resume" in caplog.text


# ------------------------------------------------------------------------------------------------ AdamW's kernel


def test_adamw_on_plain_tensors_takes_the_fused_kernel_and_updates_as_the_loop_does():
    from distrain.models.gpt.model import GPT
    from distrain.optim.optimizers import adamw

    torch.manual_seed(0)
    models = [GPT(vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=2) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    settings = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "no_decay": ["bias", "norm"]}
    fused = adamw(models[0].named_parameters(), **settings)
    assert fused.defaults["fused"] is True
    implementation = ("fused", "foreach")  # the same groups (decay, lr), torch's per-tensor loop
    groups = adamw(models[1].named_parameters(), **settings).param_groups
    loop = torch.optim.AdamW(
        [{k: v for k, v in group.items() if k not in implementation} for group in groups], foreach=False
    )
    assert not loop.param_groups[0]["fused"] and not loop.param_groups[0]["foreach"]
    assert [g["weight_decay"] for g in loop.param_groups] == [g["weight_decay"] for g in fused.param_groups]
    tokens = torch.randint(0, 32, (4, 8))
    for _ in range(3):
        for model, optimizer in zip(models, (fused, loop), strict=True):
            model(tokens).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


def test_a_loaded_checkpoint_keeps_the_kernel_this_layout_chose():
    from distrain.optim.groups import kernels_kept

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], fused=True)
    saved = optimizer.state_dict()
    saved["param_groups"][0] |= {"fused": None, "foreach": False, "lr": 0.5}  # another layout or an older version
    with kernels_kept(optimizer):
        optimizer.load_state_dict(saved)
    group = optimizer.param_groups[0]
    assert (group["fused"], group["foreach"], group["lr"]) == (True, None, 0.5)
