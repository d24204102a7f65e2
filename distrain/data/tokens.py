"""``data=tokens``: train on a tokenised dataset on disk (``token_format``), never loaded whole.

Every rank opens the shards of both splits (nothing is read until a window is asked for) and reads only the windows
its sampler draws. Windows are ``seq_len + 1`` tokens and never cross a shard boundary, so a split of
shards of ``n_i`` tokens holds ``sum((n_i - 1) // seq_len)`` windows; window ``j`` of a shard starts at
``j * seq_len``. The global window order is the existing ``GlobalBatchSampler``'s, so the ``[micro-step][rank]
[sample]`` layout, exact resume and a change of world size work the same over any number of shards.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distrain.data.corpus import TokenCorpus
from distrain.data.sampler import Batch
from distrain.data.token_format import SPLITS, DataError, SplitIndex, has_index, is_nanogpt, read_index


class ShardedTokens:
    """One split's token stream: its shard files, opened read-only on first use in the process that reads them (a
    forked or spawned worker opens its own), read window by window with positioned reads.

    Not ``np.memmap``: a mapped page stays in the reader's resident set once touched, and with the page cache's
    large folios one window maps megabytes; over a long run a rank's resident memory grew to the dataset's size
    (measured: 1.4 GB on a 1.4 GB dataset). ``os.pread`` copies only the window into the process.
    """

    def __init__(self, directory: Path, index: SplitIndex, vocab_limit: int | None = None) -> None:
        self.directory, self.index = Path(directory), index
        # Ids at or above this are refused as windows are read: the index's vocabulary, or the model's if smaller.
        model_limit = vocab_limit if isinstance(vocab_limit, int) and vocab_limit > 0 else index.vocab_size
        self.vocab_limit = min(index.vocab_size, model_limit)
        self.itemsize = index.numpy_dtype.itemsize
        self._files: list[int] | None = None

    def __len__(self) -> int:
        return self.index.tokens

    def longest_run(self) -> int:
        """Tokens in the largest shard: no window is longer (windows never cross a shard)."""
        return max(shard.tokens for shard in self.index.shards)

    def read(self, shard: int, start: int, count: int) -> np.ndarray:
        """``count`` ids of shard ``shard`` from id ``start`` on, as a new array of the index's dtype."""
        if self._files is None:
            files: list[int] = []
            try:
                for entry in self.index.shards:
                    files.append(os.open(self.directory / entry.file, os.O_RDONLY))
            except OSError:
                for descriptor in files:
                    os.close(descriptor)
                raise
            self._files = files
        data = os.pread(self._files[shard], count * self.itemsize, start * self.itemsize)
        if len(data) != count * self.itemsize:
            raise DataError(str(self.directory / self.index.shards[shard].file), "shorter than its index says")
        return np.frombuffer(data, dtype=self.index.numpy_dtype)

    def windows(self, seq_len: int) -> ShardedWindows:
        """Its windows of ``seq_len + 1`` tokens (``distrain.data.sampler.token_windows`` asks for them)."""
        return ShardedWindows(self, seq_len)

    def __getstate__(self) -> dict:
        return {**vars(self), "_files": None}  # file descriptors do not cross processes: reopened on first read

    def __del__(self) -> None:
        for descriptor in self._files or ():
            os.close(descriptor)


