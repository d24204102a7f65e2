"""The on-disk format of a tokenised dataset (what ``python -m distrain.data.prepare`` writes, ``data=tokens`` reads).

A dataset is one directory::

    DATA_DIR/
      train.json            the train split's index
      train-00000.bin ...   its shards: raw little-endian token ids, nothing else
      val.json, val-00000.bin ...
      tokenizer.json        the Hugging Face ``tokenizers`` file the ids came from (optional)
      prepare.json          what prepare ran on and with (inputs, settings, summary): a re-run compares it

An index (one per split) is a small JSON object::

    {"format": "distrain.tokens", "version": 1, "split": "train", "dtype": "uint16", "vocab_size": 32000,
     "eos_id": 0, "tokenizer": "tokenizer.json", "documents": 9120, "tokens": 41234567, "max_token_id": 31999,
     "shards": [{"file": "train-00000.bin", "tokens": 33554432, "sha256": "9f2c...", "crc32": "5d1e04a7"}, ...]}

``dtype`` is ``uint16`` when every id fits (vocabulary <= 65536), else ``uint32``; a shard is flat ids, so any tool
can memory-map it (``np.memmap(path, dtype)``), while distrain's reader uses positioned reads. Documents are split
into train and validation whole (a fixed seed picks them), each followed by the end-of-document id ``eos_id``; a
shard may end inside a document. nanoGPT's ``train.bin``/``val.bin`` (uint16, no index) are read as one-shard splits
whose checksum is not known and whose vocabulary is their largest id + 1, or, with nanoGPT's character-level
``meta.pkl`` beside them, its characters' (the index then names ``meta.pkl`` as the file the ids came from). Index
and shards are written to temporary names and renamed when complete, shards first and the index last, so a reader
never sees a split whose index names a half-written shard. A shard's CRC-32 is what start-up checks (it finds the
accidental change, a truncated or damaged copy, at twice SHA-256's speed); its SHA-256 identifies it (and is checked
when an index has no CRC-32).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from distrain.artifacts.char_vocab import FILE as CHAR_VOCAB
from distrain.artifacts.char_vocab import inspect_char_vocab
from distrain.errors import ArtifactError

FORMAT, VERSION = "distrain.tokens", 1
SPLITS = ("train", "val")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
MAX_VERIFIED = 10_000  # shards remembered as verified (the oldest are forgotten first)
RACY_NS = 2_000_000_000  # a shard modified this recently is not recorded as verified (see remember_verified)


class DataError(ArtifactError):
    """Data that cannot be trained on: ``where`` (a config key or a file), what is wrong with it. Found inside a
    rank (an id above the vocabulary in a window being read) it ends the job with this one line."""


@dataclass(frozen=True)
class Shard:
    """One shard file of a split (``file`` relative to the dataset directory)."""

    file: str
    tokens: int
    sha256: str | None = None
    crc32: str | None = None  # 8 hex digits

    @property
    def checksum(self) -> tuple[str, str] | None:
        """(algorithm, expected digest) start-up verifies: the CRC-32 when the index has one, else the SHA-256."""
        if self.crc32:
            return ("crc32", self.crc32)
        return ("sha256", self.sha256) if self.sha256 else None


@dataclass(frozen=True)
class SplitIndex:
    """A split's index: what its shards hold and how to read them."""

    split: str
    dtype: str
    vocab_size: int
    eos_id: int | None
    tokenizer: str | None
    documents: int | None
    tokens: int
    max_token_id: int
    shards: tuple[Shard, ...]

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])


def dtype_for(vocab_size: int) -> str:
    """The smallest shard dtype that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class ChecksumsCancelled(Exception):
    """Raised inside a checksum whose ``stop`` event was set: nobody waits for its result any more."""


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise ChecksumsCancelled


def sha256_of(path: Path, chunk_bytes: int = 1 << 24, stop: threading.Event | None = None) -> str:
    """The SHA-256 of a file, read in 16 MiB chunks (constant memory); ``stop`` set: ``ChecksumsCancelled``."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(chunk_bytes):
            _check_stop(stop)
            digest.update(chunk)
    return digest.hexdigest()


