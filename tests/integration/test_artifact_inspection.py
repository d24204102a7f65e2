"""Damaged artifacts are refused before any training step: in one line, within 30 s, touching nothing (issue 40).

A table of artifact kind x damage x entry point: Hugging Face model directories (``model=hf``,
``model.init_from``), token datasets (``data=tokens``), tokenizers, checkpoints, output paths and tracker stores,
each kind through every entry point that reads it (``train.py``, ``python -m distrain.tools.check_model``, ``-m
distrain.checkpoint.export``, ``-m distrain.tools.generate``, ``-m distrain.data.prepare``): every damage of a kind
runs through every entry point that reads that kind (``NOT_EVERY_READER`` says why for the three that cannot). Each
row is a real subprocess; all rows run at once on a few workers. Every row must exit non-zero within 30 s with no
traceback, end its stderr with one ``distrain`` line naming the config key or the damaged file, take no training
step, and leave every file that existed before it byte-identical.

The good artifacts are made once (a tiny Llama saved with ``save_pretrained``, the same weights in three shards, a
GPT-2 with a 16-position table, a dataset made by ``prepare`` itself, a checkpoint of a two-step ``train.py`` run and
one of a ``model=hf`` run) and each entry point is shown to exit 0 on them (``test_the_undamaged_artifacts_work``):
a failing row is a damage that went undetected, not a broken fixture.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helpers import REPO, run_in_own_group, save_tiny_hf_llama
from warm import WarmPython

LIMIT_S = 30  # a refusal must come within this
KILL_S = 60  # a row still running then is killed and reported as a hang
WORKERS = 3
ENV = {"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
STEP_LINE = re.compile(r"\bstep \d+/\d+ \|")  # the reporter's line of a logged step (trainer.log_every=1)
CHECK_ROW = re.compile(r"^single\s+1\s+\d", re.M)  # check_model's table row of a one-process run that trained
SHARD = "model-00002-of-00003.safetensors"  # the middle one of the sharded directory's three
VOCAB = 257  # the tiny tokenizer's ids (256 bytes and <eos>): the dataset's, the Llama's, the checkpoint's
PROMPT = "w300 w1000"  # ids 300 and 1000 in the oversized word-level tokenizer; bytes in the good one

# The sizes of helpers.save_tiny_hf_llama as model=llama_tiny overrides (model.init_from must fit them).
LLAMA = ["model=llama_tiny", "model.d_model=64", "model.ffn_hidden=160", "model.n_layers=2", "model.norm_eps=1e-6"]
LLAMA += ["model.max_seq_len=32"]
HF = ["model=hf", "model.max_seq_len=32"]  # data.seq_len follows model.max_seq_len
STDLIB = ["data.corpus.max_bytes=200000"]
GPT = ["model.n_layers=2", "model.d_model=64", "model.max_seq_len=32", *STDLIB]  # the default model, smaller


def tokens(path: Path | str) -> list[str]:
    return ["data=tokens", f"data.path={path}"]


# ------------------------------------------------------------------------------------------------- artifacts


@dataclass(frozen=True)
class Artifacts:
    root: Path
    hf_llama: Path  # LlamaForCausalLM of VOCAB ids, one model.safetensors, its tokenizer.json beside it
    hf_sharded: Path  # the same weights in three shards with model.safetensors.index.json
    hf_gpt2: Path  # GPT2LMHeadModel whose position table holds 16 positions
    corpus: Path  # the JSON Lines the dataset was prepared from
    data: Path  # prepare's output with hf_llama's tokenizer
    checkpoint: Path  # step_00000002 of a llama_tiny run on data, started from hf_sharded (model.init_from)
    hf_checkpoint: Path  # step_00000002 of a model=hf run whose source directory was moved away afterwards
    hf_source: Path  # where that source directory was


@dataclass
class Invocation:
    args: list[str]  # after the interpreter
    env: dict[str, str] = field(default_factory=dict)
    run_dir: Path | None = None  # train.py's run directory: no step may be recorded there
    output: Path | None = None  # what export or prepare would write: must not appear (when absent before)


@dataclass
class Outcome:
    returncode: int | None  # None: killed after KILL_S
    elapsed: float
    stdout: str
    stderr: str
    invocation: Invocation
    before: dict[str, str] = field(default_factory=dict)  # relative path -> SHA-256 of the row's files
    after: dict[str, str] = field(default_factory=dict)


def python(*args: str, output: Path | None = None) -> Invocation:
    return Invocation([*args], output=output)


def train(
    row: Path,
    *overrides: str,
    checkpoint: str = "none",
    logger: str = "none",
    steps: int = 2,
    run_dir: Path | str | None = None,
    env: dict[str, str] | None = None,
) -> Invocation:
    """``train.py`` on one process for ``steps`` steps, every step logged, into ``row/run`` (or ``run_dir``)."""
    run_dir = Path(run_dir or row / "run")
    args = [str(REPO / "train.py"), "parallelism=single", f"checkpoint={checkpoint}", f"logger={logger}"]
    args += [f"trainer.max_steps={steps}", "trainer.log_every=1", "data.micro_batch_size=4", *overrides]
    return Invocation([*args, f"hydra.run.dir={run_dir}"], env or {}, run_dir=run_dir)


def check_model(*overrides: str) -> Invocation:
    return python("-m", "distrain.tools.check_model", *overrides, "--layouts", "single", "--steps", "1")


def export(checkpoint: Path | str, out: Path | str, *flags: str) -> Invocation:
    return python("-m", "distrain.checkpoint.export", str(checkpoint), str(out), *flags, output=Path(out))


def generate(checkpoint: Path | str, *flags: str) -> Invocation:
    return python("-m", "distrain.tools.generate", str(checkpoint), "--max-new-tokens", "2", *flags)


def prepare(corpus: Path, out: Path | str, *flags: str) -> Invocation:
    args = ["-m", "distrain.data.prepare", "--input", str(corpus), "--out", str(out), "--workers", "1"]
    return python(*args, "--val-fraction", "0.1", *flags, output=Path(out) / "train.json")


# Entry points the rows run, imported once by a warm interpreter whose forked children run them (tests/warm.py).
PREIMPORTED = ["torch", "transformers", "hydra", "distrain.launch.entry", "distrain.trainer.rank"]
PREIMPORTED += ["distrain.tools.check_model", "distrain.tools.generate", "distrain.checkpoint.export"]
PREIMPORTED += ["distrain.data.prepare"]
READ_WHEN_USED = {"MLFLOW_ALLOW_FILE_STORE"}  # variables the rows set that no module reads as it is imported
_warm: list[WarmPython] = []  # the module's server, while its tests run


@pytest.fixture(scope="module", autouse=True)
def warm_python():
    server = WarmPython(PREIMPORTED, {**os.environ, **ENV})
    _warm.append(server)
    yield server
    _warm.clear()
    server.close()


def execute(invocation: Invocation) -> Outcome:
    started = time.monotonic()
    env = {**os.environ, **ENV, **invocation.env}
    if _warm and set(invocation.env) <= READ_WHEN_USED:
        code, stdout, stderr = _warm[0].run(invocation.args, cwd=REPO, env=env, timeout=KILL_S)
        return Outcome(code, time.monotonic() - started, stdout, stderr, invocation)
    try:
        done = run_in_own_group([sys.executable, *invocation.args], timeout=KILL_S, cwd=REPO, env=env)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as err:
        code, stdout, stderr = None, err.stdout or "", err.stderr or ""
    return Outcome(code, time.monotonic() - started, stdout, stderr, invocation)


def expected_cost(invocation: Invocation) -> int:
    """A rough order of run times: check_model, then train.py, then the one-process tools, then prepare."""
    modules = ("distrain.tools.check_model", "train.py", "distrain.tools.generate", "distrain.checkpoint.export")
    return next((len(modules) - n for n, module in enumerate(modules) if any(module in a for a in invocation.args)), 0)


def hashes(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root``, by path relative to it."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.is_symlink()
    }


def write_big_tokenizer(path: Path, size: int = 1024) -> Path:
    """A word-level tokenizer of ``size`` ids ("w0" ... ), far more than the checkpoint's model has."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{number}": number for number in range(size - 1)} | {"[UNK]": size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def steps_taken(outcome: Outcome) -> list[str]:
    """Evidence of training: a step line on either stream, a check_model table row, a step record in metrics."""
    evidence = [line for line in (outcome.stdout + outcome.stderr).splitlines() if STEP_LINE.search(line)]
    evidence += CHECK_ROW.findall(outcome.stdout)
    run_dir = outcome.invocation.run_dir
    metrics = run_dir / "metrics.jsonl" if run_dir is not None and run_dir.is_dir() else None
    if metrics is not None and metrics.is_file():
        evidence += [line for line in metrics.read_text().splitlines() if '"step"' in line]
    return evidence