class ShardedWindows:
    """Windows of ``seq_len + 1`` tokens over the shards of a split (none crosses a shard boundary)."""

    def __init__(self, tokens: ShardedTokens, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        counts = [max(0, (shard.tokens - 1) // seq_len) for shard in tokens.index.shards]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # first window of each shard

    def __len__(self) -> int:
        return int(self.starts[-1])

    def batch(self, indices: torch.Tensor) -> Batch:
        """The windows ``indices`` as a Batch of int64 (batch, seq_len) inputs and targets, read from the shards."""
        shard_of = np.searchsorted(self.starts, indices.numpy(), side="right") - 1
        rows = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, (window, shard) in enumerate(zip(indices.tolist(), shard_of.tolist(), strict=True)):
            offset = (window - int(self.starts[shard])) * self.seq_len
            rows[row] = self.tokens.read(shard, offset, self.seq_len + 1)
        if rows.size and rows.max() >= self.tokens.vocab_limit:  # an index that understates its ids
            self._refuse(rows, shard_of)
        windows = torch.from_numpy(rows)
        return Batch(inputs=windows[:, :-1], targets=windows[:, 1:])

    def _refuse(self, rows: np.ndarray, shard_of: np.ndarray) -> None:
        """A window holds an id the model has no embedding for: a DataError (a ``RunError``: one line, every rank
        stopped) naming the shard, raised before the id reaches an embedding lookup (an IndexError in a step)."""
        row = int(rows.max(axis=1).argmax())
        shard = self.tokens.index.shards[int(shard_of[row])].file
        raise DataError(
            str(self.tokens.directory / shard),
            f"holds token id {int(rows[row].max())}, not below {self.tokens.vocab_limit} (the vocabulary of the model "
            f"and of {self.tokens.index.split}.json, whose max_token_id {self.tokens.index.max_token_id} is wrong): "
            "prepare the dataset again",
        )


def dataset_directory(path: str | Path) -> Path:
    """``data.path`` as a dataset directory: prepared (two indexes) or nanoGPT (train.bin and val.bin); DataError
    naming ``data.path`` otherwise."""
    directory = Path(str(path)).expanduser()
    if not directory.is_dir():
        problem = "is a file, not a dataset directory" if directory.exists() else "no such directory"
        raise DataError(str(directory), problem)
    if has_index(directory) or is_nanogpt(directory):
        return directory
    found = sorted(p.name for p in directory.iterdir())[:3]
    raise DataError(
        str(directory),
        "not a prepared dataset (train.json and val.json from python -m distrain.data.prepare) nor a nanoGPT one "
        f"(train.bin and val.bin); it holds {found or 'nothing'}",
    )


def token_corpus(path: str, vocab_limit: int | None = None) -> TokenCorpus:
    """The dataset at ``path`` as a corpus whose splits are ``ShardedTokens`` (no token is read here); a window
    holding an id at or above ``vocab_limit`` (the model's vocabulary) or the index's ``vocab_size`` is refused."""
    directory = dataset_directory(path)
    train, val = (read_index(directory, split) for split in SPLITS)
    return TokenCorpus(
        name=f"tokens:{directory.name}",
        train=ShardedTokens(directory, train, vocab_limit),
        val=ShardedTokens(directory, val, vocab_limit),
        vocab_size=max(train.vocab_size, val.vocab_size),
        eos_id=train.eos_id,
    )


@lru_cache(maxsize=8)
def _vocab_size(directory: str, stamp: float) -> int:
    del stamp  # part of the cache key: a re-prepared dataset is read again
    return max(read_index(Path(directory), split).vocab_size for split in SPLITS)


def data_vocab_size(path: str | None) -> int | None:
    """The vocabulary of the dataset at ``path`` (the ``${data_vocab:...}`` resolver behind ``data=tokens``'s
    ``model.vocab_size``); None when ``path`` is not a readable dataset, which data validation then reports."""
    try:
        directory = dataset_directory(path)
        return _vocab_size(str(directory.resolve()), directory.stat().st_mtime)
    except (DataError, OSError, TypeError):
        return None


def dataset_path(data: Any) -> str | None:
    """The dataset a run's ids come from (its ``data`` config): ``data.path``, or a mixture's first source (the
    sources share one tokenizer: ``data=mix`` checks it). None for the built-in corpora."""
    if data.get("path"):
        return str(data.path)
    sources = data.get("sources")
    return str(next(iter(sources.values()))["path"]) if sources else None


def tokenizer_path(path: str | Path) -> Path | None:
    """The tokenizer file the dataset at ``path`` was made with (its train index names it), if any."""
    directory = dataset_directory(path)
    name = read_index(directory, "train").tokenizer
    return directory / name if name else None


def largest_token_id(path: str) -> int:
    """The largest id in either split of the dataset at ``path`` (from the indexes; scanned for nanoGPT bins)."""
    directory = dataset_directory(path)
    return max(read_index(directory, split).max_token_id for split in SPLITS)
