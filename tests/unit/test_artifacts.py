"""The inspectors of ``distrain.artifacts`` on real transformers directories built here: what they accept (every
layout ``save_pretrained`` writes: one file, shards with an index, tied heads, experts that transformers fuses on
load) and what they refuse, with the file named. End to end through every command: test_artifact_inspection.py."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from distrain.artifacts.hf_directory import inspect_hf_directory
from distrain.artifacts.outputs import check_writable
from distrain.artifacts.safetensors_set import inspect_safetensors
from distrain.errors import ArtifactError

SMALL = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def save(path, architecture, config, **save_options):
    torch.manual_seed(0)
    getattr(transformers, architecture)(config).save_pretrained(path, **save_options)
    return path


@pytest.mark.parametrize(
    ("architecture", "config"),
    [
        ("LlamaForCausalLM", transformers.LlamaConfig(**SMALL)),
        ("LlamaForCausalLM", transformers.LlamaConfig(**SMALL, tie_word_embeddings=True)),
        ("Qwen2ForCausalLM", transformers.Qwen2Config(**SMALL)),
        ("MixtralForCausalLM", transformers.MixtralConfig(**SMALL, num_local_experts=2)),  # per-expert names on disk
        ("GPT2LMHeadModel", transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16)),
    ],
    ids=["llama", "llama-tied", "qwen2", "mixtral", "gpt2"],
)
def test_what_save_pretrained_writes_is_accepted(tmp_path, architecture, config):
    found = inspect_hf_directory(save(tmp_path / "model", architecture, config))
    model = getattr(transformers, architecture).from_pretrained(tmp_path / "model", local_files_only=True)
    stored = {name for name in model.state_dict() if name in found.weights.shapes}
    assert stored and found.config.model_type == config.model_type
    assert found.position_table == (16 if architecture == "GPT2LMHeadModel" else None)  # rotary: no table


def test_sharded_weights_are_read_through_their_index(tmp_path):
    path = save(tmp_path / "model", "LlamaForCausalLM", transformers.LlamaConfig(**SMALL), max_shard_size="10KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert len(inspect_safetensors(path).files) == len(shards)
    shards[1].unlink()
    with pytest.raises(ArtifactError, match=f"{shards[1].name}: missing: model.safetensors.index.json names it"):
        inspect_hf_directory(path)


def test_config_of_one_model_with_weights_of_another_is_refused(tmp_path):
    """transformers itself loads this, starting every weight it cannot place at random, and exits 0."""
    path = save(tmp_path / "model", "Qwen2ForCausalLM", transformers.Qwen2Config(**SMALL))
    transformers.LlamaConfig(**SMALL).save_pretrained(path)
    with pytest.raises(ArtifactError, match="has no place for .*weights of another model"):
        inspect_hf_directory(path)
    assert inspect_hf_directory(path, weights=False).config.model_type == "llama"  # model.random_init=true


def test_missing_tensor_would_start_random_and_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save(tmp_path / "model", "LlamaForCausalLM", transformers.LlamaConfig(**SMALL))
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, path / "model.safetensors", {"format": "pt"})
    with pytest.raises(ArtifactError, match="no weights for model.layers.1.mlp.down_proj.weight .*start random"):
        inspect_hf_directory(path)


def test_damaged_safetensors_and_config_are_named(tmp_path):
    path = save(tmp_path / "model", "LlamaForCausalLM", transformers.LlamaConfig(**SMALL))
    good = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(good[:-64])
    with pytest.raises(ArtifactError, match=r"model.safetensors: truncated: its header describes \d+ bytes"):
        inspect_safetensors(path)
    (path / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(ArtifactError, match="model.safetensors: not a safetensors file"):
        inspect_safetensors(path)
    (path / "model.safetensors").write_bytes(good)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "hidden_size": "16"}))
    with pytest.raises(ArtifactError, match="config.json: .*hidden_size"):
        inspect_hf_directory(path)


def test_output_paths_below_a_file_or_of_the_wrong_kind_are_refused(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ArtifactError, match="file: is a file, so .* cannot be created below it"):
        check_writable(tmp_path / "file" / "out" / "model.pt", directory=False)
    with pytest.raises(ArtifactError, match="is a file; a directory is written here"):
        check_writable(tmp_path / "file", directory=True)
    with pytest.raises(ArtifactError, match="is a directory; a file is written here"):
        check_writable(tmp_path, directory=False)
    assert check_writable(tmp_path / "new" / "deeper", directory=True) == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists() and (tmp_path / "file").read_text() == "mine"


def test_what_transformers_loads_from_older_checkpoints_is_accepted(tmp_path):
    """Llama 3's list of end-of-sequence ids, and a per-layer rotary inv_freq buffer that old checkpoints stored
    (transformers drops it on load): both load in transformers, so both pass."""
    from safetensors.torch import load_file, save_file

    config = transformers.LlamaConfig(**SMALL, eos_token_id=[1, 2])
    path = save(tmp_path / "model", "LlamaForCausalLM", config)
    state = load_file(path / "model.safetensors")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(state, path / "model.safetensors", {"format": "pt"})
    assert inspect_hf_directory(path).config.eos_token_id == [1, 2]
    _, loading = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(loading.values())  # transformers agrees: nothing missing, unexpected or mismatched


def test_tracker_stores_of_the_wrong_kind_are_refused_before_anything_starts(tmp_path):
    """A text file as MLflow's SQLite database (MLflow would fail only once the ranks run), and a file of the
    user's own text as the JSON-lines runs file (records would be appended to it)."""
    from distrain.trackers.base import JsonlTracker, TrackerSetupError
    from distrain.trackers.mlflow_tracker import MlflowTracker

    (tmp_path / "notes.txt").write_text("my notes\n")
    store = MlflowTracker(
        tracking_uri=f"sqlite:///{tmp_path / 'notes.txt'}", experiment_name="x", run_name=None, tags={}
    )
    with pytest.raises(TrackerSetupError, match="notes.txt: not an SQLite database"):
        store.check()
    with pytest.raises(TrackerSetupError, match="notes.txt: holds lines that are not JSON records"):
        JsonlTracker(path=str(tmp_path / "notes.txt")).check()
    (tmp_path / "runs.jsonl").write_text('{"run": "a", "event": "start"}\n')
    JsonlTracker(path=str(tmp_path / "runs.jsonl")).check()  # an earlier run's file: appended to
    MlflowTracker(tracking_uri=f"sqlite:///{tmp_path / 'new.db'}", experiment_name="x", run_name=None, tags={}).check()
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


