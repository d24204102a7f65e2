"""python -m distrain.data.prepare on tiny corpora built here (text, JSONL and Parquet in one run): valid indexes,
every document once with its EOS, an exact tokenizer round trip, whole-document splits, output independent of the
number of workers, a no-op re-run (that finds a changed shard and repairs it), given tokenizers used as given, an
output directory that is also the input never read back, one-line refusals, interruptions that never leave an
index naming a missing or partial shard, and Ctrl-C or a dead worker ending the run at once (subprocesses)."""

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import REPO
from tokenizers import Tokenizer

import distrain.data.documents as documents_module
import distrain.data.prepare as prepare_module
import distrain.data.prepare_output as prepare_output
from distrain.data.prepare import main, prepare
from distrain.data.prepare_output import ShardWriter
from distrain.data.token_format import SPLITS, DataError, dtype_for, read_index, verify_split
from distrain.data.tokenizer_files import _WorkerProcess, train_bpe, worker_pool

PLAIN = {
    "a.txt": "Hello, world.\nnaïve café — ünïcode 😀 and\ttabs\n\n  leading spaces",
    "sub/c.md": "# A heading\n\nSome *markdown* text, with code: `x = 1`\n",
    "sub/deeper/d.py": "def f(x):\n    return x + 1  # the end\n",
}
JSONL = [
    {"text": "first JSON document", "id": 1},
    {"text": "a document that writes <|endoftext|> inside itself", "id": 2},
    {"text": "", "id": 3},  # empty: skipped
    {"text": "ütf-8 in JSON \u00e9\u4e2d\u6587", "id": 4},
    {"text": "line one\nline two\r\nline three", "id": 5},
]
PARQUET = ["parquet row one", None, "parquet row three, longer than the others by a few words", "row four"]
# In input order: the directory's files sorted (a.txt, b.jsonl, blob.bin skipped, empty.txt skipped, sub/...),
# then the Parquet file named second on the command line.
DOCUMENTS = [
    PLAIN["a.txt"],
    *(record["text"] for record in JSONL if record["text"]),
    PLAIN["sub/c.md"],
    PLAIN["sub/deeper/d.py"],
    *(text for text in PARQUET if text),
]
SETTINGS = {"vocab_size": 320, "val_fraction": 0.3, "seed": 5, "min_frequency": 1}


def write_corpus(root: Path) -> list[Path]:
    corpus = root / "corpus"
    for name, text in PLAIN.items():
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_text(text, encoding="utf-8")
    lines = [json.dumps(record, ensure_ascii=record["id"] != 4) for record in JSONL]
    (corpus / "b.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    (corpus / "blob.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00binary")
    (corpus / "empty.txt").write_text("")
    (corpus / ".hidden.txt").write_text("left out: hidden")
    parquet = root / "rows.parquet"
    pq.write_table(pa.table({"text": PARQUET, "n": list(range(len(PARQUET)))}), parquet)
    return [corpus, parquet]


def documents_of(directory: Path, split: str) -> list[list[int]]:
    """The split's documents as id lists (each ended by its EOS, which is left off), shards concatenated."""
    index = read_index(directory, split)
    ids = np.concatenate([np.fromfile(directory / shard.file, dtype=index.numpy_dtype) for shard in index.shards])
    assert ids[-1] == index.eos_id, "the split does not end with an EOS"
    ends = np.flatnonzero(ids == index.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ids[start:end].tolist() for start, end in zip(starts, ends, strict=True)]


def shard_bytes(directory: Path) -> dict[str, bytes]:
    names = ["train.json", "val.json", "tokenizer.json"] + sorted(p.name for p in directory.glob("*.bin"))
    return {name: (directory / name).read_bytes() for name in names}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("prepare"))


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "data"
    summary = prepare(corpus, out, workers=2, quiet=True, **SETTINGS)
    return out, summary


