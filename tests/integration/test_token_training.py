"""Training on token shards through train.py: a corpus of text, JSON Lines and Parquet prepared and trained on,
bit-identical losses after a resume on shards, nanoGPT bins, the vocabulary taken from the data (or nanoGPT's
character-level meta.pkl, which also decodes generate's samples), a damaged dataset refused in one line, and sampling
from the checkpoint with the tokenizer beside the data."""

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, nanogpt_char_dataset, run_train, write_token_dataset
from omegaconf import OmegaConf

STDLIB_BYTES = np.frombuffer((REPO / "distrain" / "config" / "validate.py").read_bytes() * 8, dtype=np.uint8)
COMMON = ["data=tokens", "logger=none", "model.n_layers=1", "data.micro_batch_size=4", "data.seq_len=64"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Byte-valued ids in three train shards and one validation shard (vocabulary 256)."""
    cut = len(STDLIB_BYTES) * 9 // 10
    train = np.array_split(STDLIB_BYTES[:cut], 3)
    return write_token_dataset(tmp_path_factory.mktemp("shards"), {"train": train, "val": [STDLIB_BYTES[cut:]]})


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records if "loss" in record}


def test_resume_on_shards_is_bit_identical(shards, tmp_path):
    args = [*COMMON, f"data.path={shards}", "trainer.max_steps=8", "trainer.log_every=1", "checkpoint.every_n_steps=4"]
    whole = run_train([*args, f"hydra.run.dir={tmp_path / 'whole'}"], cwd=REPO)
    assert whole.returncode == 0, whole.stderr[-2000:]
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_00000004"
    resumed = run_train([*args, f"hydra.run.dir={tmp_path / 'resumed'}", f"checkpoint.resume={checkpoint}"], REPO)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    before, after = losses(tmp_path / "whole"), losses(tmp_path / "resumed")
    assert sorted(after) == [5, 6, 7, 8] and all(after[step] == before[step] for step in after), (before, after)


def test_nanogpt_bins_train_with_the_vocabulary_of_the_data(tmp_path):
    data = tmp_path / "nanogpt"
    data.mkdir()
    ids = STDLIB_BYTES.astype(np.uint16) * 3
    ids[5] = 699  # the largest id: the model must get 700 entries
    ids[: len(ids) * 9 // 10].tofile(data / "train.bin")
    ids[len(ids) * 9 // 10 :].tofile(data / "val.bin")
    args = [*COMMON, f"data.path={data}", "trainer.max_steps=2", "checkpoint.every_n_steps=2"]
    done = run_train([*args, f"hydra.run.dir={tmp_path / 'run'}"], REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = OmegaConf.load(tmp_path / "run" / "checkpoints" / "step_00000002" / "config.yaml")
    assert saved.model.vocab_size == 700
    overridden = run_train([*args, "model.vocab_size=1024", f"hydra.run.dir={tmp_path / 'run2'}"], REPO)
    assert overridden.returncode == 0, overridden.stderr[-2000:]
    assert OmegaConf.load(tmp_path / "run2" / "checkpoints" / "step_00000002" / "config.yaml").model.vocab_size == 1024


def test_nanogpt_char_data_trains_and_generates_with_its_meta_pkl(tmp_path):
    """meta.pkl gives the vocabulary (not the largest id + 1) and decodes generate's ids; a meta.pkl that would run
    code, or maps fewer characters than the bins use, is one line before any rank starts."""
    text = (REPO / "distrain" / "config" / "validate.py").read_text() * 4
    nanogpt_char_dataset(tmp_path / "char", text)
    chars = sorted(set(text))
    args = [*COMMON, f"data.path={tmp_path / 'char'}", "trainer.max_steps=2", "checkpoint.every_n_steps=2"]
    done = run_train([*args, f"hydra.run.dir={tmp_path / 'run'}"], REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert OmegaConf.load(checkpoint / "config.yaml").model.vocab_size == len(chars)
    generate = [sys.executable, "-m", "distrain.tools.generate", str(checkpoint), "--max-new-tokens", "30"]
    sampled = subprocess.run([*generate, "--prompt", "def "], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("def ") and set(sampled.stdout) <= {*chars, "\n"}
    assert len(sampled.stdout) == len("def ") + 30 + 1  # one character per id, and print's newline
    padded = run_train([*args, "model.vocab_size=128", f"hydra.run.dir={tmp_path / 'padded'}"], REPO)
    assert padded.returncode == 0, padded.stderr[-2000:]  # nanoGPT's habit: a vocabulary padded past meta.pkl's
    generate_padded = [*generate[:3], str(tmp_path / "padded"), "--max-new-tokens", "200", "--temperature", "2"]
    sampled = subprocess.run(generate_padded, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert sampled.returncode == 0 and set(sampled.stdout) <= {*chars, "\n"}, sampled.stderr  # only decodable ids
    unknown = subprocess.run([*generate, "--prompt", "\u00e9"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "is not in this vocabulary" in unknown.stderr, unknown.stderr

    (tmp_path / "char" / "meta.pkl").unlink()
    (tmp_path / "char" / "meta.pkl").mkdir()  # not a file: refused, not taken for absent
    refused = run_train([*args, f"hydra.run.dir={tmp_path / 'dir'}"], REPO)
    assert refused.returncode == 2 and "meta.pkl: unreadable" in refused.stderr, refused.stderr
    (tmp_path / "char" / "meta.pkl").rmdir()
    (tmp_path / "char" / "meta.pkl").write_bytes(pickle.dumps({"stoi": {}, "itos": {}, "run": print}))
    refused = run_train([*args, f"hydra.run.dir={tmp_path / 'bad'}"], REPO)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "meta.pkl" in refused.stderr and "names builtins.print" in refused.stderr
    short = {"vocab_size": 2, "itos": {0: "a", 1: "b"}, "stoi": {"a": 0, "b": 1}}
    (tmp_path / "char" / "meta.pkl").write_bytes(pickle.dumps(short))
    refused = run_train([*args, f"hydra.run.dir={tmp_path / 'short'}"], REPO)
    assert refused.returncode == 2 and f"maps 2 characters, but the bins hold the id {len(chars) - 1}" in refused.stderr


def test_a_damaged_dataset_is_one_line_before_any_rank_starts(shards, tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for file in shards.iterdir():
        (damaged / file.name).write_bytes(file.read_bytes())
    shard = damaged / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    done = run_train([*COMMON, f"data.path={damaged}", f"hydra.run.dir={tmp_path / 'run'}"], REPO)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "data.path=" in done.stderr and "train-00001.bin: holds" in done.stderr


def test_generate_samples_from_a_checkpoint(shards, tmp_path):
    args = [*COMMON, f"data.path={shards}", "trainer.max_steps=2", "checkpoint.every_n_steps=2"]
    assert run_train([*args, f"hydra.run.dir={tmp_path}"], REPO).returncode == 0
    generate = [sys.executable, "-m", "distrain.tools.generate", str(tmp_path / "checkpoints" / "step_00000002")]
    done = subprocess.run(
        [*generate, "--prompt", "def ", "--max-new-tokens", "20", "--tokenizer", "bytes"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("def ") and len(done.stdout) > len("def ")
    done = subprocess.run(  # the dataset has no tokenizer: one line saying how to give one
        [*generate, "--max-new-tokens", "20"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--tokenizer PATH" in done.stderr, done.stderr


def test_text_jsonl_and_parquet_prepared_then_trained_with_the_loss_falling(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from distrain.data.corpus import stdlib_source_files
    from distrain.data.prepare import prepare

    sources = [path.read_text(errors="replace") for path in stdlib_source_files()[:60]]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number, text in enumerate(sources[:20]):
        (corpus / f"doc{number}.txt").write_text(text)
    lines = [json.dumps({"body": text}) for text in sources[20:40]]
    (corpus / "docs.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"body": sources[40:]}), corpus / "docs.parquet")
    summary = prepare([corpus], tmp_path / "data", vocab_size=1024, text_field="body", val_fraction=0.1, quiet=True)
    assert summary["documents"] == 60
    args = ["data=tokens", f"data.path={tmp_path / 'data'}", "logger=none", "model=llama_tiny", "trainer.max_steps=20"]
    args += ["trainer.log_every=1", "checkpoint.every_n_steps=20", f"hydra.run.dir={tmp_path / 'run'}"]
    done = run_train(args, REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    trained = losses(tmp_path / "run")
    assert trained[20] < trained[1] - 0.3, trained  # 6.94 -> 6.50 measured
    saved = OmegaConf.load(tmp_path / "run" / "checkpoints" / "step_00000020" / "config.yaml")
    assert saved.model.vocab_size == 1024
    generate = [
        sys.executable,
        "-m",
        "distrain.tools.generate",
        str(tmp_path / "run" / "checkpoints" / "step_00000020"),
    ]
    sampled = subprocess.run(
        [*generate, "--prompt", "def ", "--max-new-tokens", "10"], cwd=REPO, capture_output=True, text=True
    )
    assert sampled.returncode == 0 and sampled.stdout.startswith("def "), sampled.stderr
    # Exported to Hugging Face, the model comes with the dataset's tokenizer.
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    checkpoint, out = tmp_path / "run" / "checkpoints" / "step_00000020", tmp_path / "exported"
    export = [sys.executable, "-m", "distrain.checkpoint.export", str(checkpoint), str(out), "--format", "hf"]
    exported = subprocess.run(export, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    text = sources[0][:300]
    theirs = AutoTokenizer.from_pretrained(out)
    assert theirs(text).input_ids == Tokenizer.from_file(str(tmp_path / "data" / "tokenizer.json")).encode(text).ids
    assert theirs.eos_token == "<|endoftext|>"
    # The model's config names the same end of text, so generate() stops where the training documents ended.
    from transformers import AutoConfig, GenerationConfig

    eos_id = theirs.convert_tokens_to_ids("<|endoftext|>")
    config = AutoConfig.from_pretrained(out)
    assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (eos_id, None, None)
    assert GenerationConfig.from_model_config(config).eos_token_id == eos_id


def understated_dataset(directory, bad_positions):
    """Two train shards of ids below 200 with 250 at ``bad_positions`` of the second, indexes saying vocabulary 200."""
    rng = np.random.default_rng(0)
    train = [rng.integers(0, 200, 20_000), rng.integers(0, 200, 20_000)]
    train[1][bad_positions] = 250
    data = write_token_dataset(directory, {"train": train, "val": [rng.integers(0, 200, 3_000)]}, 200)
    for split in ("train", "val"):
        index = json.loads((data / f"{split}.json").read_text())
        (data / f"{split}.json").write_text(json.dumps({**index, "vocab_size": 200, "max_token_id": 199}))
    return data


@pytest.mark.parametrize(
    ("bad_positions", "found_at"),
    [(slice(1_000, None, 2_000), "the first step"), (slice(15_000, 15_001), "step 33")],
    ids=["first-step", "mid-run"],
)
def test_an_id_above_the_vocabulary_stops_every_rank_at_a_step_boundary(tmp_path, bad_positions, found_at):
    """An index that understates its ids. Mid-run, the rank whose prefetched read of the next step fails says so
    at the boundary before that step, every rank agrees there, the steps trained are saved (an emergency
    checkpoint) and the job ends with one line naming the shard; in the first step (read when the step starts,
    nothing trained yet) that rank ends the job at once. Before, it raised at the step's start while its peer
    waited in a collective: 30 s more, no checkpoint. The seeded sampler first draws a bad window at ``found_at``."""
    data = understated_dataset(tmp_path / "data", bad_positions)
    args = [
        *COMMON,
        f"data.path={data}",
        "data.micro_batch_size=8",
        "trainer.max_steps=60",
        "checkpoint.every_n_steps=0",
    ]
    done = run_train([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"distrain: {data / 'train-00001.bin'}: holds token id 250, not below 200 (the vocabulary of the model and "
        "of train.json, whose max_token_id 199 is wrong): prepare the dataset again"
    )
    assert "Traceback" not in done.stderr and "peers did not reach the step boundary" not in done.stderr
    saved = sorted(path.name for path in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == ([] if found_at == "the first step" else ["step_00000032"])  # nothing trained is lost
