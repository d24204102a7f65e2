"""The MoE family against Hugging Face ``MixtralForCausalLM``: same logits from the same weights, lossless renaming
both ways (the fused layout ``to_hf`` writes and the per-expert one ``save_pretrained`` writes), configs that
round-trip, and ``model.init_from`` refusing a Mixtral directory that does not fit in one line."""

import json

import pytest
import torch
from helpers import compose_config
from safetensors import safe_open
from safetensors.torch import save_file

from distrain.config.checks import ConfigError
from distrain.models.hf_weights import load_hf_weights
from distrain.models.moe.hf import from_hf, from_hf_config, hf_config, to_hf
from distrain.models.moe.model import MoE
from distrain.models.moe.spec import MOE_SPEC
from distrain.models.spec import HFCounterpart, spec_of

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402

SIZES = dict(vocab_size=64, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, expert_hidden=24, n_experts=4)
MOE_TINY = ["model=moe_tiny", "model.vocab_size=64", "model.max_seq_len=32", "model.d_model=32", "model.n_layers=2"]
MOE_TINY += ["model.n_heads=4", "model.n_kv_heads=2", "model.expert_hidden=24", "model.n_experts=4"]


def _ours(n_kv_heads=2, top_k=2, seed=0):
    """A tiny MoE with weights large enough that routing, RoPE and norms all move the logits."""
    torch.manual_seed(seed)
    model = MoE(**SIZES, n_kv_heads=n_kv_heads, top_k=top_k, norm_eps=1e-6, rope_theta=500000.0, init_std=0.3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model.eval()


def _tokens(seed=1):
    return torch.randint(0, SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(seed))


def _hf_from_ours(model):
    hf = MixtralForCausalLM(hf_config(model)).eval()
    hf.load_state_dict(to_hf(model.state_dict()), strict=True)
    return hf


@pytest.mark.parametrize("n_kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@torch.no_grad()
def test_logits_equal_mixtral_with_the_same_weights(n_kv_heads, top_k):
    ours = _ours(n_kv_heads, top_k)
    hf = _hf_from_ours(ours)
    tokens = _tokens()
    expected, got = hf(tokens).logits, ours(tokens)
    assert expected.std() > 0.5  # logits far from zero: a wrong mapping could not hide under the tolerance
    assert (got - expected).abs().max().item() < 1e-4


@torch.no_grad()
def test_the_comparison_sees_routing_and_the_gate_up_order():
    ours, tokens = _ours(), _tokens()
    logits = ours(tokens)
    state = to_hf(ours.state_dict())
    hf = MixtralForCausalLM(MixtralConfig(**{**hf_config(ours).to_dict(), "num_experts_per_tok": 1}))
    hf.eval().load_state_dict(state, strict=True)
    assert (hf(tokens).logits - logits).abs().max().item() > 1e-2  # another top_k: other logits
    hf = _hf_from_ours(ours)
    for name, value in state.items():
        if name.endswith("gate_up_proj"):
            hf.get_parameter(name).copy_(value.roll(value.shape[1] // 2, dims=1))  # up and gate swapped
    assert (hf(tokens).logits - logits).abs().max().item() > 1e-2


def test_round_trip_gives_the_same_tensors_and_keys():
    state = _ours().state_dict()
    hf_state = to_hf(state)
    moe_names = ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
    assert {k for k in hf_state if ".mlp." in k} == {f"model.layers.{i}.mlp.{n}" for i in range(2) for n in moe_names}
    assert hf_state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 48, 32)
    back = from_hf(hf_state)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert MOE_SPEC.hf == HFCounterpart(to_hf, from_hf, hf_config)


def test_unknown_keys_are_refused():
    with pytest.raises(KeyError, match="feed_forward"):
        to_hf({"layers.0.feed_forward.w1.weight": torch.zeros(2, 2)})
    with pytest.raises(KeyError, match="gate_proj"):
        from_hf({"model.layers.0.mlp.gate_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(KeyError, match="only one"):
        to_hf({"layers.0.moe.w1": torch.zeros(2, 2, 2)})


@torch.no_grad()
def test_save_pretrained_per_expert_files_load_into_ours(tmp_path):
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        rms_norm_eps=1e-6, rope_theta=250000.0, initializer_range=0.3, sliding_window=None,
    )  # fmt: skip
    hf = MixtralForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as files:
        names = set(files.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names  # the per-expert layout on disk
    ours = MoE(**from_hf_config(AutoConfig.from_pretrained(tmp_path, local_files_only=True)))
    load_hf_weights(ours.eval(), tmp_path)
    tokens = _tokens()
    expected = hf(tokens).logits
    assert expected.std() > 0.5
    assert (ours(tokens) - expected).abs().max().item() < 1e-4


@torch.no_grad()
def test_export_layout_loads_in_transformers_without_warnings_and_back_into_ours(tmp_path):
    ours = _ours()
    # What distrain.checkpoint.export.export_hf writes: to_hf's names in model.safetensors, hf_config's config.json.
    spec = spec_of(ours)
    save_file({k: v.contiguous() for k, v in spec.hf.to_hf(ours.state_dict()).items()}, tmp_path / "model.safetensors")
    spec.hf.config(ours).save_pretrained(tmp_path)
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens = _tokens()
    assert (hf.eval()(tokens).logits - ours(tokens)).abs().max().item() < 1e-4
    reloaded = MoE(**from_hf_config(hf.config), init_from=str(tmp_path))
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in ours.state_dict().items())


def test_config_round_trips_through_from_hf_config(tmp_path):
    ours = _ours(n_kv_heads=2, top_k=3)
    expected = {key: getattr(ours, key) for key in (*SIZES, "n_kv_heads", "top_k", "norm_eps", "rope_theta")}
    expected |= {"init_std": 0.3, "load_balance_coef": ours.load_balance_coef}
    assert from_hf_config(hf_config(ours)) == expected
    hf_config(ours).save_pretrained(tmp_path)  # and through config.json
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["sliding_window"] is None and saved["router_jitter_noise"] == 0.0 and saved["model_type"] == "mixtral"
    assert from_hf_config(AutoConfig.from_pretrained(tmp_path, local_files_only=True)) == expected


@pytest.mark.parametrize(
    "change, words",
    [
        ({"sliding_window": 16}, "sliding_window 16"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "RoPE scaling"),
    ],
)
def test_from_hf_config_refuses_another_forward_in_one_line(change, words):
    config = MixtralConfig(**{**hf_config(_ours()).to_dict(), **change})
    with pytest.raises(ValueError, match=words) as err:
        from_hf_config(config)
    assert "\n" not in str(err.value)
    config = MixtralConfig(**{**hf_config(_ours()).to_dict(), "sliding_window": 32})  # >= every sequence: no change
    assert from_hf_config(config)["max_seq_len"] == 32


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Our tiny MoE (moe_tiny at MOE_TINY's sizes) exported as a Mixtral directory."""
    path = tmp_path_factory.mktemp("mixtral")
    ours = MoE(**SIZES, n_kv_heads=2, top_k=2)
    save_file({k: v.contiguous() for k, v in to_hf(ours.state_dict()).items()}, path / "model.safetensors")
    hf_config(ours).save_pretrained(path)
    return path


def test_init_from_accepts_a_fitting_directory(exported):
    MOE_SPEC.check_config(compose_config([*MOE_TINY, f"model.init_from={exported}"]))


@pytest.mark.parametrize(
    "extra, key, words",
    [
        (["model.expert_hidden=16"], "model.init_from", "layers.0.moe.w1 has shape [4, 24, 32] there"),
        (["model.n_experts=8"], "model.init_from", "layers.0.moe.w1 has shape [4, 24, 32] there, [8, 24, 32]"),
        (["model.top_k=1"], "model.top_k", "2, as in"),
        (["model.n_heads=2", "model.n_kv_heads=1"], "model.n_heads", "4, as in"),
        (["model.rope_theta=500000"], "model.rope_theta", "10000.0, as in"),
    ],
)
def test_init_from_refuses_a_directory_that_does_not_fit_in_one_line(exported, extra, key, words):
    cfg = compose_config([*MOE_TINY, f"model.init_from={exported}", *extra])
    with pytest.raises(ConfigError) as err:
        MOE_SPEC.check_config(cfg)
    assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_init_from_refuses_a_dense_llama_directory(tiny_hf_llama):
    overrides = ["model=moe_tiny", "model.d_model=64", "model.n_layers=2", f"model.init_from={tiny_hf_llama}"]
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=r"does not have: .*mlp\.\w+_proj") as err:
        MOE_SPEC.check_config(cfg)
    assert "\n" not in str(err.value)
