"""Token corpora held in memory as 1-D uint8/int64 tensors, split deterministically into train and validation."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TokenCorpus:
    """A train and a validation token stream (CPU tensors) over ids ``0..vocab_size-1``."""

    name: str
    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int


def _split(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    # The tail is validation: contiguous, so no validation window overlaps a training one.
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def _bytes_to_tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def stdlib_source_files() -> list[Path]:
    """The ``.py`` files of this interpreter's standard library, in a fixed order, without installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        path
        for path in sorted(root.rglob("*.py"))
        if not {"site-packages", "dist-packages"} & set(path.relative_to(root).parts)
    ]


def stdlib_source_corpus(*, max_bytes: int, val_fraction: float) -> TokenCorpus:
    """Byte-level corpus (vocabulary 256) of the standard library's source, read in sorted file order.

    Args:
        max_bytes: stop after this many bytes (files are taken whole until the budget is reached).
        val_fraction: about this share of the files (every ``round(1/val_fraction)``-th) is kept for validation.
    """
    # Every k-th file goes to validation, so both splits sample the whole library rather than the last package.
    every = max(2, round(1 / val_fraction))
    train_chunks, val_chunks, total = [], [], 0
    for index, path in enumerate(stdlib_source_files()):
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        (val_chunks if index % every == every - 1 else train_chunks).append(data)
        total += len(data)
    return TokenCorpus(
        name="stdlib_source",
        train=_bytes_to_tokens(b"".join(train_chunks)),
        val=_bytes_to_tokens(b"".join(val_chunks)),
        vocab_size=256,
    )


def synthetic_corpus(*, num_tokens: int, vocab_size: int, seed: int, val_fraction: float) -> TokenCorpus:
    """Uniform random tokens from a seeded generator: identical on every rank, nothing read from disk."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num_tokens,), generator=generator)
    train, val = _split(tokens, val_fraction)
    return TokenCorpus(name="synthetic", train=train, val=val, vocab_size=vocab_size)
