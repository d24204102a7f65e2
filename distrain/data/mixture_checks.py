"""``data=mix``'s own checks, in the launching process before any rank starts: every source a readable prepared
dataset made with the same tokenizer, each split holding a window of ``data.seq_len`` tokens, weights that can be
normalised. One line naming ``data.sources.<name>.path`` (or ``.weight``) otherwise."""

from __future__ import annotations

import hashlib
from numbers import Real
from pathlib import Path

from omegaconf import DictConfig

from distrain.artifacts.token_dataset import PendingChecksums, TokenDataset, inspect_token_dataset
from distrain.config.checks import ConfigError
from distrain.data.token_format import DataError

SOURCE = "name -> {path: DATASET_DIR, weight: W}"


def check_mixture(cfg: DictConfig) -> PendingChecksums:
    """Refuse a mixture that cannot train; return its shards' checksums, checked on a thread meanwhile."""
    sources = cfg.data.sources
    if not sources:
        raise ConfigError("data.sources", "{}", f"at least one source: {SOURCE}")
    for name, source in sources.items():
        weight = source.weight
        if isinstance(weight, bool) or not isinstance(weight, Real) or weight < 0:
            raise ConfigError(f"data.sources.{name}.weight", weight, "a number >= 0")
    if not any(source.weight > 0 for source in sources.values()):
        raise ConfigError("data.sources", "every weight 0", "at least one source with a weight > 0")
    datasets = {name: _readable(name, source.path) for name, source in sources.items()}
    first = next(iter(datasets))
    for name, dataset in datasets.items():
        problem = _different_tokenizer(datasets[first], dataset)
        if problem:
            raise ConfigError(
                f"data.sources.{name}.path", sources[name].path, f"a dataset made with data.sources.{first}'s "
                f"tokenizer ({problem}): different vocabularies cannot be mixed"
            )  # fmt: skip
        _check_windows(name, sources[name].path, dataset, cfg.data.seq_len)
    verified = list(datasets.values()) if cfg.data.get("verify_checksums", True) else []
    return PendingChecksums(verified, key="data.sources", value="(their shards)")


def _readable(name: str, path: str) -> TokenDataset:
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
    for split, index in dataset.splits.items():
        longest = max(shard.tokens for shard in index.shards) - 1
        if longest < seq_len:
            raise ConfigError(
                f"data.sources.{name}.path", path, f"a dataset whose {split} split holds a window of data.seq_len="
                f"{seq_len} tokens (its longest shard holds {longest + 1}): every source trains and validates"
            )  # fmt: skip
