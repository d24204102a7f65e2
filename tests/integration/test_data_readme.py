"""The README's "Your own data" block runs as written: prepare a BPE dataset from three standard-library packages,
train llama_tiny on it, and sample from the checkpoint with the tokenizer stored beside the data."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.integration


def readme_data_block() -> str:
    readme = (REPO / "README.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if b.startswith("# your corpus:")]
    assert len(blocks) == 1, "README must hold one bash block starting with '# your corpus:'"
    return blocks[0]


def test_the_readme_data_block_runs_as_written(tmp_path):
    # Run in a scratch directory, not the checkout: train.py by its path, data/ and outputs/ under tmp_path.
    block = readme_data_block().replace("python train.py", f"python {REPO / 'train.py'}")
    script = "set -euo pipefail\n" + block.replace("python ", f"{sys.executable} ")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    index = json.loads((tmp_path / "data" / "stdlib_bpe" / "train.json").read_text())
    assert index["vocab_size"] == 4096 and index["tokenizer"] == "tokenizer.json"
    run = tmp_path / "outputs" / "stdlib_bpe"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    assert losses[-1] < losses[0] - 1.0, losses  # it learned from the data
    saved = (run / "checkpoints" / "step_00000100" / "config.yaml").read_text()
    assert "vocab_size: 4096" in saved  # the model's vocabulary came from the data
    sampled = done.stdout.split("import ", 1)  # prepare's summary line, then generate's prompt and continuation
    assert len(sampled) == 2 and len(sampled[1].strip()) >= 20, done.stdout
    assert str(tmp_path / "data" / "stdlib_bpe") in saved  # saved absolute: export and generate run from anywhere
