"""``model=hf``: a local Hugging Face Llama (built in the test with ``save_pretrained``) trains under ddp, fsdp,
zero, tensor and pipeline parallelism with the losses of one process, with activation checkpointing and compile;
its sharded checkpoint exports to a directory transformers loads (with the tokenizer); bad directories are refused
in one line before any rank starts."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO, run_train, save_tiny_hf_llama
from hydra.utils import instantiate
from omegaconf import OmegaConf

from distrain.checkpoint.export import consolidated_model_state

FAST = ["data.corpus.max_bytes=200000", "logger=none", "checkpoint=none"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    # Saved in bf16, as most published models are: distrain trains in fp32 and must export fp32 that loads as fp32.
    return save_tiny_hf_llama(tmp_path_factory.mktemp("hf_tiny"), dtype=torch.bfloat16)


def test_check_model_passes_the_data_tensor_and_pipeline_parallel_layouts(hf_dir):
    check = [sys.executable, "-m", "distrain.tools.check_model", "model=hf", f"model.name_or_path={hf_dir}"]
    done = subprocess.run(
        [*check, "--layouts", "fsdp,tensor,pipeline"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split()[0]: line.split(maxsplit=4)[4] for line in done.stdout.splitlines()[1:]}
    assert [rows[name] for name in ("fsdp", "tensor", "pipeline")] == ["pass"] * 3, rows


def test_trains_with_activation_checkpointing_and_compile_and_exports_what_transformers_loads(hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = ["data.corpus.max_bytes=200000", "logger=none", "model=hf", f"model.name_or_path={hf_dir}"]
    args += ["parallelism=fsdp", "activation_checkpointing=full", "compile=true", "compile_backend=aot_eager"]
    args += ["trainer.max_steps=8", "trainer.log_every=1", "checkpoint.every_n_steps=8"]
    done = run_train([*args, f"hydra.run.dir={tmp_path}"], cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["compile"]["graphs"] >= 1
    # The sharded FSDP checkpoint, exported, is a directory transformers loads, with the source's tokenizer.
    checkpoint, out = tmp_path / "checkpoints" / "step_00000008", tmp_path / "exported"
    export = [sys.executable, "-m", "distrain.checkpoint.export", str(checkpoint), str(out), "--format", "hf"]
    exported = subprocess.run(export, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert loaded.dtype == torch.float32
    ours = instantiate(OmegaConf.load(checkpoint / "config.yaml").model).eval()  # the HF directory's weights
    start = {name: tensor.clone() for name, tensor in ours.state_dict().items()}
    ours.load_state_dict(consolidated_model_state(checkpoint))
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert (ours(tokens) - loaded(tokens).logits).abs().max() < 1e-4
    assert not all(torch.equal(start[name], tensor) for name, tensor in ours.state_dict().items())  # it trained
    assert (
        AutoTokenizer.from_pretrained(out)("hello").input_ids
        == AutoTokenizer.from_pretrained(hf_dir)("hello").input_ids
    )


@pytest.mark.parametrize(
    "path,words",
    [
        ("/no/such/model", "(no such directory)"),
        ("EMPTY", "no config.json in it"),
        ("NOT_CAUSAL", "model_type 'resnet' is not a causal language model"),
        ("NO_WEIGHTS", "no *.safetensors file in it"),
        ("ENCODER", "config.json: model_type 'bert' attends both ways (an encoder) unless is_decoder is set"),
        (
            "RESIZED",
            "model.layers.0.mlp.down_proj.weight is [64, 160] there, config.json makes it [64, 128]",
        ),
        ("TRUNCATED", "model.safetensors: not a safetensors file"),
    ],
)
def test_bad_directories_are_refused_in_one_line(hf_dir, tmp_path, path, words):
    if path == "EMPTY":
        path = tmp_path
    elif path == "NOT_CAUSAL":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "resnet"}))
        path = tmp_path
    elif path == "NO_WEIGHTS":
        (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
        path = tmp_path
    elif path == "ENCODER":  # BERT is listed as a causal LM, but attends both ways unless is_decoder is set
        from transformers import BertConfig

        BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
        path = tmp_path
    elif path in ("RESIZED", "TRUNCATED"):
        config = json.loads((hf_dir / "config.json").read_text())
        config["intermediate_size"] = 128 if path == "RESIZED" else config["intermediate_size"]
        (tmp_path / "config.json").write_text(json.dumps(config))
        weights = (hf_dir / "model.safetensors").read_bytes()
        (tmp_path / "model.safetensors").write_bytes(weights if path == "RESIZED" else weights[:5])
        path = tmp_path
    done = run_train([*FAST, "model=hf", f"model.name_or_path={path}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"model.name_or_path='{path}' is not allowed" in done.stderr and words in done.stderr