def last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Artifacts:
    """The good artifacts, each made the way a user makes it; the two training runs must succeed."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    root = tmp_path_factory.mktemp("artifacts")
    hf_llama = save_tiny_hf_llama(root / "hf_llama")
    torch.manual_seed(0)
    llama = LlamaForCausalLM.from_pretrained(hf_llama)
    llama.resize_token_embeddings(VOCAB, mean_resizing=False)  # its tokenizer's ids: the dataset's vocabulary
    llama.save_pretrained(hf_llama)
    llama.save_pretrained(root / "hf_sharded", max_shard_size="200KB")
    assert sorted(p.name for p in (root / "hf_sharded").glob("*.safetensors"))[1] == SHARD
    torch.manual_seed(0)
    gpt2 = GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(gpt2).save_pretrained(root / "hf_gpt2")
    corpus = root / "corpus"
    corpus.mkdir()
    words = "hello world distributed training tokens shard model data loss step".split()
    lines = [json.dumps({"text": " ".join(words[(n * 7 + k * 3) % len(words)] for k in range(30))}) for n in range(200)]
    (corpus / "docs.jsonl").write_text("\n".join(lines) + "\n")
    made = execute(prepare(corpus, root / "data", "--tokenizer", str(hf_llama)))
    assert made.returncode == 0, made.stderr
    hf_source = root / "hf_source"
    shutil.copytree(root / "hf_sharded", hf_source)
    every = ["checkpoint.every_n_steps=2", "checkpoint.save_final=false"]
    # Also the sanity runs of the sharded directory through model.init_from and model=hf.
    runs = [
        train(root, *LLAMA, *tokens(root / "data"), f"model.init_from={root / 'hf_sharded'}", *every,
              checkpoint="default", run_dir=root / "run"),
        train(root, *HF, *STDLIB, f"model.name_or_path={hf_source}", *every, checkpoint="default",
              run_dir=root / "hf_run"),
    ]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        for done in pool.map(execute, runs):
            assert done.returncode == 0 and steps_taken(done), done.stderr[-3000:]
    shutil.move(hf_source, root / "hf_source_moved")  # the user moved the directory the model=hf run came from
    step = "checkpoints/step_00000002"
    return Artifacts(
        root, hf_llama, root / "hf_sharded", root / "hf_gpt2", corpus, root / "data", root / "run" / step,
        root / "hf_run" / step, hf_source,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------- the damages


def copy_of(source: Path, row: Path, name: str) -> Path:
    target = row / name
    (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)
    return target


def edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=1))


def edit_weights(directory: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    from safetensors.torch import load_file, save_file

    file = directory / "model.safetensors"
    save_file(change(load_file(file)), file, metadata={"format": "pt"})


def truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def a_file(row: Path, name: str, text: str = "the user's own file\n") -> Path:
    path = row / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def hf(row: Path, art: Artifacts, name: str = "hf") -> Path:
    return copy_of(art.hf_llama, row, name)


def hf_other_architecture(row: Path, art: Artifacts) -> str:
    """Issue case 1: config.json of a GPT-2, weights of a Llama (was: trained from random weights, exit 0)."""
    from transformers import GPT2Config

    path = hf(row, art)
    GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128).save_pretrained(path)
    return str(path)


def hf_qwen2_config(row: Path, art: Artifacts) -> str:
    """config.json of a Qwen2 (q/k/v with biases) over Llama weights (no biases): the biases would be random."""
    from transformers import Qwen2Config

    path = hf(row, art)
    sizes = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4}
    Qwen2Config(vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=128, **sizes).save_pretrained(path)
    return str(path)


def hf_wrong_type(row: Path, art: Artifacts) -> str:
    """Issue case 3: a config.json field of the wrong type."""
    path = hf(row, art)
    edit_json(path / "config.json", hidden_size="big")
    return str(path)


def hf_missing_shard(row: Path, art: Artifacts) -> str:
    """Issue case 4: a sharded checkpoint with one shard missing."""
    path = copy_of(art.hf_sharded, row, "hf")
    (path / SHARD).unlink()
    return str(path)


def hf_index_names_absent_shard(row: Path, art: Artifacts) -> str:
    """The index maps a tensor to a shard file that is not there (the three real shards are)."""
    path = copy_of(art.hf_sharded, row, "hf")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = "model-00004-of-00003.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return str(path)


def hf_truncated(row: Path, art: Artifacts) -> str:
    """Issue case 5: a safetensors file cut in half (an interrupted copy)."""
    path = hf(row, art)
    truncate(path / "model.safetensors")
    return str(path)


def hf_empty_weights(row: Path, art: Artifacts) -> str:
    path = hf(row, art)
    truncate(path / "model.safetensors", keep=0)
    return str(path)


def hf_no_config(row: Path, art: Artifacts) -> str:
    path = hf(row, art)
    (path / "config.json").unlink()
    return str(path)


def hf_config_not_json(row: Path, art: Artifacts) -> str:
    path = hf(row, art)
    truncate(path / "config.json", keep=40)
    return str(path)


def hf_unknown_model_type(row: Path, art: Artifacts) -> str:
    path = hf(row, art)
    edit_json(path / "config.json", model_type="no_such_architecture")
    return str(path)


def hf_no_weights(row: Path, art: Artifacts) -> str:
    path = hf(row, art)
    (path / "model.safetensors").unlink()
    return str(path)


def hf_extra_tensor(row: Path, art: Artifacts) -> str:
    path = hf(row, art)
    edit_weights(path, lambda state: {**state, "model.layers.0.mlp.extra_proj.weight": torch.zeros(8, 64)})
    return str(path)


def hf_missing_tensor(row: Path, art: Artifacts) -> str:
    path = hf(row, art)
    edit_weights(path, lambda state: {k: v for k, v in state.items() if k != "model.layers.1.mlp.down_proj.weight"})
    return str(path)


def hf_wrong_shape(row: Path, art: Artifacts) -> str:
    path = hf(row, art)
    edit_weights(path, lambda state: {**state, "model.layers.0.mlp.up_proj.weight": torch.zeros(100, 64)})
    return str(path)


def hf_wrong_names(row: Path, art: Artifacts) -> str:
    """Every tensor under a prefix neither transformers nor the Llama family knows (weights of another export)."""
    path = hf(row, art)
    edit_weights(path, lambda state: {f"transformer.{name}": tensor for name, tensor in state.items()})
    return str(path)


def hf_path_is_file(row: Path, art: Artifacts) -> str:
    return str(copy_of(art.hf_llama / "model.safetensors", row, "model.safetensors"))


def hf_context_too_long(row: Path, art: Artifacts) -> str:
    """Issue case 6: data.seq_len 32 for a GPT-2 whose absolute position table holds 16."""
    return str(copy_of(art.hf_gpt2, row, "gpt2"))


def data(row: Path, art: Artifacts) -> Path:
    return copy_of(art.data, row, "data")


def data_understated_ids(row: Path, art: Artifacts) -> str:
    """Issue case 7: indexes whose vocabulary and largest id are below the ids the shards hold (was: an
    IndexError inside a step)."""
    path = data(row, art)
    for split in ("train", "val"):
        edit_json(path / f"{split}.json", vocab_size=64, max_token_id=63)
    return str(path)


def data_raw_records(row: Path, art: Artifacts) -> str:
    """Issue case 8: train.json and val.json holding the raw text records, not a prepared dataset."""
    path = row / "records"
    path.mkdir()
    for split in ("train", "val"):
        (path / f"{split}.json").write_text(json.dumps([{"text": "hello world"}, {"text": "distributed"}]))
    return str(path)


def data_shard_missing(row: Path, art: Artifacts) -> str:
    path = data(row, art)
    (path / "train-00000.bin").unlink()
    return str(path)


def data_shard_truncated(row: Path, art: Artifacts) -> str:
    path = data(row, art)
    truncate(path / "train-00000.bin", keep=1000)
    return str(path)


def data_shard_odd_bytes(row: Path, art: Artifacts) -> str:
    path = data(row, art)
    with open(path / "val-00000.bin", "ab") as file:
        file.write(b"\0")
    return str(path)


def data_shard_changed(row: Path, art: Artifacts) -> str:
    path = data(row, art)
    shard = bytearray((path / "train-00000.bin").read_bytes())
    shard[100] ^= 1
    (path / "train-00000.bin").write_bytes(bytes(shard))
    return str(path)


def data_index_not_json(row: Path, art: Artifacts) -> str:
    path = data(row, art)
    truncate(path / "train.json", keep=60)
    return str(path)


def data_index_wrong_format(row: Path, art: Artifacts) -> str:
    path = data(row, art)
    edit_json(path / "train.json", format="nanogpt.tokens")
    return str(path)


def data_dtype_unknown(row: Path, art: Artifacts) -> str:
    path = data(row, art)
    edit_json(path / "train.json", dtype="float16")
    return str(path)


def data_empty_split(row: Path, art: Artifacts) -> str:
    path = data(row, art)
    edit_json(path / "val.json", documents=0, tokens=0, max_token_id=0, shards=[])
    return str(path)


def data_nanogpt_odd_bytes(row: Path, art: Artifacts) -> str:
    path = row / "nanogpt"
    path.mkdir()
    (path / "train.bin").write_bytes(bytes(range(256)) * 8 + b"\1")  # 2049 bytes: half an id at the end
    (path / "val.bin").write_bytes(bytes(range(256)) * 2)
    return str(path)


def data_path_is_file(row: Path, art: Artifacts) -> str:
    return str(copy_of(art.data / "train-00000.bin", row, "tokens.bin"))


def data_tokenizer_damaged(row: Path, art: Artifacts) -> str:
    path = data(row, art)
    truncate(path / "tokenizer.json", keep=100)
    return str(path)


def tokenizer_missing(row: Path, art: Artifacts) -> str:
    return str(row / "no_such_tokenizer.json")


def tokenizer_not_json(row: Path, art: Artifacts) -> str:
    path = copy_of(art.hf_llama / "tokenizer.json", row, "tokenizer.json")
    truncate(path, keep=100)
    return str(path)


def tokenizer_not_a_tokenizer(row: Path, art: Artifacts) -> str:
    return str(a_file(row, "tokenizer.json", json.dumps({"vocab": ["a", "b"], "note": "not a tokenizers file"})))


def tokenizer_larger_than_model(row: Path, art: Artifacts) -> str:
    """Issue case 9: a tokenizer of 1024 ids for a model of 257."""
    return str(write_big_tokenizer(row / "tokenizer.json"))


def checkpoint(row: Path, art: Artifacts) -> Path:
    (row / "checkpoints").mkdir()
    return copy_of(art.checkpoint, row / "checkpoints", art.checkpoint.name)


def ckpt_not_a_checkpoint(row: Path, art: Artifacts) -> str:
    path = row / "my_results"
    a_file(path, "notes.txt")
    (path / "weights.pt").write_bytes(bytes(range(64)))
    return str(path)


def ckpt_truncated_shard(row: Path, art: Artifacts) -> str:
    path = checkpoint(row, art)
    truncate(path / "__0_0.distcp")
    return str(path)


def ckpt_manifest_not_json(row: Path, art: Artifacts) -> str:
    path = checkpoint(row, art)
    truncate(path / "manifest.json", keep=30)
    return str(path)


def ckpt_config_damaged(row: Path, art: Artifacts) -> str:
    path = checkpoint(row, art)
    (path / "config.yaml").write_text("model: [unclosed\n  d_model: 64\n")
    return str(path)


def ckpt_empty_dir(row: Path, art: Artifacts) -> str:
    path = row / "empty_run"
    path.mkdir()
    return str(path)


def ckpt_hf_source_moved(row: Path, art: Artifacts) -> str:
    """Issue case 10: a model=hf checkpoint whose source Hugging Face directory was moved before generate."""
    (row / "checkpoints").mkdir()
    return str(copy_of(art.hf_checkpoint, row / "checkpoints", art.hf_checkpoint.name))


def out_exists(row: Path, art: Artifacts) -> str:
    return str(a_file(row, "model.pt"))


def out_foreign_dir(row: Path, art: Artifacts) -> str:
    path = row / "my_model"
    a_file(path, "config.json", json.dumps({"note": "the user's own config"}))
    a_file(path, "notes.txt")
    return str(path)


def out_below_file(row: Path, art: Artifacts) -> str:
    """Issue case 11: an output path below an existing file."""
    return str(a_file(row, "a_file") / "sub" / "model.pt")


def file_named(name: str) -> Callable[[Path, Artifacts], str]:
    return lambda row, art: str(a_file(row, name))


def directory_named(name: str) -> Callable[[Path, Artifacts], str]:
    def make(row: Path, art: Artifacts) -> str:
        a_file(row / name, "keep.txt")
        return str(row / name)

    return make


def prepare_out_user_json(row: Path, art: Artifacts) -> str:
    """Issue case 2: --out names the user's own directory whose train.json/val.json are not a dataset."""
    path = row / "my_data"
    for split in ("train", "val"):
        a_file(path, f"{split}.json", json.dumps([{"id": 1, "label": "the user's own records"}]))
    return str(path)


