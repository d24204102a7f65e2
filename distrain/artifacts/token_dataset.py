"""Inspector of a token dataset: ``python -m distrain.data.prepare``'s output, or nanoGPT's ``train.bin``/``val.bin``.

What it establishes (``distrain.data.token_format`` describes the format): the path is a directory holding both
splits' indexes (or both bins); each index is a ``distrain.tokens`` v1 JSON object with fields of the right types;
every shard exists and holds exactly the ids its index says, in whole ids of the index's dtype (and, with
``checksums``, has its index's CRC-32, or SHA-256 where it records none); neither split is empty; a tokenizer the
index names is readable. Ids above the vocabulary are caught as windows are read (``distrain.data.tokens``): an
index can understate them, and scanning every shard here would cost minutes on a large dataset.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrain.artifacts.tokenizer import inspect_tokenizer
from distrain.data.token_format import (
    SPLITS,
    ChecksumsCancelled,
    DataError,
    SplitIndex,
    has_index,
    read_index,
    verify_checksums,
    verify_split,
)
from distrain.data.tokens import dataset_directory, tokenizer_path
from distrain.errors import ArtifactError


@dataclass(frozen=True)
class TokenDataset:
    """A usable dataset: its directory, each split's index, and the tokenizer file beside it (None: none named)."""

    directory: Path
    splits: dict[str, SplitIndex]
    tokenizer: Path | None

    @property
    def vocab_size(self) -> int:
        return max(index.vocab_size for index in self.splits.values())

    @property
    def max_token_id(self) -> int:
        return max(index.max_token_id for index in self.splits.values())


def inspect_token_dataset(path: str | Path, *, checksums: bool = True) -> TokenDataset:
    """The dataset at ``path``; ``DataError`` (an ``ArtifactError``) naming the file and the problem otherwise."""
    directory = dataset_directory(path)
    splits = {}
    for split in SPLITS:
        index = read_index(directory, split)
        verify_split(directory, index, checksums=checksums)
        if index.tokens == 0:
            holder = f"{split}.json" if has_index(directory) else f"{split}.bin"
            raise DataError(str(directory / holder), f"the {split} split holds no tokens")
        splits[split] = index
    tokenizer = tokenizer_path(directory)
    if tokenizer is not None:
        try:
            inspect_tokenizer(tokenizer)
        except ArtifactError as err:
            raise DataError(err.where, err.problem) from None
    return TokenDataset(directory, splits, tokenizer)


class PendingChecksums:
    """Every shard's checksum of ``datasets`` (inspected without them; empty: nothing to check), checked on a thread
    of this process with one core left to the caller. A first start-up on a dataset copied from elsewhere reads all
    of its shards: the launch validates the rest of the config meanwhile and waits before any rank starts. Each
    dataset comes with the setting that names it (``key``, ``value``): after a changed shard, ``key`` and ``value``
    are that dataset's (``data.path``, or a mixture's ``data.sources.<name>.path``)."""

    def __init__(self, datasets: Sequence[tuple[TokenDataset, str, Any]] = ()) -> None:
        self.key, self.value = "data.path", None
        self.stop = threading.Event()
        self.future: Future[None] | None = None
        if datasets:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distrain-checksums")
            self.future = pool.submit(_verify_all, list(datasets), self, self.stop)
            pool.shutdown(wait=False)  # its one thread ends with the checksums (or at cancel)

    def wait(self) -> None:
        """Until every shard is checked; the first changed (or unreadable) shard's ``DataError``."""
        if self.future is not None:
            self.future.result()

    def cancel(self) -> None:
        """Nobody will wait: the thread stops within one chunk, so a refused launch exits at once."""
        self.stop.set()


def _verify_all(
    datasets: list[tuple[TokenDataset, str, Any]], pending: PendingChecksums, stop: threading.Event
) -> None:
    try:
        for dataset, key, value in datasets:
            pending.key, pending.value = key, value  # the setting a DataError raised next is about
            for index in dataset.splits.values():
                verify_checksums(dataset.directory, index, spare_cores=1, stop=stop)
    except ChecksumsCancelled:
        pass