def crc32_of(path: Path, chunk_bytes: int = 1 << 26, stop: threading.Event | None = None) -> str:
    """The CRC-32 of a file as 8 hex digits, computed on a read-only memory map 64 MiB at a time: no copy of the
    file's pages (a read's copy costs as much as the CRC). Runs in the launching process; the map is closed after.
    ``stop`` set: ``ChecksumsCancelled`` before the next 64 MiB."""
    value = 0
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return f"{value:08x}"
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for start in range(0, len(mapped), chunk_bytes):
                    _check_stop(stop)
                    value = zlib.crc32(view[start : start + chunk_bytes], value)
            finally:
                view.release()
    return f"{value:08x}"


def checksum_of(path: Path, algorithm: str, stop: threading.Event | None = None) -> str:
    """The file's digest by ``algorithm`` (``crc32`` or ``sha256``)."""
    return crc32_of(path, stop=stop) if algorithm == "crc32" else sha256_of(path, stop=stop)


CHECKSUM_NAMES = {"crc32": "CRC-32", "sha256": "SHA-256"}


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary sibling renamed when complete (and flushed to disk)."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    partial.replace(path)


def write_index(directory: Path, index: SplitIndex) -> None:
    """The split's index as ``<split>.json``, atomically: written after its shards, it makes the split visible."""
    body = {"format": FORMAT, "version": VERSION, **asdict(index), "shards": [asdict(s) for s in index.shards]}
    write_atomically(directory / f"{index.split}.json", (json.dumps(body, indent=1) + "\n").encode())


def is_nanogpt(directory: Path) -> bool:
    """A nanoGPT dataset: ``train.bin`` and ``val.bin``, no index."""
    return (directory / "train.bin").is_file() and (directory / "val.bin").is_file() and not has_index(directory)


def has_index(directory: Path) -> bool:
    return all((directory / f"{split}.json").is_file() for split in SPLITS)