def test_mixed_inputs_every_document_once_with_eos_split_whole_and_round_tripped(prepared):
    out, summary = prepared
    indexes = {split: read_index(out, split) for split in SPLITS}
    for index in indexes.values():
        verify_split(out, index)
        assert index.tokenizer == "tokenizer.json" and index.dtype == "uint16"
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert indexes["train"].vocab_size == tokenizer.get_vocab_size() <= SETTINGS["vocab_size"]
    assert indexes["train"].eos_id == tokenizer.token_to_id("<|endoftext|>")
    decoded = {split: [tokenizer.decode(ids) for ids in documents_of(out, split)] for split in SPLITS}
    for split, index in indexes.items():
        assert index.documents == len(decoded[split]) >= 1
        assert index.max_token_id == max(max(ids) for ids in documents_of(out, split) + [[index.eos_id]])
    # Every document exactly once, in one split, in input order within each split.
    assert sorted(decoded["train"] + decoded["val"]) == sorted(DOCUMENTS)
    for split in SPLITS:
        assert decoded[split] == [doc for doc in DOCUMENTS if doc in decoded[split]]
    # decode(encode(doc)) == doc. A document that writes the EOS token encodes it as text, as prepare does (with
    # encode_special_tokens), not as the EOS id, which marks document ends only.
    for doc in DOCUMENTS:
        if "<|endoftext|>" not in doc:
            assert tokenizer.decode(tokenizer.encode(doc).ids) == doc
    tokenizer.encode_special_tokens = True
    for doc in DOCUMENTS:
        assert tokenizer.decode(tokenizer.encode(doc).ids) == doc
    assert summary["documents"] == len(DOCUMENTS) and summary["skipped_binary_files"] == 1
    assert summary["empty_documents"] == 3  # the empty file, the empty JSON text, the null Parquet row
    assert summary["tokens"] == sum(index.tokens for index in indexes.values())
    assert not (out / ".prepare-tmp").exists()
    assert json.loads((out / "prepare.json").read_text())["summary"]["tokens"] == summary["tokens"]


def test_workers_do_not_change_a_byte_and_small_shards_add_up(corpus, prepared, tmp_path, monkeypatch):
    out, _ = prepared
    # Tiny batches, so that several are in flight at once and the order of their collection matters.
    monkeypatch.setattr(documents_module, "BATCH_CHARACTERS", 40)
    prepare(corpus, tmp_path / "one", workers=1, quiet=True, **SETTINGS)
    assert shard_bytes(tmp_path / "one") == shard_bytes(out)
    summary = prepare(corpus, tmp_path / "small", workers=2, shard_tokens=16, quiet=True, **SETTINGS)
    for split in SPLITS:
        index = read_index(tmp_path / "small", split)
        verify_split(tmp_path / "small", index)
        assert all(shard.tokens == 16 for shard in index.shards[:-1]) and 1 <= index.shards[-1].tokens <= 16
        assert sum(shard.tokens for shard in index.shards) == index.tokens == read_index(out, split).tokens
        assert documents_of(tmp_path / "small", split) == documents_of(out, split)
    assert summary["shards"] > 4


