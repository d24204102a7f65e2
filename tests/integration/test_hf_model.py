"""``model=hf``: a local Hugging Face Llama (built in the test with ``save_pretrained``) trains under ddp, fsdp,
zero, tensor and pipeline parallelism with the losses of one process, with activation checkpointing and compile;
bad directories are refused in one line before any rank starts."""

import json
import subprocess
import sys

import pytest
from helpers import REPO, run_train, save_tiny_hf_llama

pytestmark = pytest.mark.integration

FAST = ["data.corpus.max_bytes=200000", "logger=none", "checkpoint=none"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_hf_llama(tmp_path_factory.mktemp("hf_tiny"))


def test_check_model_passes_the_data_tensor_and_pipeline_parallel_layouts(hf_dir):
    check = [sys.executable, "-m", "distrain.check_model", "model=hf", f"model.name_or_path={hf_dir}"]
    done = subprocess.run(
        [*check, "--layouts", "ddp,fsdp,zero2,tensor,pipeline"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split()[0]: line.split(maxsplit=4)[4] for line in done.stdout.splitlines()[1:]}
    assert [rows[name] for name in ("ddp", "fsdp", "zero2", "tensor", "pipeline")] == ["pass"] * 5, rows


def test_trains_with_activation_checkpointing_and_compile(hf_dir, tmp_path):
    args = [*FAST, "model=hf", f"model.name_or_path={hf_dir}", "parallelism=fsdp", "activation_checkpointing=full"]
    args += ["compile=true", "compile_backend=aot_eager", "trainer.max_steps=8", "trainer.log_every=1"]
    done = run_train([*args, f"hydra.run.dir={tmp_path}"], cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["compile"]["graphs"] >= 1


@pytest.mark.parametrize(
    "path,words",
    [
        ("/no/such/model", "(no such directory)"),
        ("EMPTY", "(no config.json in it)"),
        ("NOT_CAUSAL", "a causal LM; model_type 'resnet' is not one"),
        ("NO_WEIGHTS", "weights as *.safetensors"),
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
    done = run_train([*FAST, "model=hf", f"model.name_or_path={path}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"model.name_or_path='{path}' is not allowed" in done.stderr and words in done.stderr