def read_index(directory: Path, split: str) -> SplitIndex:
    """The index of ``split`` in ``directory`` (a prepared dataset or a nanoGPT one); DataError naming the file."""
    if not has_index(directory) and is_nanogpt(directory):
        return _nanogpt_index(directory, split)
    path = directory / f"{split}.json"
    try:
        body = json.loads(path.read_text())
        if not isinstance(body, dict):
            raise DataError(
                str(path),
                f"not a {FORMAT} index (a JSON {type(body).__name__}, not an object): "
                "a prepared dataset is python -m distrain.data.prepare's output",
            )
        if body.get("format") != FORMAT or body.get("version") != VERSION:
            raise DataError(str(path), f"not a {FORMAT} v{VERSION} index (format {body.get('format')!r})")
        shards = tuple(Shard(**shard) for shard in body["shards"])
        fields = {key: body[key] for key in SplitIndex.__dataclass_fields__ if key != "shards"}
        index = SplitIndex(**fields, shards=shards)
    except (OSError, ValueError, KeyError, TypeError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(str(path), f"an unreadable index ({type(err).__name__}: {err})") from None
    _check_types(path, index)
    if index.dtype not in DTYPES:
        raise DataError(str(path), f"dtype {index.dtype!r} is not one of {', '.join(DTYPES)}")
    return index


def _check_types(path: Path, index: SplitIndex) -> None:
    """Counts are integers >= 0, names strings: an index edited by hand fails here, not inside a rank."""
    counts = {"vocab_size": index.vocab_size, "tokens": index.tokens, "max_token_id": index.max_token_id}
    counts |= {f"shards[{n}].tokens": shard.tokens for n, shard in enumerate(index.shards)}
    for field, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DataError(str(path), f"{field} is {json.dumps(value)}, not an integer >= 0")
    for field, value in {
        "dtype": index.dtype,
        **{f"shards[{n}].file": s.file for n, s in enumerate(index.shards)},
    }.items():
        if not isinstance(value, str):
            raise DataError(str(path), f"{field} is {json.dumps(value)}, not a string")
    for n, shard in enumerate(index.shards):
        for field in ("sha256", "crc32"):
            value = getattr(shard, field)
            if value is not None and not isinstance(value, str):
                raise DataError(str(path), f"shards[{n}].{field} is {json.dumps(value)}, not a hex string")
    if not index.shards:
        raise DataError(str(path), "names no shard")


def _nanogpt_index(directory: Path, split: str) -> SplitIndex:
    """A nanoGPT ``<split>.bin`` as a one-shard split. Its vocabulary: a character-level ``meta.pkl``'s beside it
    (its tokenizer), else the largest id of both bins + 1."""
    path = directory / f"{split}.bin"
    size = path.stat().st_size
    if size % 2:
        raise DataError(str(path), f"{size} bytes is not a whole number of uint16 token ids (nanoGPT's format)")
    bins = [directory / f"{name}.bin" for name in SPLITS]
    largest = _largest_of(tuple(str(b) for b in bins), tuple((b.stat().st_size, b.stat().st_mtime_ns) for b in bins))
    shard = Shard(file=path.name, tokens=size // 2, sha256=None)
    tokenizer, vocab_size = None, largest + 1
    if (directory / CHAR_VOCAB).exists() or (directory / CHAR_VOCAB).is_symlink():  # a bad one is refused, not skipped
        try:
            tokenizer, vocab_size = CHAR_VOCAB, inspect_char_vocab(directory / CHAR_VOCAB).vocab_size
        except ArtifactError as err:
            raise DataError(err.where, err.problem) from None
        if largest >= vocab_size:
            raise DataError(
                str(directory / CHAR_VOCAB), f"maps {vocab_size} characters, but the bins hold the id {largest}"
            )
    return SplitIndex(split, "uint16", vocab_size, None, tokenizer, None, size // 2, largest, (shard,))


@lru_cache(maxsize=8)
def _largest_of(paths: tuple[str, ...], stamps: tuple[tuple[int, int], ...]) -> int:
    """The largest id in the files ``paths``, scanned once per version of them (``stamps``: size, mtime): every
    split's index and every check asks, and a scan of an 18 GB bin takes minutes from a cold disk."""
    del stamps  # part of the cache key only
    return max(_largest_id(Path(path)) for path in paths)


def _largest_id(path: Path, chunk: int = 1 << 24) -> int:
    """The largest uint16 id in the file at ``path``, read 16M ids at a time into one reused buffer, so neither
    the process's memory nor its resident set grows with the file (a memory map's touched pages would stay in it)."""
    largest = 0
    with open(path, "rb") as file:
        while (ids := np.fromfile(file, dtype=np.uint16, count=chunk)).size:
            largest = max(largest, int(ids.max()))
    return largest


def verify_checksums(
    directory: Path, index: SplitIndex, *, spare_cores: int = 0, stop: threading.Event | None = None
) -> None:
    """Each shard's checksum (its CRC-32, or its SHA-256 when the index has none) equals its index's, computed on
    threads (zlib and hashlib release the GIL: one shard per core); a shard this user's cache records as verified,
    unchanged since (same size, modification and change times, inode and device), is not read again. DataError
    naming the first shard that differs (or cannot be read). ``spare_cores``: cores left to other work of this
    process; ``stop`` set: ``ChecksumsCancelled``."""
    cache = _read_verified()
    shards = [(directory / shard.file, shard.checksum) for shard in index.shards if shard.checksum]
    pending = [(path, checksum) for path, checksum in shards if not _verified(cache, path, _key(*checksum))]
    cores = (os.cpu_count() or 1) - spare_cores
    with ThreadPoolExecutor(max_workers=max(1, min(len(pending), cores))) as pool:
        results = list(pool.map(lambda item: _hash_between_stamps(item[0], item[1][0], stop), pending))
    for (path, (algorithm, expected)), (digest, _) in zip(pending, results, strict=True):
        if digest != expected:
            name = CHECKSUM_NAMES[algorithm]
            raise DataError(str(path), f"its {name} differs from {index.split}.json's: the file changed")
    _remember_verified(
        cache,
        [
            (path, _key(checksum[0], digest), stamp)
            for (path, checksum), (digest, stamp) in zip(pending, results, strict=True)
        ],
    )


def remember_written(directory: Path, index: SplitIndex) -> None:
    """Record the shards of ``index`` that a writer has just finished (their checksums computed while writing them)
    as verified in this user's cache, so the first start-up after ``prepare`` on this machine reads none again."""
    shards = [(directory / shard.file, shard.checksum) for shard in index.shards if shard.checksum]
    _remember_verified(_read_verified(), [(path, _key(*checksum), _stamp(path)) for path, checksum in shards])


def _key(algorithm: str, digest: str) -> str:
    """How the cache records a verified digest: ``crc32:5d1e04a7``."""
    return f"{algorithm}:{digest}"


def _verified_cache() -> Path | None:
    try:
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # no home directory: nothing is remembered
        return None
    return home / "distrain" / "verified_shards.json"


def _stamp(path: Path) -> list[int]:
    status = path.stat()
    return [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino, status.st_dev]


def _hash_between_stamps(
    path: Path, algorithm: str, stop: threading.Event | None = None
) -> tuple[str, list[int] | None]:
    """The file's digest, and its stamp when the file did not change while it was read (else None: not recorded).
    A shard removed, cut short or unreadable since it was inspected is a DataError naming it."""
    try:
        before = _stamp(path)
        digest = checksum_of(path, algorithm, stop)
        return digest, before if _stamp(path) == before else None
    except (OSError, ValueError) as err:  # ValueError: mmap of a file truncated after its size was read
        raise DataError(str(path), f"unreadable while its checksum was computed ({err})") from None


def _read_verified() -> dict:
    cache_file = _verified_cache()
    try:
        cache = json.loads(cache_file.read_text()) if cache_file else {}
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _verified(cache: dict, path: Path, key: str) -> bool:
    """Whether ``path`` was found to have the digest ``key`` names and has not changed since."""
    entry = cache.get(str(path.resolve()))
    return isinstance(entry, dict) and entry.get("checksum") == key and entry.get("stamp") == _stamp(path)


def _remember_verified(cache: dict, verified: list[tuple[Path, str, list[int] | None]]) -> None:
    """Record verified shards in this user's cache, written through a temporary file of its own and renamed (two
    jobs writing at once lose an entry, never corrupt the file); a cache that cannot be written is skipped."""
    cache_file = _verified_cache()
    if not verified or cache_file is None:
        return
    for path, digest, stamp in verified:
        # A file modified within the file system's timestamp granularity of now could change again without its
        # modification time moving ("racy" in git's words): not recorded, hashed again next time.
        if stamp is not None and time.time_ns() - stamp[1] > RACY_NS:
            cache[str(path.resolve())] = {"checksum": digest, "stamp": stamp}
    cache = dict(list(cache.items())[-MAX_VERIFIED:])  # the most recent entries (dicts keep insertion order)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        descriptor, partial = tempfile.mkstemp(dir=cache_file.parent, prefix=".verified_shards.")
        with os.fdopen(descriptor, "w") as file:
            json.dump(cache, file)
        os.replace(partial, cache_file)
    except OSError:
        pass


def verify_split(directory: Path, index: SplitIndex, *, checksums: bool = True) -> None:
    """Every shard of ``index`` exists, holds a whole number of ids, as many as the index says, and (with
    ``checksums``) has the index's SHA-256; the shards' token counts add up to the index's. DataError naming the
    shard file otherwise."""
    itemsize = index.numpy_dtype.itemsize
    for shard in index.shards:
        path = directory / shard.file
        if not path.is_file():
            raise DataError(str(path), f"missing (named by {index.split}.json)")
        size = path.stat().st_size
        if size % itemsize:
            raise DataError(str(path), f"{size} bytes is not a whole number of {index.dtype} token ids")
        if size // itemsize != shard.tokens:
            raise DataError(str(path), f"holds {size // itemsize} tokens, its index says {shard.tokens}")
    if checksums:
        verify_checksums(directory, index)
    if sum(shard.tokens for shard in index.shards) != index.tokens:
        raise DataError(str(directory / f"{index.split}.json"), "its shards' token counts do not add up to tokens")
