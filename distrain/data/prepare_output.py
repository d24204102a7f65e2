"""The output side of ``python -m distrain.data.prepare`` (format: ``distrain.data.token_format``): shards written
into a temporary directory, the dataset moved into place so that no index ever names a missing or half-written
shard, the ``prepare.json`` record that makes a re-run a no-op, and the summary line.

Runs in prepare's main process: the workers return token ids, only this process writes files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import zlib
from pathlib import Path

import numpy as np

from distrain.data.token_format import (
    FORMAT,
    SPLITS,
    DataError,
    Shard,
    SplitIndex,
    read_index,
    remember_written,
    verify_split,
    write_atomically,
    write_index,
)

TEMPORARY = ".prepare-tmp"
RECORD = "prepare.json"
TOKENIZER = "tokenizer.json"
SHARD_NAME = re.compile(r"(train|val)-\d{5,}\.bin")
COMPARED = ("version", "inputs", "settings", "tokenizer_source")  # what must match for a re-run to do nothing


class ShardWriter:
    """One split's shards: ids appended in order, a new file every ``shard_tokens`` ids, SHA-256 and CRC-32
    computed while writing (no second read), each shard flushed to disk when closed."""

    def __init__(self, directory: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.directory, self.split, self.shard_tokens, self.dtype_name = directory, split, shard_tokens, dtype
        # Little-endian whatever the machine, as the format says.
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shards: list[Shard] = []
        self.tokens = self.documents = self.max_token_id = 0
        self._file = self._digest = None
        self._name, self._in_shard, self._crc = "", 0, 0

    def write(self, ids: np.ndarray, documents: int, max_token_id: int) -> None:
        """Append ``ids`` (``documents`` whole documents, EOS included), splitting it where a shard fills up."""
        self.documents += documents
        self.max_token_id = max(self.max_token_id, max_token_id)
        data = ids.astype(self.dtype, copy=False)
        while data.size:
            if self._file is None:
                self._open()
            room = self.shard_tokens - self._in_shard
            piece, data = data[:room], data[room:]
            payload = piece.tobytes()
            self._file.write(payload)
            self._digest.update(payload)
            self._crc = zlib.crc32(payload, self._crc)
            self._in_shard += piece.size
            self.tokens += piece.size
            if self._in_shard == self.shard_tokens:
                self._close()

    def close(self) -> tuple[Shard, ...]:
        """Close the last shard; the shards written, in order."""
        if self._file is not None:
            self._close()
        return tuple(self.shards)

    def index(self, vocab_size: int, eos_id: int, tokenizer: str) -> SplitIndex:
        """Close the last shard; the split's index."""
        shards = self.close()
        return SplitIndex(
            self.split,
            self.dtype_name,
            vocab_size,
            eos_id,
            tokenizer,
            self.documents,
            self.tokens,
            self.max_token_id,
            shards,
        )

    def _open(self) -> None:
        self._name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file, self._digest, self._in_shard = open(self.directory / self._name, "wb"), hashlib.sha256(), 0
        self._crc = 0

    def _close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        digests = {"sha256": self._digest.hexdigest(), "crc32": f"{self._crc:08x}"}
        self.shards.append(Shard(file=self._name, tokens=self._in_shard, **digests))
        self._file = self._digest = None


def is_output(out: Path, path: Path) -> bool:
    """Whether ``path`` (resolved) is a file prepare writes in ``out``: never an input, even when ``out`` is an
    input directory."""
    if path.is_relative_to(out / TEMPORARY):
        return True
    written = (RECORD, TOKENIZER, *(f"{split}.json" for split in SPLITS))
    return path.parent == out and (path.name in written or SHARD_NAME.fullmatch(path.name) is not None)


