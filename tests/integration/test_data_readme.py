"""The "Your own data" block (docs/data.md) runs as written: prepare a BPE dataset from three standard-library packages,
train llama_tiny on it, and sample from the checkpoint with the tokenizer stored beside the data."""

import json

from helpers import run_readme_bash_block


def test_the_readme_data_block_runs_as_written(tmp_path):
    done = run_readme_bash_block("# your corpus:", cwd=tmp_path)
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
