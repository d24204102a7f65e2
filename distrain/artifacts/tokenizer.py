"""Inspector of a tokenizer: a Hugging Face ``tokenizers`` file (``tokenizer.json``) or a model directory holding one,
or nanoGPT's character-level ``meta.pkl`` (``distrain.artifacts.char_vocab``).

What it establishes: the path exists, a directory holds ``tokenizer.json``, the file is one the ``tokenizers``
library reads, and how many ids it can produce (its vocabulary with added tokens), so a caller can compare that
with a model's or a dataset's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrain.artifacts.char_vocab import inspect_char_vocab, is_char_vocab
from distrain.errors import ArtifactError, first_line

FILE = "tokenizer.json"


@dataclass(frozen=True)
class TokenizerFile:
    """A readable tokenizer: its file, the loaded ``tokenizers.Tokenizer`` (a ``CharVocab`` for a ``meta.pkl``)
    and the ids it can produce."""

    file: Path
    tokenizer: Any
    vocab_size: int


def tokenizer_file(path: str | Path) -> Path:
    """``path`` itself, or the ``tokenizer.json`` of the directory ``path``; ``ArtifactError`` when there is none."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ArtifactError(str(path), "no such tokenizer file or model directory")
    if path.is_dir():
        if not (path / FILE).is_file():
            raise ArtifactError(str(path), f"a directory without {FILE} (a fast tokenizer's file is needed)")
        return path / FILE
    return path


def inspect_tokenizer(path: str | Path, *, max_vocab: int | None = None, used_by: str = "") -> TokenizerFile:
    """The tokenizer at ``path`` (file or directory); with ``max_vocab``, one that produces no id at or above it
    (``used_by`` names what has that vocabulary, for the refusal)."""
    if is_char_vocab(path):
        tokenizer: Any = inspect_char_vocab(path)
        file, vocab_size = tokenizer.file, tokenizer.vocab_size
    else:
        file = tokenizer_file(path)
        tokenizer = _read_tokenizer_json(file)
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if max_vocab is not None and vocab_size > max_vocab:
        raise ArtifactError(
            str(file),
            f"produces ids up to {vocab_size - 1}, more than {used_by or 'the model'} has (vocabulary {max_vocab})",
        )
    return TokenizerFile(file, tokenizer, vocab_size)


def _read_tokenizer_json(file: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises its own exception types for unreadable files
        raise ArtifactError(str(file), f"an unreadable tokenizer ({first_line(err, 200)})") from None