def foreign_outputs(out: Path) -> list[Path]:
    """Files in ``out`` that a run would replace or remove but no prepare wrote: a ``train.json``/``val.json`` that
    is not a token index, a ``prepare.json`` that is not prepare's record, and, with no sign of an earlier run
    (its record, an index, an interrupted run's temporary directory), a ``tokenizer.json`` or shard-named file."""
    if not out.is_dir():
        return []
    indexes = [out / f"{split}.json" for split in SPLITS if (out / f"{split}.json").is_file()]
    foreign = [index for index in indexes if not _is_index(index)]
    if (out / RECORD).is_file() and not _has_record(out):
        foreign.append(out / RECORD)
    earlier_run = (out / TEMPORARY).is_dir() or _has_record(out) or len(foreign) < len(indexes)
    owned = owned_shards(out)
    for path in out.iterdir():
        if SHARD_NAME.fullmatch(path.name) and path.name not in owned:
            foreign.append(path)  # a shard-named file no earlier run's index or record names
        elif path.name == TOKENIZER and not earlier_run:
            foreign.append(path)
    return sorted(path for path in foreign if path.is_file())


def owned_shards(out: Path) -> set[str]:
    """The shard files an earlier prepare wrote in ``out``: those its indexes name, and those its record lists (an
    interrupted publish has removed the indexes but written the record first)."""
    owned: set[str] = set()
    for split in SPLITS:
        if _is_index(out / f"{split}.json"):
            try:
                names = {shard.file for shard in read_index(out, split).shards}
                owned |= {name for name in names if SHARD_NAME.fullmatch(name)}  # never ../x or README.md
            except DataError:
                pass  # a damaged index of ours owns nothing: its shards stay where they are
    if _has_record(out):
        shards = json.loads((out / RECORD).read_text()).get("shards", [])
        owned |= {name for name in shards if isinstance(name, str) and SHARD_NAME.fullmatch(name)}
    return owned


