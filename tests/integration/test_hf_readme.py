"""The Hugging Face block (docs/models.md) runs as written: train a local HF model under FSDP, export the checkpoint,
load the export (weights and tokenizer) with transformers."""

from helpers import run_readme_bash_block, save_tiny_hf_llama


def test_the_readme_hugging_face_block_runs_as_written(tmp_path):
    hf = save_tiny_hf_llama(tmp_path / "hf_llama")
    work = tmp_path / "work"
    work.mkdir()
    done = run_readme_bash_block("# HF=", cwd=work, env={"HF": str(hf)}, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("LlamaForCausalLM ["), last
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        path.name for path in (work / "outputs" / "hf_fsdp" / "exported").iterdir()
    }
