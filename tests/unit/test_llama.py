"""The built-in Llama: logits equal to transformers' LlamaForCausalLM, the state-dict adapter, the pipeline-style
skip-None forward, meta-device construction and the FLOPs formula."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distrain.models.llama.hf import from_hf, from_hf_config, hf_config, to_hf
from distrain.models.llama.model import Llama
from distrain.models.llama.spec import flops_per_token as llama_flops_per_token

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small enough that every one of the 8 frequencies of a 16-wide head gets scaled or blended.
    "original_max_position_embeddings": 16,
}
CASES = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {"rope_scaling": LLAMA3_SCALING, "max_position_embeddings": 128},
}
TOL = 1e-4


def _hf_model(**overrides):
    transformers = pytest.importorskip("transformers")
    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
        # Above the usual 0.02 so attention is far from uniform and a RoPE mistake moves the logits a lot.
        initializer_range=0.15,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(kwargs | overrides)))
    # HF initialises norms to ones; random weights make a mismatch in the norm's math visible.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model.eval()


def _tokens():
    return torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))


def _ours_from(hf_model):
    model = Llama(**from_hf_config(hf_model.config))
    model.load_state_dict(from_hf(hf_model.state_dict()), strict=True)
    return model.eval()


@torch.no_grad()
def _max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_logits_match_hf(case):
    hf_model = _hf_model(**CASES[case])
    ours = _ours_from(hf_model)
    tokens = _tokens()
    expected = hf_model(tokens).logits
    got = ours(tokens)
    assert got.shape == (2, 32, 96)
    diff = _max_diff(got, expected)
    print(f"{case}: max abs logits diff {diff:.3e}")
    assert diff <= TOL
    if case == "tied":
        assert ours.output.weight is ours.tok_embeddings.weight
    if case == "llama3_rope":
        unscaled = Llama(**(from_hf_config(hf_model.config) | {"rope_scaling": None}))
        unscaled.load_state_dict(ours.state_dict())
        assert _max_diff(unscaled(tokens), expected) > 10 * TOL, "rope_scaling changed nothing: the case is vacuous"


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_round_trip_through_hf(case):
    source = _hf_model(**CASES[case])
    ours = _ours_from(source)
    config = hf_config(ours)
    assert from_hf_config(config) == from_hf_config(source.config)
    config._attn_implementation = "eager"
    target = type(source)(config).eval()
    target.load_state_dict(to_hf(ours.state_dict()), strict=True)
    if ours.tie_embeddings:
        assert target.lm_head.weight is target.model.embed_tokens.weight
    tokens = _tokens()
    diff = _max_diff(target(tokens).logits, ours(tokens))
    print(f"{case}: round-trip max abs logits diff {diff:.3e}")
    assert diff <= TOL


def test_tied_checkpoint_without_lm_head():
    state = _hf_model(tie_word_embeddings=True).state_dict()
    del state["lm_head.weight"]
    ours = from_hf(state)
    assert ours["output.weight"] is ours["tok_embeddings.weight"]


@pytest.mark.parametrize("convert", [to_hf, from_hf])
def test_unknown_key_is_named(convert):
    with pytest.raises(KeyError, match="layers.0.attention.bogus.weight"):
        convert({"layers.0.attention.bogus.weight": torch.zeros(1)})


def _tiny(**overrides):
    torch.manual_seed(0)
    kwargs = dict(vocab_size=96, max_seq_len=64, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=160)
    return Llama(**(kwargs | overrides)).eval()


def _stage(model, keep_layers, **drop):
    """A shallow copy holding ``keep_layers`` only; its own module dicts, so the original is untouched."""
    stage = copy.copy(model)
    stage._modules = dict(model._modules)
    stage.layers = nn.ModuleDict({k: model.layers[k] for k in keep_layers})
    for name in drop:
        setattr(stage, name, None)
    return stage


@torch.no_grad()
def test_pipeline_style_skip_none_forward():
    model = _tiny()
    tokens = _tokens()
    expected = model(tokens)
    no_embedding = _stage(model, model.layers.keys(), tok_embeddings=None)
    assert torch.equal(no_embedding(model.tok_embeddings(tokens)), expected)
    first = _stage(model, ["0"], norm=None, output=None)
    last = _stage(model, ["1", "2"], tok_embeddings=None)
    assert torch.equal(last(first(tokens)), expected)
    assert model.tok_embeddings is not None and len(model.layers) == 3


@torch.no_grad()
def test_attention_infers_local_heads_on_tensor_parallel_shards():
    """Two simulated ranks, each with half the query and kv heads; their partial wo outputs sum to the full one."""
    full = _tiny().layers["0"].attention
    x = torch.randn(2, 32, 64)
    partial = []
    for rank in range(2):
        shard = copy.deepcopy(full)
        for name in ("wq", "wk", "wv"):
            weight = getattr(full, name).weight
            rows = weight.shape[0] // 2
            setattr(shard, name, nn.Linear(64, rows, bias=False))
            getattr(shard, name).weight.copy_(weight[rank * rows : (rank + 1) * rows])
        shard.wo = nn.Linear(32, 64, bias=False)
        shard.wo.weight.copy_(full.wo.weight[:, rank * 32 : (rank + 1) * 32])
        partial.append(shard(x))
    assert _max_diff(partial[0] + partial[1], full(x)) <= 1e-6


def test_builds_on_meta_device():
    with torch.device("meta"):
        model = Llama(
            vocab_size=128256, max_seq_len=8192, d_model=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_hidden=14336
        )
    assert all(p.is_meta for p in model.parameters())
    assert not list(model.buffers())
    assert model.layers["1"].attention.wk.weight.shape == (8 * 128, 4096)


def test_init_std():
    model = _tiny(n_layers=8, d_model=256, n_heads=4, n_kv_heads=4, ffn_hidden=512, vocab_size=512)
    block = model.layers["0"]
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(block.ffn_norm.weight, torch.ones(256))


@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token_matches_flop_counter(tie):
    seq, batch = 64, 2
    model = _tiny(vocab_size=128, n_layers=4, n_kv_heads=2, ffn_hidden=128, tie_embeddings=tie).train()
    linear_weights = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, nn.Linear))
    attention = 12 * 4 * 4 * 16 * seq
    assert llama_flops_per_token(model, seq) == 6 * (linear_weights + 128 * 64) + attention
    tokens = torch.randint(0, 128, (batch, seq))
    # The CPU flash kernel is invisible to FlopCounterMode; the math backend decomposes into counted bmm's.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    measured = counter.get_total_flops() / (batch * seq)
    ratio = llama_flops_per_token(model, seq) / measured
    print(f"tie={tie}: formula / FlopCounterMode = {ratio:.4f}")
    assert ratio == pytest.approx(1.0, rel=0.05)
    assert attention / measured > 0.10, "attention must matter at these sizes, or leaving it out would pass"
