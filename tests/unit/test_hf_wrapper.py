"""``model=hf`` taken apart: a Llama-layout transformers model held as the wrapper's own pieces computes the
transformers model's own logits (sdpa and eager, sliding windows included), splits into pipeline stages, recomputes
its layers, and maps its state dict to Hugging Face's names and back; other architectures are wrapped whole and
refused by tensor and pipeline parallelism in one line naming them and the strategies that train them."""

import pytest
import torch
from torch import nn

from distrain.models.hf import HFCausalLM
from distrain.models.hf.spec import NAMES
from distrain.models.spec import spec_of
from distrain.parallelism.pipeline import split_stages
from distrain.parallelism.recompute import apply_activation_checkpointing

SIZES = dict(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip


def _config(arch: str):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    if arch == "llama":
        return LlamaConfig(**SIZES)
    if arch == "llama_tied":
        return LlamaConfig(**SIZES, tie_word_embeddings=True)
    if arch == "llama_window_key":  # a sliding_window key Llama's forward ignores: the mask must stay full
        return LlamaConfig(**SIZES, sliding_window=5)
    if arch == "mistral":  # a window shorter than the sequence: the mask does the work
        return MistralConfig(**SIZES, sliding_window=5)
    if arch == "qwen2":  # full attention in layer 0, sliding windows above (layer_types)
        return Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=128)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> a directory holding that tiny random transformers model (``save_pretrained``), made once."""
    from transformers import AutoModelForCausalLM

    made = {}

    def save(arch: str):
        if arch not in made:
            torch.manual_seed(0)
            made[arch] = tmp_path_factory.mktemp(arch)
            AutoModelForCausalLM.from_config(_config(arch)).save_pretrained(made[arch])
        return made[arch]

    return save


def _pair(directory, attn: str = "sdpa") -> tuple[HFCausalLM, nn.Module]:
    from transformers import AutoModelForCausalLM

    ours = HFCausalLM(name_or_path=str(directory), max_seq_len=16, attn_implementation=attn)
    theirs = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn, dtype=torch.float32)
    return ours, theirs


TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "llama_window_key", "mistral", "qwen2"])
def test_pieces_compute_the_transformers_models_own_logits(saved, arch, attn):
    ours, theirs = _pair(saved(arch), attn)
    assert ours.split and "hf" not in ours._modules
    with torch.no_grad():
        difference = (ours(TOKENS) - theirs(input_ids=TOKENS).logits).abs().max().item()
    assert difference < 1e-5, f"{arch}/{attn}: {difference}"


def test_state_dict_names_each_tensor_once_and_maps_to_hugging_faces_names(saved):
    ours, theirs = _pair(saved("llama"))
    spec, state = spec_of(ours), ours.state_dict()
    assert not any(name.startswith("hf.") or "rotary_emb" in name for name in state)
    exported = spec.hf.to_hf(state)
    assert exported.keys() == theirs.state_dict().keys()
    assert exported["model.layers.1.self_attn.q_proj.weight"] is state["layers.1.self_attn.q_proj.weight"]
    assert spec.hf.from_hf(theirs.state_dict()).keys() == state.keys()
    assert spec.hf.config(ours) is ours.config


def test_stages_skip_what_they_do_not_hold(saved):
    """Two stages run in turn give the whole model's logits; the second takes hidden states."""
    model = HFCausalLM(name_or_path=str(saved("qwen2")), max_seq_len=16)
    spec = spec_of(model)
    assert spec.splittable_problem(model) is None and spec.hidden_width(model) == SIZES["hidden_size"]
    first, second = split_stages(model, 2, [1], [0, 1])
    assert list(first.layers) == ["0"] and list(second.layers) == ["1", "2"]
    assert spec.is_first_stage(first) and not spec.is_first_stage(second) and spec.is_last_stage(second)
    with torch.no_grad():
        hidden = first(TOKENS)
        assert hidden.shape == (*TOKENS.shape, SIZES["hidden_size"])
        assert torch.equal(second(hidden), model(TOKENS))
    assert set(spec.tensor_plan_for(second, sequence_parallel=False, loss_parallel=False)) == {
        f"layers.{i}.{name}" for i in (1, 2) for name in (*NAMES.column, *NAMES.row)
    }


def test_recomputed_layers_give_the_same_gradients(saved):
    """Activation checkpointing wraps each layer's call; the masks and position embeddings pass through it."""
    directory = saved("mistral")
    grads = []
    for mode in ("none", "full"):
        model = HFCausalLM(name_or_path=str(directory), max_seq_len=16)
        assert len(apply_activation_checkpointing(model, mode)) == (3 if mode == "full" else 0)
        model(TOKENS).square().mean().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert all(torch.allclose(grads[0][name], grads[1][name], atol=1e-6) for name in grads[0])


def test_a_tied_head_refuses_pipelines_in_one_line(saved):
    model = HFCausalLM(name_or_path=str(saved("llama_tied")), max_seq_len=16)
    assert model.lm_head.weight is model.embed_tokens.weight
    problem = spec_of(model).splittable_problem(model)
    assert "tie_word_embeddings" in problem and "\n" not in problem
    state = spec_of(model).hf.to_hf(model.state_dict())
    state.pop("lm_head.weight")  # as safetensors store it: once
    assert spec_of(model).hf.from_hf(state).keys() == model.state_dict().keys()


def test_a_meta_model_gives_its_config_and_runs(saved):
    """Export builds the model on the meta device; validation and dry runs run it there."""
    directory = saved("llama")  # written outside the meta device (the fixture may save it first here)
    with torch.device("meta"):
        model = HFCausalLM(name_or_path=str(directory), max_seq_len=16)
        logits = model(TOKENS.to("meta"))
    assert logits.shape == (*TOKENS.shape, 256) and spec_of(model).hf.config(model).model_type == "llama"


def test_other_architectures_are_wrapped_whole_and_map_names(saved):
    from transformers import GPT2LMHeadModel

    ours, theirs = _pair(saved("gpt2"))
    spec = spec_of(ours)
    assert not ours.split and spec.blocks == "hf.transformer.h"
    with torch.no_grad():
        assert torch.equal(ours(TOKENS), theirs(input_ids=TOKENS).logits)
    fresh = GPT2LMHeadModel(spec.hf.config(ours))
    fresh.load_state_dict(spec.hf.to_hf(ours.state_dict()), strict=True)
    hf_state = {k: v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    assert spec.hf.from_hf(hf_state).keys() == ours.state_dict().keys()


@pytest.mark.parametrize(
    "layout,words",
    [("tensor", "has no tensor-parallel plan"), ("pipeline", "has no pipeline split: only Llama-layout")],
)
def test_other_architectures_refuse_tensor_and_pipeline_in_one_line_naming_what_works(saved, layout, words):
    from distrain.tools.check_model import LAYOUTS, layout_overrides, refusal

    chosen = next(entry for entry in LAYOUTS if entry.name == layout)
    line = refusal(layout_overrides(chosen, 2, ["model=hf", f"model.name_or_path={saved('gpt2')}"]))
    assert "\n" not in line and words in line, line
    assert "gpt2 (GPT2LMHeadModel" in line and "single, ddp, zero, fsdp" in line, line
