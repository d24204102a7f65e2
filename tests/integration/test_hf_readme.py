"""The README's Hugging Face block runs as written: train a local HF model under FSDP, export the checkpoint, load
the export (weights and tokenizer) with transformers."""

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, save_tiny_hf_llama

pytestmark = pytest.mark.integration


def readme_hf_block() -> str:
    readme = (REPO / "README.md").read_text()
    blocks = [block for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if block.startswith("# HF=")]
    assert len(blocks) == 1, "README must hold one bash block starting with '# HF='"
    return blocks[0]


def test_the_readme_hugging_face_block_runs_as_written(tmp_path):
    hf = save_tiny_hf_llama(tmp_path / "hf_llama")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HF": str(hf), "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # Run in a scratch directory, not the checkout: train.py by its path, run directories under work/outputs.
    block = readme_hf_block().replace("python train.py", f"python {REPO / 'train.py'}")
    script = "set -euo pipefail\n" + block.replace("python ", f"{sys.executable} ")
    done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("LlamaForCausalLM ["), last
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        path.name for path in (work / "outputs" / "hf_fsdp" / "exported").iterdir()
    }
