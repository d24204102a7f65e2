"""``python -m distrain.tools.generate``: the default run's checkpoint (GPT, DDP, bytes) and a llama_tiny FSDP run's,
on one
process; greedy decoding equals the model's own argmax continuation; bad paths are one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import REPO, run_train

from distrain.tools.generate import load_model

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

PROMPT = "def main("


def generate(*args):
    command = [sys.executable, "-m", "distrain.tools.generate", *map(str, args)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)


def greedy_bytes(checkpoint, prompt, new_tokens):
    """The continuation of ``prompt`` by repeated argmax of the checkpoint's model, computed here."""
    model, cfg = load_model(checkpoint, "cpu")
    ids = list(prompt.encode())
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids[-cfg.data.seq_len :]]))
            ids.append(int(logits[0, -1].argmax()))
    return bytes(ids[len(prompt) :]).decode("utf-8", errors="replace")


@pytest.fixture(
    scope="module",
    params=[["logger=wandb"], ["model=llama_tiny", "parallelism=fsdp", "logger=none"]],
    ids=["default", "llama_tiny-fsdp"],
)
def run_dir(request, tmp_path_factory):
    """The default config, and a llama_tiny run sharded by FSDP: 30 steps each, with their checkpoints."""
    work = tmp_path_factory.mktemp("generate")
    env = {"WANDB_MODE": "offline", "HOME": str(work)}
    overrides = [*request.param, "trainer.max_steps=30", "data.corpus.max_bytes=300000", "hydra.run.dir=run"]
    done = run_train(overrides, work, env=env)
    assert done.returncode == 0, done.stderr
    return work / "run"


def test_greedy_continuation_is_the_models_own(run_dir):
    """From the run directory (its newest checkpoint), temperature 0: exactly the model's argmax continuation."""
    done = generate(run_dir, "--prompt", PROMPT, "--max-new-tokens", 24, "--temperature", 0)
    assert done.returncode == 0, done.stderr
    assert done.stdout == PROMPT + greedy_bytes(run_dir / "checkpoints" / "step_00000030", PROMPT, 24) + "\n"


def test_sampling_is_seeded_and_starts_with_the_prompt(run_dir):
    args = [run_dir / "checkpoints" / "step_00000030", "--prompt", PROMPT, "--max-new-tokens", 40]
    args += ["--temperature", 0.8, "--top-k", 5, "--seed", 1]
    first, again = generate(*args), generate(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(PROMPT) and len(first.stdout) > len(PROMPT) + 10
    assert first.stdout == again.stdout


def test_a_bad_checkpoint_is_one_line(tmp_path):
    missing = generate(tmp_path / "nothing", "--prompt", "x")
    assert (
        missing.returncode == 2
        and missing.stderr.count("\n") == 1
        and "no such checkpoint or run directory" in missing.stderr
    )
    bad_device = generate(tmp_path, "--device", "banana")
    assert bad_device.returncode == 2 and bad_device.stderr.count("\n") == 1 and "not a device" in bad_device.stderr
    damaged = tmp_path / "checkpoints" / "step_00000001"
    damaged.mkdir(parents=True)
    (damaged / "config.yaml").write_text("model: {}\n")
    done = generate(tmp_path, "--prompt", "x")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "holds no complete checkpoint" in done.stderr