def test_rerun_does_nothing_and_says_so(corpus, prepared, capsys):
    out, _ = prepared
    before = {path: path.stat().st_mtime_ns for path in out.iterdir()}
    args = ["--input", *map(str, corpus), "--out", str(out), "--workers", "1", "--vocab-size", "320"]
    args += ["--val-fraction", "0.3", "--seed", "5", "--min-frequency", "1"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1 and "up to date" in captured.out and "nothing to do" in captured.out
    assert {path: path.stat().st_mtime_ns for path in out.iterdir()} == before


def four_documents(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A corpus of four small text files, the output directory, and the command line that prepares one into the
    other (vocabulary 300, a quarter for validation)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number in range(4):
        (corpus / f"{number}.txt").write_text(f"document number {number} " * 5)
    out = tmp_path / "out"
    return corpus, out, ["--input", str(corpus), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.25"]


def test_changed_input_or_settings_re_prepare_and_stale_shards_go(tmp_path, capsys):
    corpus, out, common = four_documents(tmp_path)
    assert main([*common, "--shard-tokens", "20", "--workers", "1"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("distrain prepare: ") and "documents" in line and "tokens/s" in line and "skipped" in line
    many = {path.name for path in out.glob("*.bin")}
    assert len(many) > 3
    (corpus / "2.txt").write_text("a changed document, longer than before " * 4)
    assert main([*common, "--workers", "1"]) == 0
    assert "up to date" not in capsys.readouterr().out
    assert {path.name for path in out.glob("*.bin")} == {"train-00000.bin", "val-00000.bin"}
    texts = [Tokenizer.from_file(str(out / "tokenizer.json")).decode(ids) for ids in documents_of(out, "train")]
    texts += [Tokenizer.from_file(str(out / "tokenizer.json")).decode(ids) for ids in documents_of(out, "val")]
    assert "a changed document, longer than before " * 4 in texts
    assert main([*common, "--workers", "1"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_a_shard_named_file_no_run_wrote_is_never_removed_or_replaced(tmp_path, capsys):
    """Beside an earlier run's dataset, a ``train-00099.bin`` of the user's (named by no index or record) is refused
    in one line; with ``--overwrite`` the re-run replaces only what it wrote and leaves that file byte-identical."""
    corpus, out, common = four_documents(tmp_path)
    assert main([*common, "--shard-tokens", "20", "--workers", "1"]) == 0
    capsys.readouterr()
    theirs = out / "train-00099.bin"
    theirs.write_bytes(b"the user's own bytes")
    (corpus / "2.txt").write_text("a changed document " * 4)
    assert main([*common, "--workers", "1"]) == 2
    line = capsys.readouterr().err.strip()
    assert "train-00099.bin" in line and "--overwrite" in line and len(line.splitlines()) == 1
    assert main([*common, "--workers", "1", "--overwrite"]) == 0
    assert theirs.read_bytes() == b"the user's own bytes"
    assert {path.name for path in out.glob("*.bin")} == {"train-00000.bin", "val-00000.bin", "train-00099.bin"}
    assert json.loads((out / "prepare.json").read_text())["shards"] == ["train-00000.bin", "val-00000.bin"]


def test_each_shard_carries_its_sha256_and_crc32(prepared):
    """Both digests in the index are the shard file's: CRC-32 is what start-up checks, SHA-256 what names it."""
    import hashlib
    import zlib

    out, _ = prepared
    for split in SPLITS:
        for shard in read_index(out, split).shards:
            data = (out / shard.file).read_bytes()
            assert shard.sha256 == hashlib.sha256(data).hexdigest()
            assert shard.crc32 == f"{zlib.crc32(data):08x}" and shard.checksum == ("crc32", shard.crc32)


def test_the_first_training_start_up_after_prepare_hashes_no_shard(corpus, tmp_path, monkeypatch):
    """prepare computes each shard's checksums while writing it and records the shards as verified, so the first
    inspection of its output on this machine reads none of them (the record's "racy" window set to 0 here: a
    corpus this small is written within it)."""
    from distrain.artifacts.token_dataset import inspect_token_dataset
    from distrain.data import token_format

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(token_format, "RACY_NS", 0)
    out = tmp_path / "data"
    prepare(corpus, out, workers=1, quiet=True, **SETTINGS)
    hashed = []
    monkeypatch.setattr(token_format, "crc32_of", lambda path, **_: hashed.append(path.name) or "")
    inspect_token_dataset(out)
    assert hashed == []
    (out / "val-00000.bin").write_bytes((out / "val-00000.bin").read_bytes())  # rewritten: stamp changed
    with pytest.raises(DataError, match="val-00000.bin: its CRC-32 differs"):
        inspect_token_dataset(out)
    assert hashed == ["val-00000.bin"]


def test_uint32_shards_when_the_vocabulary_exceeds_uint16(prepared, corpus, tmp_path, monkeypatch):
    assert dtype_for(65536) == "uint16" and dtype_for(65537) == "uint32"
    writer = ShardWriter(tmp_path, "train", "uint32", shard_tokens=3)
    writer.write(np.array([70000, 1, 2**32 - 1, 5]), documents=1, max_token_id=2**32 - 1)
    shards = writer.close()
    assert [shard.tokens for shard in shards] == [3, 1]
    assert (tmp_path / "train-00000.bin").read_bytes() == np.array([70000, 1, 2**32 - 1], dtype="<u4").tobytes()
    # The whole path with a (pretended) large vocabulary: the same ids, stored as uint32.
    monkeypatch.setattr(prepare_module, "vocab_size_of", lambda tokenizer: 70000)
    out, _ = prepared
    prepare(corpus, tmp_path / "wide", workers=1, quiet=True, **SETTINGS)
    for split in SPLITS:
        index = read_index(tmp_path / "wide", split)
        assert (index.dtype, index.vocab_size) == ("uint32", 70000)
        verify_split(tmp_path / "wide", index)
        assert documents_of(tmp_path / "wide", split) == documents_of(out, split)


def test_given_tokenizer_file_is_used_as_given(prepared, corpus, tmp_path):
    out, _ = prepared
    given = tmp_path / "given" / "tokenizer.json"
    given.parent.mkdir()
    shutil.copyfile(out / "tokenizer.json", given)
    data = tmp_path / "data"
    summary = prepare(corpus, data, tokenizer=str(given), workers=1, quiet=True, val_fraction=0.3, seed=5)
    assert (data / "tokenizer.json").read_bytes() == given.read_bytes()
    assert summary["tokenizer_seconds"] == 0
    for split in SPLITS:
        assert documents_of(data, split) == documents_of(out, split)  # same tokenizer, same split: same ids
    record = json.loads((data / "prepare.json").read_text())
    assert record["tokenizer_source"]["file"] == str(given.resolve())
    # A changed tokenizer file (same path) is a changed input.
    assert prepare(corpus, data, tokenizer=str(given), workers=1, quiet=True, val_fraction=0.3, seed=5)["up_to_date"]
    given.write_text(given.read_text().replace('"<|endoftext|>"', '"<|endoftext|>" ', 1))
    assert not prepare(corpus, data, tokenizer=str(given), workers=1, quiet=True, val_fraction=0.3, seed=5)[
        "up_to_date"
    ]


def test_hugging_face_model_directory_and_its_eos(corpus, tmp_path):
    from transformers import PreTrainedTokenizerFast

    tokenizer = train_bpe([DOCUMENTS], vocab_size=300, eos_token="</s>", min_frequency=1, progress=False)
    tokenizer.add_special_tokens(["<pad>"])
    model_dir = tmp_path / "model"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>").save_pretrained(model_dir)
    data = tmp_path / "data"
    prepare(corpus, data, tokenizer=str(model_dir), workers=2, quiet=True, val_fraction=0.3, seed=5)
    assert (data / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    loaded = Tokenizer.from_file(str(data / "tokenizer.json"))
    for split in SPLITS:
        index = read_index(data, split)
        verify_split(data, index)
        assert index.eos_id == loaded.token_to_id("</s>") and index.vocab_size == loaded.get_vocab_size()
    decoded = [loaded.decode(ids) for split in SPLITS for ids in documents_of(data, split)]
    assert sorted(decoded) == sorted(DOCUMENTS)


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    corpus = tmp_path / "ok"
    corpus.mkdir()
    for number in range(2):
        (corpus / f"{number}.txt").write_text(f"document {number}")
    out = str(tmp_path / "out")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.bin").write_bytes(b"\0\1\2")
    (tmp_path / "one.txt").write_text("only one document")
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "nofield.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    (tmp_path / "badjson.jsonl").write_text('{"text": "fine"}\n\n{"text": "unterminated\n')
    (tmp_path / "notstring.jsonl").write_text('{"text": 3}\n')
    pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "nocol.parquet")
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 not really a Parquet file")
    (tmp_path / "broken.json").write_text('{"model": ')
    shutil.copyfile(Path(__file__), tmp_path / "plain.json")  # valid UTF-8 but not a tokenizer
    ok = ["--input", str(corpus)]
    return {
        "missing input": (["--input", str(tmp_path / "nowhere"), "--out", out], "nowhere"),
        "no documents": (["--input", str(tmp_path / "binary"), "--out", out], "no documents"),
        "one document": (["--input", str(tmp_path / "one.txt"), "--out", out], "only 1 document"),
        "out is a file": ([*ok, "--out", str(tmp_path / "a-file")], "a-file"),
        "vocab too small": ([*ok, "--out", out, "--vocab-size", "256"], "--vocab-size"),
        "missing field": (["--input", str(tmp_path / "nofield.jsonl"), "--out", out], "nofield.jsonl:2"),
        "bad json": (["--input", str(tmp_path / "badjson.jsonl"), "--out", out], "badjson.jsonl:3"),
        "not a string": (["--input", str(tmp_path / "notstring.jsonl"), "--out", out], "notstring.jsonl:1"),
        "missing column": (["--input", str(tmp_path / "nocol.parquet"), "--out", out], "nocol.parquet"),
        "broken tokenizer": ([*ok, "--out", out, "--tokenizer", str(tmp_path / "broken.json")], "broken.json"),
        "not a tokenizer": ([*ok, "--out", out, "--tokenizer", str(tmp_path / "plain.json")], "plain.json"),
        "missing tokenizer": ([*ok, "--out", out, "--tokenizer", str(tmp_path / "none.json")], "none.json"),
        "not an integer": ([*ok, "--out", out, "--vocab-size", "many"], "--vocab-size"),
        "bad fraction": ([*ok, "--out", out, "--val-fraction", "1.5"], "--val-fraction"),
        "no workers": ([*ok, "--out", out, "--workers", "0"], "--workers: must be >= 1"),
        "corrupt parquet": (["--input", str(tmp_path / "corrupt.parquet"), "--out", out], "corrupt.parquet"),
    }


BAD_CASES = [
    "missing input",
    "no documents",
    "one document",
    "out is a file",
    "vocab too small",
    "missing field",
    "bad json",
    "not a string",
    "missing column",
    "broken tokenizer",
    "not a tokenizer",
    "missing tokenizer",
    "not an integer",
    "bad fraction",
    "no workers",
    "corrupt parquet",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    cases = bad_inputs(tmp_path)
    assert list(cases) == BAD_CASES
    args, named = cases[case]
    assert main(["--workers", "1", *args]) == 2  # the case's own --workers, given last, wins
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("distrain prepare: ") and named in lines[0], captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert not (tmp_path / "out").exists()  # not even an empty DATA_DIR left behind by a failed first run


def test_a_corrupt_parquet_file_is_one_line_on_the_real_stderr(tmp_path):
    # datasets logs through a handler of its own (not captured by capsys): a subprocess sees what a user sees.
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 not really a Parquet file")
    command = [sys.executable, "-m", "distrain.data.prepare", "--input", str(tmp_path / "corrupt.parquet")]
    done = subprocess.run([*command, "--out", str(tmp_path / "d")], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "not a readable Parquet file" in done.stderr and not (tmp_path / "d").exists()


def test_eos_missing_from_a_given_vocabulary(prepared, tmp_path, capsys):
    out, _ = prepared
    (tmp_path / "docs").mkdir()
    for number in range(2):
        (tmp_path / "docs" / f"{number}.txt").write_text(f"document {number}")
    args = ["--input", str(tmp_path / "docs"), "--out", str(tmp_path / "out"), "--workers", "1"]
    assert main([*args, "--tokenizer", str(out / "tokenizer.json"), "--eos-token", "<eos>"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'<eos>' is not in its vocabulary" in err


def assert_no_index_names_a_bad_shard(directory: Path) -> None:
    for split in SPLITS:
        try:
            index = read_index(directory, split)
        except DataError:
            continue  # no readable index: nothing is named
        verify_split(directory, index)  # a readable index names only complete shards with their checksums


def publish_failing_at_second_move(monkeypatch):
    """Make prepare's publish fail (a full disk) on its second file move; returns the names it moved or tried."""
    moves = []

    def failing_move(source, target):
        moves.append(source.name)
        if len(moves) == 2:
            raise OSError(28, "No space left on device", str(target))
        shutil.move(source, target)

    monkeypatch.setattr(prepare_output, "move", failing_move)
    return moves


def test_interrupted_publish_leaves_no_index_and_the_next_run_succeeds(prepared, tmp_path, monkeypatch):
    out, _ = prepared
    corpus = write_corpus(tmp_path)  # other paths than the fixture's: a re-run replaces the old dataset
    data = tmp_path / "data"
    shutil.copytree(out, data)
    moves = publish_failing_at_second_move(monkeypatch)
    with pytest.raises(OSError):
        prepare(corpus, data, workers=1, quiet=True, **SETTINGS)
    assert moves == ["train-00000.bin", "val-00000.bin"]
    assert_no_index_names_a_bad_shard(data)
    assert not (data / "train.json").exists()  # prepare.json stays: it marks the shards as prepare's
    monkeypatch.undo()
    assert not prepare(corpus, data, workers=1, quiet=True, **SETTINGS)["up_to_date"]
    assert_no_index_names_a_bad_shard(data)
    assert shard_bytes(data) == shard_bytes(out) and not (data / ".prepare-tmp").exists()


def test_failure_while_tokenising_keeps_the_previous_dataset(prepared, corpus, tmp_path, monkeypatch):
    out, _ = prepared
    data = tmp_path / "data"
    shutil.copytree(out, data)

    def crash(self, ids, documents, max_token_id):
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardWriter, "write", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, data, workers=1, quiet=True, seed=6, **{k: v for k, v in SETTINGS.items() if k != "seed"})
    assert shard_bytes(data) == shard_bytes(out) and not (data / ".prepare-tmp").exists()
    assert_no_index_names_a_bad_shard(data)


def test_a_killed_runs_leftovers_are_removed(corpus, prepared, tmp_path):
    out, _ = prepared
    data = tmp_path / "data"
    (data / ".prepare-tmp").mkdir(parents=True)
    (data / ".prepare-tmp" / "train-00000.bin").write_bytes(b"\1\2\3")  # half a shard of a killed run
    (data / ".prepare-tmp" / "junk").write_text("junk")
    prepare(corpus, data, workers=2, quiet=True, **SETTINGS)
    assert not (data / ".prepare-tmp").exists()
    assert shard_bytes(data) == shard_bytes(out)
    assert_no_index_names_a_bad_shard(data)


def test_command_line_module_prints_one_line_and_nothing_on_stderr(tmp_path):
    for number in range(3):
        (tmp_path / f"{number}.txt").write_text(f"document {number} " * 10)
    command = [sys.executable, "-m", "distrain.data.prepare", "--input", str(tmp_path), "--out", str(tmp_path / "d")]
    command += ["--vocab-size", "280", "--workers", "2"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.count("\n") == 1 and "train 2 documents" in done.stdout and "val 1 document " in done.stdout
    for split in SPLITS:
        verify_split(tmp_path / "d", read_index(tmp_path / "d", split))


def test_split_is_seeded_by_whole_documents_and_never_leaves_a_split_empty(tmp_path):
    docs = tmp_path / "docs.jsonl"
    texts = [f"document {number:02d} of the corpus" for number in range(30)]
    docs.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))

    def split_of(name, **settings):
        out = tmp_path / name
        prepare([docs], out, vocab_size=300, workers=1, quiet=True, **settings)
        tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
        return {split: [tokenizer.decode(ids) for ids in documents_of(out, split)] for split in SPLITS}

    none_drawn = split_of("zero", val_fraction=0.0)
    assert none_drawn == {"train": texts[:-1], "val": texts[-1:]}  # the last document moved to val
    first, second = split_of("a", val_fraction=0.5, seed=1), split_of("b", val_fraction=0.5, seed=2)
    assert first != second and split_of("c", val_fraction=0.5, seed=1) == first
    for split in (first, second):
        assert sorted(split["train"] + split["val"]) == texts and 0 < len(split["val"]) < 30


def test_out_equal_to_the_input_directory_never_reads_its_own_output(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number in range(4):
        (corpus / f"{number}.txt").write_text(f"document number {number} " * 5)
    args = ["--input", str(corpus), "--out", str(corpus), "--vocab-size", "300", "--val-fraction", "0.25"]
    assert main([*args, "--workers", "1"]) == 0
    assert "up to date" not in capsys.readouterr().out
    record = json.loads((corpus / "prepare.json").read_text())
    assert [Path(entry["path"]).name for entry in record["inputs"]] == [f"{number}.txt" for number in range(4)]
    assert record["summary"]["documents"] == 4
    before = {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in corpus.iterdir()}
    assert main([*args, "--workers", "2"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in corpus.iterdir()} == before
    # Nor is one of its files read when named on its own: the same four inputs, still up to date.
    again = [corpus, corpus / "train.json", corpus / "train-00000.bin"]
    assert prepare(again, corpus, vocab_size=300, val_fraction=0.25, workers=1, quiet=True)["up_to_date"]


def test_a_changed_shard_is_found_and_re_prepared(corpus, prepared, tmp_path, capsys):
    out, _ = prepared
    data = tmp_path / "data"
    shutil.copytree(out, data)
    assert prepare(corpus, data, workers=1, quiet=True, **SETTINGS)["up_to_date"]
    shard = data / "train-00000.bin"
    damaged = bytearray(shard.read_bytes())
    damaged[3] ^= 0xFF  # same size: only its checksum tells
    shard.write_bytes(bytes(damaged))
    summary = prepare(corpus, data, workers=1, **SETTINGS)
    line = capsys.readouterr().out
    assert not summary["up_to_date"] and "train-00000.bin" in summary["re_prepared_because"]
    assert line.count("\n") == 1 and "re-prepared because" in line and "CRC-32" in line
    assert shard_bytes(data) == shard_bytes(out)
    assert prepare(corpus, data, workers=1, quiet=True, **SETTINGS)["up_to_date"]


# Replaces prepare's encode_batch in a subprocess (spawned workers import it by name from PYTHONPATH): a document
# holding DIE makes its worker exit at once, as a kill -9 or the OOM killer would; one holding SLOW makes it write
# its pid to $HOOK_MARK and sleep.
HOOKS = """
import os, time
from distrain.data import tokenizer_files

def encode_batch(texts, to_val):
    if any("DIE" in text for text in texts):
        os._exit(9)
    if any("SLOW" in text for text in texts):
        with open(os.environ["HOOK_MARK"] + ".part", "w") as file:
            file.write(str(os.getpid()))
        os.replace(os.environ["HOOK_MARK"] + ".part", os.environ["HOOK_MARK"])
        time.sleep(300)
    return tokenizer_files.encode_batch(texts, to_val)
"""
# SIGUSR2 prints every thread's stack: what a run that did not end was doing (see finish). SIGINT at its default, as
# a shell starts a command in the foreground: a test run from a background job (nohup ... &) passes on SIGINT
# ignored, and a process started so ignores a Ctrl-C, as it should.
RUN_WITH_HOOKS = (
    "import faulthandler, signal; faulthandler.register(signal.SIGUSR2, all_threads=True); "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "import sys, hooks, distrain.data.prepare as p; p.encode_batch = hooks.encode_batch; sys.exit(p.main())"
)


def start_with_hooks(tmp_path: Path, marker: str) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "hooks.py").write_text(textwrap.dedent(HOOKS))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number in range(6):
        (corpus / f"{number}.txt").write_text(f"document {number} " * 20 + (marker if number == 4 else ""))
    out = tmp_path / "out"
    command = [sys.executable, "-c", RUN_WITH_HOOKS, "--input", str(corpus), "--out", str(out), "--workers", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "HOOK_MARK": str(tmp_path / "pid")}
    # A session of its own: the test's Ctrl-C goes to this process group only, as a terminal's would.
    process = subprocess.Popen(
        [*command, "--vocab-size", "280"],
        cwd=REPO,
        env=env,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    return process, out


def finish(process: subprocess.Popen, seconds: float) -> tuple[str, str]:
    """The run's output once it ends within ``seconds``; else a failure showing its processes and its stacks."""
    try:
        return process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        tree = subprocess.run(["ps", "-o", "pid,stat,etimes,args", "-s", str(process.pid)], capture_output=True)
        if process.poll() is None:
            os.kill(process.pid, signal.SIGUSR2)
            time.sleep(1)
        kill_group(process)
        _, stderr = process.communicate()
        raise AssertionError(f"still running after {seconds} s:\n{tree.stdout.decode()}\n{stderr[-6000:]}") from None
    finally:
        kill_group(process)  # whatever is left of a hung run


def kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group may be gone already
        os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_a_worker_that_dies_fails_the_run_in_one_line_without_hanging(tmp_path):
    process, out = start_with_hooks(tmp_path, "DIE")
    stdout, stderr = finish(process, 60)
    assert process.returncode == 1 and stdout == "", stderr
    assert stderr.splitlines() == [
        "distrain prepare: a tokenising worker died (exit status 9); nothing was published"
    ], stderr
    assert not out.exists()  # the run created it, and failed


@pytest.mark.timeout(180)
def test_ctrl_c_while_tokenising_stops_the_workers_and_exits_130(tmp_path):
    process, out = start_with_hooks(tmp_path, "SLOW")
    mark = tmp_path / "pid"
    deadline = time.monotonic() + 120
    while not mark.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mark.exists(), finish(process, 1)
    worker = int(mark.read_text())
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: every process of the group gets it
    stdout, stderr = finish(process, 60)
    assert process.returncode == 130 and stdout == "", stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("distrain prepare: interrupted"), stderr
    assert not out.exists()
    with pytest.raises(ProcessLookupError):  # the sleeping worker was terminated (and reaped) by prepare
        os.kill(worker, 0)


def test_workers_ignore_sigint_from_birth_and_are_stopped_by_the_main_process():
    tokenizer = train_bpe([DOCUMENTS], vocab_size=300, eos_token="<|endoftext|>", min_frequency=1, progress=False)
    with worker_pool(1, tokenizer.to_str(), 0, "uint16") as pool:
        assert pool.submit(signal.getsignal, signal.SIGINT).result() == signal.SIG_IGN
        assert signal.SIGINT not in pool.submit(signal.pthread_sigmask, signal.SIG_BLOCK, []).result()
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # nor left blocked in this process
    with pytest.raises(KeyboardInterrupt), worker_pool(1, tokenizer.to_str(), 0, "uint16") as pool:
        processes = list(pool._processes.values()) if pool.submit(int).result() == 0 else []
        raise KeyboardInterrupt
    assert processes and all(process.exitcode is not None for process in processes)


def test_a_worker_whose_start_a_ctrl_c_interrupted_is_stopped_too(monkeypatch):
    """A Ctrl-C that arrives while a worker starts is delivered as its start returns, before the pool records it:
    that worker must be stopped with the others (left alive it waits for work forever, and so does the exit)."""
    tokenizer = train_bpe([DOCUMENTS], vocab_size=300, eos_token="<|endoftext|>", min_frequency=1, progress=False)
    start = _WorkerProcess.start

    def interrupted_start(process: _WorkerProcess) -> None:
        start(process)
        raise KeyboardInterrupt  # where a Ctrl-C held back while the child was started is delivered

    with pytest.raises(KeyboardInterrupt), worker_pool(1, tokenizer.to_str(), 0, "uint16") as pool:
        monkeypatch.setattr(_WorkerProcess, "start", interrupted_start)
        pool.submit(int)
    monkeypatch.undo()
    left = [child for child in multiprocessing.active_children() if isinstance(child, _WorkerProcess)]
    assert not left, left


def test_a_first_run_interrupted_while_publishing_is_replaced_without_overwrite(tmp_path, monkeypatch):
    """The record is written before any shard moves in, so what an interrupted first run left in a directory of
    the user's is known to be prepare's; the user's own file there is untouched."""
    corpus = write_corpus(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("mine")
    publish_failing_at_second_move(monkeypatch)
    with pytest.raises(OSError):
        prepare(corpus, data, workers=1, quiet=True, **SETTINGS)
    assert (data / "train-00000.bin").is_file() and not (data / "train.json").exists()
    monkeypatch.undo()
    assert not prepare(corpus, data, workers=1, quiet=True, **SETTINGS)["up_to_date"]
    assert_no_index_names_a_bad_shard(data)
    assert (data / "notes.txt").read_text() == "mine"
