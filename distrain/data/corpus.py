"""Token corpora held in memory as 1-D uint8/int64 tensors, split deterministically into train and validation."""

from __future__ import annotations

import os
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
    eos_id: int | None = None  # the id ending each document (None: the stream has no documents)


def _split(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    # The tail is validation: contiguous, so no validation window overlaps a training one.
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def _bytes_to_tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def stdlib_source_files() -> list[Path]:
    """The ``.py`` files of this interpreter's standard library, in a fixed order, without installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    installed = {"site-packages", "dist-packages"}
    found = []
    # Pruned while walking: installed packages under the standard library (torch's among them) are most of the
    # tree, and walking them took about a second of every run's start-up, in the launcher and in every rank.
    for directory, subdirectories, files in os.walk(root, followlinks=True):
        subdirectories[:] = [name for name in subdirectories if name not in installed]
        found += [Path(directory, name) for name in files if name.endswith(".py")]
    return sorted(found)


class CorpusTooSmall(ValueError):
    """A corpus setting that leaves a split empty: ``key`` (under ``data.corpus``), its ``value``, what is allowed."""

    def __init__(self, key: str, value: int, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"data.corpus.{key}={value}: {allowed}")


def stdlib_source_corpus(*, max_bytes: int, val_fraction: float, block_bytes: int = 16384) -> TokenCorpus:
    """Byte-level corpus (vocabulary 256) of the standard library's source, read in sorted file order.

    Args:
        max_bytes: read the first ``max_bytes`` bytes of the concatenated files.
        val_fraction: every ``round(1 / val_fraction)``-th block of ``block_bytes`` goes to validation, so both
            splits sample the same files rather than validation being the last package read.
        block_bytes: granularity of the split.
    """
    chunks, total = [], 0
    for path in stdlib_source_files():
        if total >= max_bytes:
            break
        chunks.append(path.read_bytes()[: max_bytes - total])
        total += len(chunks[-1])
    tokens = _bytes_to_tokens(b"".join(chunks))
    blocks = torch.split(tokens, block_bytes)
    every = max(2, round(1 / val_fraction))
    is_val = [i % every == every // 2 for i in range(len(blocks))]
    if not any(is_val):
        raise CorpusTooSmall(
            "max_bytes",
            max_bytes,
            f"at least {(every // 2 + 1) * block_bytes} bytes, so that the validation split "
            f"(every {every}-th block of {block_bytes} bytes) holds one block",
        )
    return TokenCorpus(
        name="stdlib_source",
        train=torch.cat([b for b, v in zip(blocks, is_val, strict=True) if not v]),
        val=torch.cat([b for b, v in zip(blocks, is_val, strict=True) if v]),
        vocab_size=256,
    )


def synthetic_corpus(*, num_tokens: int, vocab_size: int, seed: int, val_fraction: float) -> TokenCorpus:
    """Uniform random tokens from a seeded generator: identical on every rank, nothing read from disk."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num_tokens,), generator=generator)
    train, val = _split(tokens, val_fraction)
    return TokenCorpus(name="synthetic", train=train, val=val, vocab_size=vocab_size)