def _is_index(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _has_record(out: Path) -> bool:
    try:
        record = json.loads((out / RECORD).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"version", "settings"} <= record.keys()


def fresh_temporary(out: Path) -> Path:
    """``out/.prepare-tmp``, emptied: what an interrupted run left there is never reused."""
    temporary = out / TEMPORARY
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    return temporary


def publish(out: Path, temporary: Path, indexes: dict[str, SplitIndex], record: dict) -> None:
    """Move a finished dataset from ``temporary`` into ``out``.

    The order is what makes it safe to interrupt anywhere: the old indexes go first, so no index names a shard
    while it is being replaced, and the new ``prepare.json`` is written (it marks the directory's shards as
    prepare's, so the next run replaces them without ``--overwrite``); then shards and tokenizer move in (renames on
    one file system); then an earlier run's shards that the new indexes do not name are removed (only those its
    indexes or record named); the two indexes are written last. Until then a reader finds no dataset, never a wrong one.
    """
    named = {shard.file for index in indexes.values() for shard in index.shards}
    stale = owned_shards(out) - named  # only an earlier run's shards: a file no run of ours wrote stays
    for name in (f"{split}.json" for split in SPLITS):
        (out / name).unlink(missing_ok=True)
    # The new record before anything moves in: from here on the directory's shards are marked as prepare's (an
    # interrupted run's next attempt replaces them without --overwrite; the record alone is no dataset).
    _write_record(out, record, named | stale)
    for name in sorted(named) + ([TOKENIZER] if (temporary / TOKENIZER).is_file() else []):
        move(temporary / name, out / name)
    for name in sorted(stale):
        (out / name).unlink(missing_ok=True)
    _write_record(out, record, named)
    _sync_directory(out)
    for split in SPLITS:
        write_index(out, indexes[split])
    _sync_directory(out)
    shutil.rmtree(temporary, ignore_errors=True)
    for split in SPLITS:  # hashed while written: training's first start-up need not read them again
        remember_written(out, indexes[split])


def _write_record(out: Path, record: dict, shards: set[str]) -> None:
    """``prepare.json``: the run's record plus the shard files it owns in ``out`` (only those a later run removes)."""
    write_atomically(out / RECORD, (json.dumps({**record, "shards": sorted(shards)}, indent=1) + "\n").encode())


def move(source: Path, target: Path) -> None:
    """``source`` renamed to ``target`` (a function of its own so that tests can make it fail)."""
    os.replace(source, target)


def _sync_directory(directory: Path) -> None:
    # The renames themselves reach the disk only when the directory does (POSIX); Windows cannot open directories.
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def input_fingerprints(files: list[Path]) -> list[dict]:
    """Each input file's path, size and modification time: what a re-run compares to decide there is nothing to do
    (cheap for any corpus size; a content hash would read it all)."""
    fingerprints = []
    for path in files:
        status = path.stat()
        fingerprints.append({"path": str(path), "bytes": status.st_size, "mtime_ns": status.st_mtime_ns})
    return fingerprints


def up_to_date(out: Path, record: dict) -> tuple[dict | None, str | None]:
    """``(summary, None)`` for the dataset in ``out`` when it was prepared from the same inputs, settings and
    tokenizer (``record``) and is intact: both indexes readable, every shard there with its size and SHA-256 (a
    re-run reads the dataset once; that is what lets it repair a changed shard). ``(None, why)`` when the record
    matches but the dataset is not intact; ``(None, None)`` when there is no dataset or it was prepared otherwise."""
    try:
        previous = json.loads((out / RECORD).read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(previous, dict) or any(previous.get(key) != record[key] for key in COMPARED):
        return None, None
    try:
        for split in SPLITS:
            verify_split(out, read_index(out, split))
    except DataError as err:
        return None, str(err)
    summary = previous.get("summary")
    if not isinstance(summary, dict):
        return None, f"{out / RECORD}: holds no summary"
    return (summary, None) if (out / TOKENIZER).is_file() else (None, f"{out / TOKENIZER}: missing")


def nothing_to_do(out: Path) -> str:
    """The one line of a run that found ``out`` up to date."""
    return (
        f"distrain prepare: {out} is up to date (same inputs, settings and tokenizer, shards complete and unchanged): "
        "nothing to do"
    )


def summary_line(summary: dict) -> str:
    """The one line printed at the end of a run."""
    splits = ", ".join(
        f"{split} {_count(part['documents'], 'document')} {_count(part['tokens'], 'token')} "
        f"({_count(part['shards'], 'shard')})"
        for split, part in summary["splits"].items()
    )
    trained = f"tokenizer training {summary['tokenizer_seconds']:.1f} s, " if summary["tokenizer_seconds"] else ""
    return (
        f"distrain prepare: {summary['out']}: {splits}; {summary['bytes'] / 1e6:,.1f} MB of {summary['dtype']} "
        f"(vocabulary {summary['vocab_size']:,}) in {summary['seconds']:.1f} s ({trained}tokenising "
        f"{summary['tokenize_seconds']:.1f} s at {summary['tokens_per_second']:,.0f} tokens/s); skipped "
        f"{_count(summary['skipped_binary_files'], 'binary file')}, "
        f"{_count(summary['empty_documents'], 'empty document')}"
    )


def build_summary(
    out: Path, indexes: dict[str, SplitIndex], seconds: dict[str, float], binary_files: int, empty_documents: int
) -> dict:
    """What a run did: totals at the top, per split under ``splits``; ``tokens_per_second`` is the tokenising
    pass's (``seconds["tokenize"]``), ``seconds`` the whole run's, ``tokenizer_seconds`` the BPE training's."""
    tokens = sum(index.tokens for index in indexes.values())
    summary = {
        "out": str(out),
        "documents": sum(index.documents for index in indexes.values()),
        "tokens": tokens,
        "shards": sum(len(index.shards) for index in indexes.values()),
        "bytes": sum(index.tokens * index.numpy_dtype.itemsize for index in indexes.values()),
        "splits": {
            split: {"documents": index.documents, "tokens": index.tokens, "shards": len(index.shards)}
            for split, index in indexes.items()
        },
        "dtype": indexes["train"].dtype,
        "vocab_size": indexes["train"].vocab_size,
        "eos_id": indexes["train"].eos_id,
        "seconds": round(seconds["total"], 3),
        "tokenizer_seconds": round(seconds["tokenizer"], 3),
        "tokenize_seconds": round(seconds["tokenize"], 3),
        "tokens_per_second": round(tokens / max(seconds["tokenize"], 1e-9), 1),
        "skipped_binary_files": binary_files,
        "empty_documents": empty_documents,
        "up_to_date": False,
    }
    return {**summary, "message": summary_line(summary)}


def _count(number: int, thing: str) -> str:
    return f"{number:,} {thing}{'' if number == 1 else 's'}"