def prepare_out_user_shard(row: Path, art: Artifacts) -> str:
    """--out holds a file of the user's that prepare would take for an old shard of its own and delete."""
    path = row / "my_data"
    a_file(path, "train-00000.bin", "the user's own binary file\n")
    a_file(path, "notes.txt")
    return str(path)


def prepare_out_users_shard_beside_a_dataset(row: Path, art: Artifacts) -> str:
    """--out holds an earlier prepare's dataset and, beside it, a shard-named file no index or record names."""
    path = copy_of(art.data, row, "my_data")
    a_file(path, "train-00099.bin", "the user's own binary file\n")
    return str(path)


def run_dir_users_summary(row: Path, art: Artifacts) -> str:
    """hydra.run.dir names the user's own directory holding a summary.json of theirs (a run would replace it)."""
    path = row / "my_results"
    a_file(path, "summary.json", json.dumps({"accuracy": 0.93}))
    return str(path)


def run_dir_foreign_metrics(row: Path, art: Artifacts) -> str:
    """hydra.run.dir holds a metrics.jsonl of other records (a resume would rewind it; was: KeyError 'step')."""
    path = row / "my_results"
    a_file(path, "metrics.jsonl", json.dumps({"epoch": 1, "acc": 0.5}) + "\n")
    return str(path)


