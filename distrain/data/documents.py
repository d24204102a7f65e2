"""The documents of ``python -m distrain.data.prepare``'s inputs: which files, in what order, and their texts.

Runs in prepare's main process only (the tokenising workers receive the texts, never the files). A file is read in
one of three ways, by its suffix: ``.jsonl`` (one JSON object a line, the text under a field), ``.parquet``
(through Hugging Face ``datasets``, streamed, the text in a column) and anything else (the whole file is one
UTF-8 document; files holding NUL bytes are taken for binary and skipped). Reading is deterministic, so prepare
can read the inputs several times (count, train a tokenizer, tokenise) and see the same documents each time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from distrain.data.token_format import DataError

JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
PARQUET_BATCH_ROWS = 1024
BATCH_CHARACTERS = 1 << 20  # a batch is about 1 MB of text: big enough to amortise the hand-off, small to balance
TRAIN_BATCH_DOCUMENTS = 1024


@dataclass
class ReadStats:
    """What a pass over the inputs met besides documents (filled in while iterating)."""

    binary_files: list[Path] = field(default_factory=list)
    empty_documents: int = 0


def find_input_files(
    inputs: Sequence[str | os.PathLike],
    *,
    exclude: Path | None = None,
    skip: Callable[[Path], bool] | None = None,
) -> list[Path]:
    """The files named by ``inputs`` (files, or directories recursed), resolved, in a fixed order.

    Each input keeps its place on the command line; a directory's files come sorted by path. Hidden entries
    (names starting with ``.``: ``.git``, ``.prepare-tmp``) are left out of directories, and so is everything
    under ``exclude`` when it is a directory below an input (the output directory), and every file for which
    ``skip`` (given the resolved path) is true, named or found (prepare's own output files, when ``exclude`` is an
    input directory itself). A file named twice is read once, at its first place. DataError for an input that does
    not exist.
    """
    files: list[Path] = []
    seen: set[Path] = set()
    for raw in inputs:
        path = Path(raw).expanduser()
        if not path.exists():
            raise DataError(str(raw), "no such file or directory (--input)")
        path = path.resolve()
        found = [path] if path.is_file() else _directory_files(path, exclude)
        for file in found:
            if file not in seen and not (skip and skip(file)):
                seen.add(file)
                files.append(file)
    return files


def _directory_files(root: Path, exclude: Path | None) -> list[Path]:
    found = []
    for directory, subdirectories, names in os.walk(root):
        here = Path(directory)
        # Pruned in place so that os.walk does not descend into hidden directories or the output directory.
        subdirectories[:] = [name for name in subdirectories if not name.startswith(".") and (here / name) != exclude]
        found.extend(here / name for name in names if not name.startswith(".") and (here / name).is_file())
    return sorted(found)


def iter_documents(
    files: Sequence[Path], text_field: str, stats: ReadStats | None = None, *, cache_dir: Path | None = None
) -> Iterator[str]:
    """Every non-empty document of ``files`` in order. DataError naming ``file:line`` (JSONL) or the file
    (Parquet) for a record without a string ``text_field``. ``cache_dir``: where ``datasets`` may put its lock
    files (prepare's temporary directory rather than the user's Hugging Face cache)."""
    stats = stats if stats is not None else ReadStats()
    for path in files:
        suffix = path.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            texts = _jsonl_texts(path, text_field)
        elif suffix in PARQUET_SUFFIXES:
            texts = _parquet_texts(path, text_field, cache_dir)
        else:
            texts = _plain_text(path, stats)
        for text in texts:
            if text:
                yield text
            else:
                stats.empty_documents += 1


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    # Undecodable bytes are replaced rather than fatal, as for plain text; JSON syntax errors are the user's to fix.
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline) hold no record
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}", f"not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict) or text_field not in record:
                what = "has no field" if isinstance(record, dict) else f"is a JSON {type(record).__name__}, not an"
                raise DataError(f"{path}:{number}", f"{what} {text_field!r} (--text-field)")
            text = record[text_field]
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}", f"field {text_field!r} is {type(text).__name__}, not a string")
            yield text


def _parquet_texts(path: Path, text_field: str, cache_dir: Path | None) -> Iterator[str]:
    # Imported here: datasets takes about a second to import, and most corpora hold no Parquet file.
    import datasets

    # datasets logs a broken file's error (and may draw progress bars) before raising: the DataError below is the
    # one line prepare prints, so its logging is silenced while reading, and restored after.
    verbosity, bars = datasets.logging.get_verbosity(), not datasets.are_progress_bars_disabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL + 1)
    datasets.disable_progress_bars()
    try:
        yield from _parquet_rows(path, text_field, cache_dir)
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _parquet_rows(path: Path, text_field: str, cache_dir: Path | None) -> Iterator[str]:
    import datasets

    kwargs = {"cache_dir": str(cache_dir)} if cache_dir is not None else {}
    try:
        dataset = datasets.IterableDataset.from_parquet(str(path), **kwargs)
        features = dataset.features
    except Exception as err:  # pyarrow's errors have no common base worth naming
        raise DataError(str(path), f"not a readable Parquet file ({type(err).__name__}: {err})") from None
    if text_field not in features:
        raise DataError(str(path), f"has no column {text_field!r} (--text-field); its columns: {', '.join(features)}")
    kind = getattr(features[text_field], "dtype", None)
    if kind not in ("string", "large_string"):
        raise DataError(str(path), f"column {text_field!r} holds {features[text_field]}, not strings")
    for batch in dataset.select_columns([text_field]).iter(batch_size=PARQUET_BATCH_ROWS):
        # A null is a missing text: read as an empty document (skipped and counted), as Parquet writers use it.
        yield from (text or "" for text in batch[text_field])


def batches(
    documents: Iterator[tuple[str, bool]], max_documents: int = TRAIN_BATCH_DOCUMENTS
) -> Iterator[tuple[list[str], list[bool]]]:
    """Documents (with their split) grouped into batches of about ``BATCH_CHARACTERS`` characters (at most
    ``max_documents``)."""
    texts: list[str] = []
    splits: list[bool] = []
    characters = 0
    for text, to_val in documents:
        texts.append(text)
        splits.append(to_val)
        characters += len(text)
        if characters >= BATCH_CHARACTERS or len(texts) >= max_documents:
            yield texts, splits
            texts, splits, characters = [], [], 0
    if texts:
        yield texts, splits


def _plain_text(path: Path, stats: ReadStats) -> Iterator[str]:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(str(path), f"unreadable ({err.strerror or err})") from None
    if b"\0" in data:
        # No text file holds NUL; images, archives and compiled files almost always do.
        stats.binary_files.append(path)
        return
    yield data.decode("utf-8", errors="replace")