def test_a_run_directory_is_used_only_when_its_run_files_are_distrains(tmp_path):
    from distrain.artifacts.run_directory import inspect_run_directory

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 4, "world_size": 2, "final_val_loss": 2.0}))
    (run / "param_groups.json").write_text(json.dumps([{"group": "decay", "names": ["w"]}]))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo')  # a crash cut the last line
    (run / "wandb_run_id").write_text("9f30d27b7d05\n")
    assert inspect_run_directory(run) == run
    for name, text in [
        ("summary.json", '{"accuracy": 0.9}'),
        ("param_groups.json", "[1, 2]"),
        ("metrics.jsonl", '{"epoch": 1}\n'),
        ("wandb_run_id", "my notes about this run\n"),
    ]:
        mine = tmp_path / name.replace(".", "_")
        mine.mkdir()
        (mine / name).write_text(text)
        with pytest.raises(ArtifactError, match=f"{name}: is not a distrain run's {name}.*hydra.run.dir"):
            inspect_run_directory(mine)


def test_step_entries_distrain_did_not_write_are_named_and_never_removed(tmp_path):
    from distrain.checkpoint.directory import foreign_entries, remove_partial_saves

    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / "manifest.json").write_text("{}")  # a save of ours
    (tmp_path / "step_00000004.tmp").mkdir()
    (tmp_path / "step_00000004.tmp" / "rng_rank0.pt").write_bytes(b"x")  # an interrupted save of ours
    (tmp_path / "step_00000006.tmp").mkdir()  # interrupted before any rank wrote
    (tmp_path / "step_00000010.tmp").mkdir()  # killed while DCP wrote its metadata (it renames the .tmp when done)
    (tmp_path / "step_00000010.tmp" / ".metadata.tmp").write_bytes(b"x")
    (tmp_path / "step_00000010.tmp" / "__1.metadata.tmp").write_bytes(b"x")  # DCP's rank-local metadata, unrenamed
    damaged = tmp_path / "step_00000008"  # a save of ours whose manifest was lost: resuming skips it
    (damaged / "deepspeed").mkdir(parents=True)
    for name in ("rng_rank0.pt", "__0_0.distcp", ".metadata", "config.yaml", "zero_to_fp32.py"):
        (damaged / name).write_bytes(b"x")
    assert foreign_entries(tmp_path) == []
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "step_00000003" / "notes.txt").write_text("mine")
    (tmp_path / "step_00000005.tmp").mkdir()
    (tmp_path / "step_00000005.tmp" / "draft.txt").write_text("mine")
    (tmp_path / "step_00000007").write_text("a file")
    names = [p.name for p in foreign_entries(tmp_path)]
    assert names == ["step_00000003", "step_00000005.tmp", "step_00000007"]
    remove_partial_saves(tmp_path)
    assert not (tmp_path / "step_00000004.tmp").exists() and not (tmp_path / "step_00000006.tmp").exists()
    assert not (tmp_path / "step_00000010.tmp").exists()
    assert (tmp_path / "step_00000005.tmp" / "draft.txt").read_text() == "mine"
