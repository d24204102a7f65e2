"""Hugging Face weights in and out for the built-in Llama: ``model.init_from`` starts from a local HF directory
(logits equal to transformers'), training from it under tensor, pipeline and ZeRO-3 parallelism, ``export --format
hf`` of each one's checkpoint format that ``AutoModelForCausalLM.from_pretrained`` loads with distrain's logits (and
the source's tokenizer beside it), tensors identical after ours -> HF -> ours, and one-line refusals of bad
directories."""

import shutil
import subprocess
import sys

import pytest
import torch
from helpers import REPO, run_train, save_tiny_tokenizer
from hydra.utils import instantiate
from omegaconf import OmegaConf

from distrain.checkpoint.export import consolidated_model_state
from distrain.models.llama.hf import from_hf, from_hf_config, to_hf
from distrain.models.llama.model import Llama

HF_SIZES = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
# The same sizes as train.py overrides of model=llama_tiny.
OVERRIDES = [
    "model=llama_tiny",
    "model.d_model=64",
    "model.ffn_hidden=160",
    "model.n_layers=2",
    "model.max_seq_len=64",
    "model.norm_eps=1e-6",  # transformers' default, which the HF model was saved with
    "data.corpus.max_bytes=200000",
    "data.micro_batch_size=4",
    "logger=none",
]


STRATEGIES = {
    "tensor": ["parallelism=tensor"],
    "pipeline": ["parallelism=pipeline"],
    "zero3": ["parallelism=zero", "stage=3"],
}


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random LlamaForCausalLM saved with ``save_pretrained`` (safetensors) with a tokenizer, and the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**HF_SIZES, initializer_range=0.1, bos_token_id=5, eos_token_id=7, pad_token_id=None)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return path, model


