"""The GPT family is GPT-2 with the exact GELU (its head tied or not): logits equal ``GPT2LMHeadModel``'s with the
converted weights, and the conversion round-trips to identical tensors; nanoGPT's options (no biases, a tied head)
build the model they name."""

import pytest
import torch

from distrain.models.gpt.hf import from_hf, hf_config, to_hf
from distrain.models.gpt.model import GPT

SIZES = {"vocab_size": 256, "max_seq_len": 32, "d_model": 32, "n_layers": 2, "n_heads": 4, "mlp_ratio": 3}


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def gpt(request):
    torch.manual_seed(0)
    model = GPT(**SIZES, tie_embeddings=request.param).eval()
    with torch.no_grad():  # non-zero biases and norms, so a misplaced one shows in the logits
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_logits_equal_gpt2s(gpt, attn_implementation):
    from transformers import GPT2LMHeadModel

    config = hf_config(gpt)
    config._attn_implementation = attn_implementation
    hf = GPT2LMHeadModel(config).eval()
    hf.load_state_dict(to_hf(gpt.state_dict()), strict=True)
    assert (hf.lm_head.weight is hf.transformer.wte.weight) == gpt.tie_embeddings
    tokens = torch.randint(0, SIZES["vocab_size"], (2, SIZES["max_seq_len"]))
    with torch.no_grad():
        difference = (gpt(tokens) - hf(tokens).logits).abs().max().item()
    assert difference < 1e-5, difference


def test_round_trip_gives_identical_tensors(gpt):
    state = gpt.state_dict()
    back = from_hf(to_hf(state))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[key], state[key]) for key in state)


def test_unknown_keys_are_refused():
    with pytest.raises(KeyError, match="blocks.0.attn.rotary"):
        to_hf({"blocks.0.attn.rotary.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="transformer.h.0.attn.masked_bias"):
        from_hf({"transformer.h.0.attn.masked_bias": torch.zeros(1)})


def test_nanogpts_options_build_the_model_they_name():
    """bias=false: no bias anywhere (projections and LayerNorms) and no GPT-2 counterpart; tie_embeddings: one
    tensor for head and embedding, initialised once and counted once among the parameters but twice in FLOPs."""
    from distrain.models.gpt.spec import flops_per_token

    plain, lean = GPT(**SIZES), GPT(**SIZES, bias=False, tie_embeddings=True)
    assert not [name for name, _ in lean.named_parameters() if name.endswith("bias")]
    assert lean.head.weight is lean.tok_emb.weight and lean.head.weight.std().item() == pytest.approx(0.02, rel=0.2)
    head = SIZES["vocab_size"] * SIZES["d_model"]
    biases = sum(p.numel() for name, p in plain.named_parameters() if name.endswith("bias"))
    assert sum(p.numel() for p in lean.parameters()) == sum(p.numel() for p in plain.parameters()) - head - biases
    assert flops_per_token(lean, 32) == flops_per_token(plain, 32)
    with pytest.raises(ValueError, match="model.bias=false has no GPT-2 counterpart"):
        hf_config(lean)
