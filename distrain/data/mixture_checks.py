"""``data=mix``'s own checks, in the launching process before any rank starts: every source a readable prepared
dataset made with the same tokenizer, each split holding a window of ``data.seq_len`` tokens, weights that can be
normalised. One line naming ``data.sources.<name>.path`` (or ``.weight``) otherwise."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from numbers import Real
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from distrain.artifacts.token_dataset import PendingChecksums, TokenDataset, inspect_token_dataset
from distrain.config.checks import ConfigError
from distrain.data.mixture import SOURCE_KEYS, source_settings
from distrain.data.token_format import DataError

SOURCE = "name -> {path: DATASET_DIR, weight: W}"


def check_mixture(cfg: DictConfig) -> PendingChecksums:
    """Refuse a mixture that cannot train; return its shards' checksums, checked on a thread meanwhile."""
    sources = cfg.data.sources
    if not sources or not isinstance(sources, Mapping):
        raise ConfigError("data.sources", sources if sources is not None else "null", f"at least one source: {SOURCE}")
    for name, source in sources.items():
        unknown = sorted(set(source) - set(SOURCE_KEYS)) if isinstance(source, Mapping) else None
        if unknown is None or unknown:
            what = f"no {', '.join(unknown)}: " if unknown else ""
            raise ConfigError(
                f"data.sources.{name}", source, f"a mapping of {' and '.join(SOURCE_KEYS)} ({what}{SOURCE})"
            )
    settings = source_settings(sources)
    for name, (_, weight) in settings.items():
        if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"data.sources.{name}.weight", weight, "a finite number >= 0")
    total = sum(float(weight) for _, weight in settings.values())
    if not total > 0:
        raise ConfigError("data.sources", "every weight 0", "at least one source with a weight > 0")
    if not math.isfinite(total):
        raise ConfigError("data.sources", "weights summing past 1e308", "weights whose sum is a finite number")
    datasets = {name: _readable(name, path) for name, (path, _) in settings.items()}
    first = next(iter(datasets))
    for name, dataset in datasets.items():
        problem = _different_tokenizer(datasets[first], dataset)
        if problem:
            raise ConfigError(
                f"data.sources.{name}.path", settings[name][0], f"a dataset made with data.sources.{first}'s "
                f"tokenizer ({problem}): ids of different tokenizers cannot be mixed"
            )  # fmt: skip
        if cfg.data.seq_len <= cfg.model.get("max_seq_len", cfg.data.seq_len):  # else the model's check says so
            _check_windows(name, settings[name][0], dataset, cfg.data.seq_len)
    verified = [(dataset, f"data.sources.{name}.path", settings[name][0]) for name, dataset in datasets.items()]
    return PendingChecksums(verified if cfg.data.verify_checksums else [])


def _readable(name: str, path: Any) -> TokenDataset:
    if not path:
        raise ConfigError(f"data.sources.{name}.path", path, "a prepared dataset directory")
    try:
        return inspect_token_dataset(path, checksums=False)
    except DataError as err:
        raise ConfigError(f"data.sources.{name}.path", path, f"a readable prepared dataset: {err}") from None


def _different_tokenizer(reference: TokenDataset, dataset: TokenDataset) -> str | None:
    """Why ``dataset``'s ids do not mean what ``reference``'s do, or None: the tokenizer files differ (by content),
    one has a tokenizer and the other none, or (without tokenizers, as nanoGPT bins) the vocabularies differ."""
    if (reference.tokenizer is None) != (dataset.tokenizer is None):
        return "one was made with a tokenizer file, the other without"
    if reference.tokenizer is not None and _digest(reference.tokenizer) != _digest(dataset.tokenizer):
        return f"{dataset.tokenizer.name} differs from {reference.tokenizer}"
    if reference.vocab_size != dataset.vocab_size:
        return f"a vocabulary of {dataset.vocab_size}, not {reference.vocab_size}"
    return None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_windows(name: str, path: str, dataset: TokenDataset, seq_len: int) -> None:
    """Each split holds at least one window of ``seq_len + 1`` tokens (windows never cross a shard)."""
    for split, index in dataset.splits.items():  # train, val
        longest = max(shard.tokens for shard in index.shards) - 1
        if longest < seq_len:
            raise ConfigError(
                f"data.sources.{name}.path", path, f"a dataset whose {split} split holds a window of data.seq_len + 1"
                f" = {seq_len + 1} tokens (its longest shard holds {longest + 1}): every source trains and validates"
            )  # fmt: skip