def test_init_from_starts_from_the_hf_weights(hf_llama):
    path, hf = hf_llama
    ours = Llama(**from_hf_config(hf.config), init_from=str(path)).eval()
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() < 1e-4


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_trains_from_hf_weights_and_exports_what_transformers_loads(hf_llama, tmp_path, strategy):
    """Each strategy's checkpoint format (DCP of DTensors, DCP of pipeline stages, DeepSpeed ZeRO-3 shards)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, hf = hf_llama
    run = tmp_path / "run"
    args = [*OVERRIDES, f"model.init_from={path}", *STRATEGIES[strategy], "trainer.max_steps=2"]
    done = run_train([*args, "checkpoint.every_n_steps=2", f"hydra.run.dir={run}"], cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    checkpoint = run / "checkpoints" / "step_00000002"
    out = tmp_path / "exported"
    export = [sys.executable, "-m", "distrain.checkpoint.export", str(checkpoint), str(out), "--format", "hf"]
    exported = subprocess.run(export, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pt"))  # safetensors only: nothing pickled
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    state = consolidated_model_state(checkpoint)
    ours = Llama(**from_hf_config(hf.config)).eval()
    ours.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert (ours(tokens) - loaded(tokens).logits).abs().max() < 1e-4
        trained = (ours(tokens) - hf(tokens).logits).abs().max()
    assert trained > 1e-3  # two steps of training moved the weights away from the HF start
    back = from_hf(to_hf(state))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    reloaded = Llama(**from_hf_config(hf.config), init_from=str(out)).state_dict()  # ours -> HF files -> ours
    assert reloaded.keys() == state.keys() and all(torch.equal(reloaded[k], state[k]) for k in state)
    special = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert [getattr(loaded.config, name) for name in special] == [getattr(hf.config, name) for name in special]
    text = "hello distributed world"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == AutoTokenizer.from_pretrained(path)(text).input_ids


@pytest.mark.parametrize(
    "extra,words",
    [
        (["model.init_from=/nonexistent/llama"], "no such directory"),
        (["model.d_model=128"], "model.init_from="),
        (["model.rope_theta=500000"], "10000.0, as in"),
        (["model.n_heads=8", "model.n_kv_heads=4"], "model.n_heads=8 is not allowed: 4, as in"),
    ],
)
def test_bad_init_from_is_refused_in_one_line(hf_llama, tmp_path, extra, words):
    path, _ = hf_llama
    args = [*OVERRIDES, f"model.init_from={path}", *extra, f"hydra.run.dir={tmp_path}"]
    done = run_train(args, cwd=REPO)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert words in done.stderr and "model.init_from" in done.stderr


@pytest.mark.parametrize("family", ["gpt_tiny", "mlp"])
def test_export_of_gpt_is_gpt2_and_of_a_family_without_a_counterpart_is_one_line(tmp_path, family):
    from transformers import AutoModelForCausalLM
    from transformers.models.gpt2 import GPT2LMHeadModel

    run = tmp_path / "run"
    args = [f"model={family}", "model.n_layers=1", "data.corpus.max_bytes=200000", "parallelism=ddp", "logger=none"]
    done = run_train([*args, "trainer.max_steps=1", "checkpoint.every_n_steps=1", f"hydra.run.dir={run}"], cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    checkpoint = run / "checkpoints" / "step_00000001"
    export = [sys.executable, "-m", "distrain.checkpoint.export", str(checkpoint), str(tmp_path / "out")]
    exported = subprocess.run([*export, "--format", "hf"], cwd=REPO, capture_output=True, text=True, timeout=120)
    if family == "mlp":
        assert exported.returncode == 2 and exported.stderr.count("\n") == 1, exported.stderr
        assert "the mlp model has no Hugging Face counterpart" in exported.stderr and not (tmp_path / "out").exists()
        return
    assert exported.returncode == 0, exported.stderr
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert isinstance(loaded, GPT2LMHeadModel)
    cfg = OmegaConf.load(checkpoint / "config.yaml")
    ours = instantiate(cfg.model).eval()
    ours.load_state_dict(consolidated_model_state(checkpoint))
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert (ours(tokens) - loaded(tokens).logits).abs().max() < 1e-4


def save_tiny(path, architecture, **overrides):
    """A tiny random transformers model of ``architecture`` (LlamaForCausalLM, MistralForCausalLM) of HF_SIZES."""
    import transformers

    torch.manual_seed(0)
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    getattr(transformers, architecture)(config_class(**HF_SIZES, **overrides)).save_pretrained(path)
    return path


def test_tied_weights_start_an_untied_model_that_pipelines(tmp_path):
    """Llama 3.2 1B ties its head to its embedding; model.tie_embeddings=false starts both from the one tensor."""
    tied = save_tiny(tmp_path / "tied", "LlamaForCausalLM", tie_word_embeddings=True)
    args = [*OVERRIDES, f"model.init_from={tied}", "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"]
    done = run_train([*args, "model.tie_embeddings=false", "parallelism=pipeline"], cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    refused = run_train([*args, "model.tie_embeddings=true", "parallelism=pipeline"], cwd=REPO)
    assert refused.returncode == 2 and "set it false" in refused.stderr, refused.stderr


def test_init_from_another_architecture_is_one_line(tmp_path):
    mistral = save_tiny(tmp_path / "mistral", "MistralForCausalLM")
    done = run_train([*OVERRIDES, f"model.init_from={mistral}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "model.init_from" in done.stderr and "this one is 'mistral'" in done.stderr


def test_a_run_started_from_hf_weights_resumes_without_them(hf_llama, tmp_path):
    """The checkpoint holds the weights: a resume needs neither the directory the run started from nor its path
    (moved or deleted since); the architecture is still compared."""
    source = tmp_path / "source"
    shutil.copytree(hf_llama[0], source)
    args = [*OVERRIDES, "parallelism=single", "checkpoint.every_n_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    first = run_train([*args, f"model.init_from={source}", "trainer.max_steps=2"], cwd=REPO)
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(source)
    resumed = run_train([*args, "model.init_from=null", "trainer.max_steps=3", "checkpoint.resume=auto"], cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in (tmp_path / "run" / "train.log").read_text()