def checkpoint_dir_users_step(row: Path, art: Artifacts) -> str:
    """checkpoint.dir holds a step_00000002 of the user's (no manifest): a save of step 2 would replace it."""
    path = row / "ckpts"
    a_file(path / "step_00000002", "notes.txt")
    return str(path)


def mlflow_sqlite_directory(row: Path, art: Artifacts) -> str:
    """Issue case 12: a sqlite:/// store whose path is a directory (was: retried for 111 s)."""
    return f"sqlite:///{directory_named('mlflow_store')(row, art)}"


def mlflow_file_store_is_file(row: Path, art: Artifacts) -> str:
    return f"file://{file_named('mlruns')(row, art)}"


# ------------------------------------------------------------------------------------------ the entry points


def resumed(art: Artifacts) -> list[str]:
    """The config of the run that wrote ``art.checkpoint`` (a resume must name the directory it started from)."""
    return [*LLAMA, *tokens(art.data), f"model.init_from={art.hf_sharded}"]


# Entry point -> (the config key or option its line may name, the invocation on the damaged target).
Entry = Callable[[Path, str, Artifacts], Invocation]
ENTRIES: dict[str, tuple[str | None, Entry]] = {
    "train_hf": ("model.name_or_path", lambda row, path, art: train(row, *HF, *STDLIB, f"model.name_or_path={path}")),
    "check_hf": ("model.name_or_path", lambda row, path, art: check_model(*HF, *STDLIB, f"model.name_or_path={path}")),
    "train_init": (
        "model.init_from",
        lambda row, path, art: train(row, *LLAMA, *tokens(art.data), f"model.init_from={path}"),
    ),
    "train_data": ("data.path", lambda row, path, art: train(row, *LLAMA, *tokens(path))),
    "check_data": ("data.path", lambda row, path, art: check_model(*LLAMA, *tokens(path))),
    "resume": (
        "checkpoint.resume",
        lambda row, path, art: train(row, *resumed(art), f"checkpoint.resume={path}"),
    ),
    "export": (None, lambda row, path, art: export(path, row / "exported.pt")),
    "export_hf": (None, lambda row, path, art: export(path, row / "exported", "--format", "hf")),
    "generate": (None, lambda row, path, art: generate(path)),
    "generate_tokenizer": (
        "--tokenizer",
        lambda row, path, art: generate(art.checkpoint, "--tokenizer", path, "--prompt", PROMPT),
    ),
    "prepare_tokenizer": ("--tokenizer", lambda row, path, art: prepare(art.corpus, row / "out", "--tokenizer", path)),
    "prepare_out": ("--out", lambda row, path, art: prepare(art.corpus, path)),
    "export_out": (None, lambda row, path, art: export(art.checkpoint, path)),
    "export_hf_out": (None, lambda row, path, art: export(art.checkpoint, path, "--format", "hf", "--overwrite")),
    "train_checkpoint_dir": (
        "checkpoint.dir",
        lambda row, path, art: train(row, *GPT, f"checkpoint.dir={path}", checkpoint="default"),
    ),
    "train_checkpoint_dir_auto": (
        "checkpoint.dir",
        lambda row, path, art: train(
            row, *GPT, f"checkpoint.dir={path}", "checkpoint.resume=auto", "trainer.max_steps=2", checkpoint="default"
        ),
    ),
    "train_run_dir": ("hydra.run.dir", lambda row, path, art: train(row, *GPT, run_dir=path)),
    "train_mlflow": (
        "logger.mlflow.tracking_uri",
        lambda row, uri, art: train(row, *GPT, f"logger.mlflow.tracking_uri={uri}", logger="mlflow"),
    ),
    "train_mlflow_file_store": (
        "logger.mlflow.tracking_uri",
        lambda row, uri, art: train(
            row, *GPT, f"logger.mlflow.tracking_uri={uri}", logger="mlflow", env={"MLFLOW_ALLOW_FILE_STORE": "true"}
        ),
    ),
    "train_tensorboard": (
        "logger.tensorboard.dir",
        lambda row, path, art: train(row, *GPT, f"logger.tensorboard.dir={path}", logger="tensorboard"),
    ),
    "train_jsonl": (
        "logger.jsonl.path",
        lambda row, path, art: train(row, *GPT, f"logger.jsonl.path={path}", logger="jsonl"),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Damage:
    kind: str
    name: str
    make: Callable[[Path, Artifacts], str]  # makes the damaged artifact inside the row's directory: its path or URI
    names: tuple[str, ...]  # the file names (or words) that may stand for it in the line instead of the key
    entries: tuple[str, ...] = ()  # the entry points it runs through, one row each; () is every reader of its kind


# Every entry point that reads each kind of artifact: a damage runs through all of them unless it names fewer,
# and then NOT_EVERY_READER says why.
READERS = {
    "hf_dir": ("train_hf", "check_hf", "train_init"),
    "dataset": ("train_data", "check_data"),
    "tokenizer": ("generate_tokenizer", "prepare_tokenizer"),
    "checkpoint": ("resume", "export", "export_hf", "generate"),
}
NOT_EVERY_READER = {
    "hf_dir-context_beyond_position_table": "model.init_from fills our Llama, whose positions are rotary: no table",
    "tokenizer-larger_than_the_model": "prepare takes its vocabulary from the tokenizer: no model to exceed",
    "checkpoint-hf_source_moved": "a resume needs the model=hf run's own config, whose source is the damage itself",
}
HF_WEIGHTS = ("model.safetensors",)

DAMAGES = [
    Damage("hf_dir", "config_of_another_architecture", hf_other_architecture, ("config.json",)),
    Damage("hf_dir", "qwen2_config_over_llama_weights", hf_qwen2_config, ("config.json", "bias")),
    Damage("hf_dir", "config_field_of_wrong_type", hf_wrong_type, ("config.json", "hidden_size")),
    Damage("hf_dir", "shard_missing", hf_missing_shard, (SHARD, "model.safetensors.index.json")),
    Damage("hf_dir", "index_names_absent_shard", hf_index_names_absent_shard,
           ("model-00004-of-00003.safetensors", "model.safetensors.index.json")),
    Damage("hf_dir", "safetensors_truncated", hf_truncated, HF_WEIGHTS),
    Damage("hf_dir", "safetensors_zero_bytes", hf_empty_weights, HF_WEIGHTS),
    Damage("hf_dir", "config_missing", hf_no_config, ("config.json",)),
    Damage("hf_dir", "config_not_json", hf_config_not_json, ("config.json",)),
    Damage("hf_dir", "model_type_unknown", hf_unknown_model_type, ("config.json", "no_such_architecture")),
    Damage("hf_dir", "weights_missing", hf_no_weights, ("safetensors",)),
    Damage("hf_dir", "weights_extra_tensor", hf_extra_tensor, ("extra_proj",)),
    Damage("hf_dir", "weights_tensor_missing", hf_missing_tensor, ("model.layers.1.mlp.down_proj",)),
    Damage("hf_dir", "weights_wrong_shape", hf_wrong_shape, ("model.layers.0.mlp.up_proj",)),
    Damage("hf_dir", "weights_wrong_names", hf_wrong_names, ("transformer.",)),
    Damage("hf_dir", "path_is_a_file", hf_path_is_file, HF_WEIGHTS),
    Damage("hf_dir", "context_beyond_position_table", hf_context_too_long,
           ("n_positions", "data.seq_len", "model.max_seq_len"), ("train_hf", "check_hf")),
    Damage("dataset", "index_understates_token_ids", data_understated_ids, ("train.json", "val.json")),
    Damage("dataset", "raw_json_records", data_raw_records, ("train.json",)),
    Damage("dataset", "shard_missing", data_shard_missing, ("train-00000.bin",)),
    Damage("dataset", "shard_truncated", data_shard_truncated, ("train-00000.bin",)),
    Damage("dataset", "shard_partial_id", data_shard_odd_bytes, ("val-00000.bin",)),
    Damage("dataset", "shard_changed", data_shard_changed, ("train-00000.bin",)),
    Damage("dataset", "index_not_json", data_index_not_json, ("train.json",)),
    Damage("dataset", "index_wrong_format", data_index_wrong_format, ("train.json",)),
    Damage("dataset", "index_dtype_unknown", data_dtype_unknown, ("train.json",)),
    Damage("dataset", "split_empty", data_empty_split, ("val.json",)),
    Damage("dataset", "nanogpt_bin_partial_id", data_nanogpt_odd_bytes, ("train.bin",)),
    Damage("dataset", "path_is_a_file", data_path_is_file, ("tokens.bin",)),
    Damage("dataset", "tokenizer_damaged", data_tokenizer_damaged, ("tokenizer.json",)),
    Damage("tokenizer", "missing", tokenizer_missing, ("no_such_tokenizer.json",)),
    Damage("tokenizer", "not_json", tokenizer_not_json, ("tokenizer.json",)),
    Damage("tokenizer", "json_but_not_a_tokenizer", tokenizer_not_a_tokenizer, ("tokenizer.json",)),
    Damage("tokenizer", "larger_than_the_model", tokenizer_larger_than_model, ("tokenizer.json",),
           ("generate_tokenizer",)),
    Damage("checkpoint", "not_a_checkpoint", ckpt_not_a_checkpoint, ("my_results",)),
    Damage("checkpoint", "shard_truncated", ckpt_truncated_shard, ("__0_0.distcp",)),
    Damage("checkpoint", "manifest_not_json", ckpt_manifest_not_json, ("manifest.json", "manifest")),
    Damage("checkpoint", "config_yaml_damaged", ckpt_config_damaged, ("config.yaml",)),
    Damage("checkpoint", "empty_directory", ckpt_empty_dir, ("empty_run",)),
    Damage("checkpoint", "hf_source_moved", ckpt_hf_source_moved, ("model.name_or_path", "hf_source"),
           ("generate", "export", "export_hf")),
    Damage("output", "export_target_exists", out_exists, ("model.pt",), ("export_out",)),
    Damage("output", "export_hf_into_foreign_directory", out_foreign_dir, ("my_model",), ("export_hf_out",)),
    Damage("output", "export_target_below_a_file", out_below_file, ("a_file",), ("export_out", "export_hf_out")),
    Damage("output", "prepare_out_holds_users_json", prepare_out_user_json, ("my_data", "train.json"),
           ("prepare_out",)),
    Damage("output", "prepare_out_holds_users_shard_name", prepare_out_user_shard, ("my_data", "train-00000.bin"),
           ("prepare_out",)),
    Damage("output", "prepare_out_is_a_file", file_named("dataset_file"), ("dataset_file",), ("prepare_out",)),
    Damage("output", "checkpoint_dir_is_a_file", file_named("ckpts"), ("ckpts",), ("train_checkpoint_dir",)),
    Damage("output", "checkpoint_dir_holds_users_step", checkpoint_dir_users_step, ("step_00000002",),
           ("train_checkpoint_dir_auto",)),
    Damage("output", "run_dir_holds_users_summary", run_dir_users_summary, ("summary.json",), ("train_run_dir",)),
    Damage("output", "run_dir_holds_foreign_metrics", run_dir_foreign_metrics, ("metrics.jsonl",),
           ("train_run_dir",)),
    Damage("output", "prepare_out_holds_users_shard_beside_a_dataset", prepare_out_users_shard_beside_a_dataset,
           ("train-00099.bin",), ("prepare_out",)),
    Damage("output", "run_dir_is_a_file", file_named("run_file"), ("run_file",), ("train_run_dir",)),
    Damage("tracker", "mlflow_sqlite_path_is_a_directory", mlflow_sqlite_directory, ("mlflow_store",),
           ("train_mlflow",)),
    Damage("tracker", "mlflow_file_store_is_a_file", mlflow_file_store_is_file, ("mlruns",),
           ("train_mlflow_file_store",)),
    Damage("tracker", "tensorboard_dir_is_a_file", file_named("tb"), ("tb",), ("train_tensorboard",)),
    Damage("tracker", "jsonl_path_is_a_directory", directory_named("runs.jsonl"), ("runs.jsonl",), ("train_jsonl",)),
]  # fmt: skip


@dataclass(frozen=True)
class Row:
    id: str
    damage: Damage
    entry: str

    @property
    def expected(self) -> tuple[str, ...]:
        key = ENTRIES[self.entry][0]
        return (*([key] if key else []), *self.damage.names)


ROWS = [Row(f"{d.kind}-{d.name}-{entry}", d, entry) for d in DAMAGES for entry in d.entries or READERS[d.kind]]


def good_invocations(art: Artifacts, root: Path) -> dict[str, Invocation]:
    """Each entry point once on the undamaged artifacts (all must exit 0; train.py and check_model must train)."""
    trackers = [f"logger.tensorboard.dir={root / 'tb'}", f"logger.jsonl.path={root / 'runs.jsonl'}"]
    trackers += [f"logger.mlflow.tracking_uri=sqlite:///{root / 'mlflow.db'}", f"checkpoint.dir={root / 'ckpts'}"]
    return {
        "train_hf_gpt2_16_positions": train(root / "gpt2", "model=hf", "model.max_seq_len=16", *STDLIB,
                                            f"model.name_or_path={art.hf_gpt2}"),
        "train_trackers_and_checkpoint_dir": train(root / "trackers", *GPT, *trackers, checkpoint="default",
                                                   logger="[tensorboard,mlflow,jsonl]"),
        "check_hf": check_model(*HF, *STDLIB, f"model.name_or_path={art.hf_llama}"),
        "resume": train(root / "resume", *resumed(art), f"checkpoint.resume={art.checkpoint}", steps=3),
        "export": export(art.checkpoint, root / "exported.pt"),
        "export_hf": export(art.checkpoint, root / "exported", "--format", "hf"),
        "generate": generate(art.checkpoint),
        "generate_tokenizer": generate(art.checkpoint, "--tokenizer", str(art.hf_llama / "tokenizer.json"),
                                       "--prompt", PROMPT),
        "prepare_tokenizer_file": prepare(art.corpus, root / "prepared", "--tokenizer",
                                          str(art.hf_llama / "tokenizer.json"), "--eos-token", "<eos>"),
    }  # fmt: skip


@pytest.fixture(scope="module")
def outcomes(artifacts, tmp_path_factory) -> dict[str, Outcome]:
    """Every row's damage made in a directory of its own, then every row and the good runs at once on WORKERS
    processes; each row's files hashed before and after."""
    rows_root = tmp_path_factory.mktemp("rows")
    jobs: dict[str, tuple[Invocation, Path | None]] = {}
    for number, row in enumerate(ROWS):
        directory = rows_root / f"r{number:03d}"  # a name no expected word can match
        directory.mkdir()
        target = row.damage.make(directory, artifacts)
        jobs[row.id] = (ENTRIES[row.entry][1](directory, target, artifacts), directory)
    good_root = tmp_path_factory.mktemp("good")
    for name, invocation in good_invocations(artifacts, good_root).items():
        jobs[f"good:{name}"] = (invocation, None)
    base_before = hashes(artifacts.root)
    before = {key: hashes(directory) for key, (_, directory) in jobs.items() if directory is not None}
    absent = {key: inv.output for key, (inv, _) in jobs.items() if inv.output is not None and not inv.output.exists()}

    def run(key: str) -> tuple[str, Outcome]:
        invocation, directory = jobs[key]
        outcome = execute(invocation)
        if directory is not None:
            outcome.before, outcome.after = before[key], hashes(directory)
        if key in absent and absent[key].exists():
            outcome.after["<output written>"] = str(absent[key])
        return key, outcome

    with ThreadPoolExecutor(WORKERS) as pool:  # the longest first, so that no long job starts last
        results = dict(pool.map(run, sorted(jobs, key=lambda key: -expected_cost(jobs[key][0]))))
    results["<shared artifacts>"] = Outcome(0, 0.0, "", "", Invocation([]), base_before, hashes(artifacts.root))
    return results


def test_the_table_runs_every_damage_through_every_reader_of_its_kind():
    """Each damage of a kind that several entry points read runs through all of them, or says why not."""
    assert len(ROWS) >= 40 and len({row.id for row in ROWS}) == len(ROWS)
    for damage in DAMAGES:
        if damage.kind not in READERS:
            continue
        name = f"{damage.kind}-{damage.name}"
        entries = set(damage.entries or READERS[damage.kind])
        assert entries <= set(READERS[damage.kind]), name
        assert (entries == set(READERS[damage.kind])) == (name not in NOT_EVERY_READER), name


def test_the_undamaged_artifacts_work(outcomes):
    """Each entry point exits 0 on the good artifacts, and the step detector sees the good runs' steps."""
    failed = {}
    for key, outcome in outcomes.items():
        if not key.startswith("good:"):
            continue
        trains = outcome.invocation.run_dir is not None or "distrain.tools.check_model" in outcome.invocation.args
        if outcome.returncode != 0 or (trains and not steps_taken(outcome)):
            failed[key] = f"exit {outcome.returncode}: {outcome.stderr[-1500:]}"
    if failed:
        pytest.fail(json.dumps(failed, indent=1), pytrace=False)


def test_the_shared_artifacts_are_unchanged(outcomes):
    shared = outcomes["<shared artifacts>"]
    assert {k: v for k, v in shared.after.items() if shared.before.get(k) != v} == {}
    assert shared.before.keys() <= shared.after.keys()


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_a_damaged_artifact_is_refused_in_one_line(row, outcomes):
    done = outcomes[row.id]
    line = last_line(done.stderr)
    problems = []
    if done.returncode is None:
        problems.append(f"hang: still running after {KILL_S} s, killed")
    elif done.returncode == 0:
        problems.append("exit 0")
    if done.elapsed >= LIMIT_S:
        problems.append(f"took {done.elapsed:.0f} s")
    if "Traceback" in done.stderr:
        problems.append("traceback")
    if not line.startswith("distrain") or not any(word in line for word in row.expected):
        problems.append(f"last line does not name any of {list(row.expected)}: {line[:300]!r}")
    if steps := steps_taken(done):
        problems.append(f"took {len(steps)} training step record(s)")
    changed = sorted(path for path, digest in done.before.items() if done.after.get(path) != digest)
    if changed:
        problems.append(f"changed or removed pre-existing files: {changed}")
    if "<output written>" in done.after:
        problems.append(f"wrote {done.after['<output written>']}")
    if problems:  # the reasons, the command and what it said; not this function's source
        command = " ".join(done.invocation.args)
        pytest.fail(f"{'; '.join(problems)}\ncommand: {command}\nstderr tail:\n{done.stderr[-2500:]}", pytrace=False)
