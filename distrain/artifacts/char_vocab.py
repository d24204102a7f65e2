"""Inspector of nanoGPT's character-level vocabulary: the ``meta.pkl`` its ``prepare.py`` writes beside
``train.bin``/``val.bin`` (``{"vocab_size": n, "itos": {id: char}, "stoi": {char: id}}``).

What it establishes: the file unpickles without running anything (a pickle naming any class or function is
refused, not called: only builtin values are read), ``itos`` maps the ids ``0..n-1`` to ``n`` distinct single
characters, ``stoi`` is its inverse, and ``vocab_size``, when present, is ``n``.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path

from distrain.errors import ArtifactError

FILE = "meta.pkl"


class _PlainData(pickle.Unpickler):
    """An unpickler of builtin containers and scalars only: a reference to anything importable is refused."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"it names {module}.{name} (only dicts of ids and characters are read)")


@dataclass(frozen=True)
class CharVocab:
    """Ids ``0..len(itos)-1`` and the character each stands for: encodes text and decodes ids one char each."""

    file: Path
    itos: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        """Each character's id; ValueError naming the first character the vocabulary does not have."""
        stoi = {char: index for index, char in enumerate(self.itos)}
        missing = next((char for char in text if char not in stoi), None)
        if missing is not None:
            raise ValueError(f"{self.file}: the character {missing!r} is not in this vocabulary of {len(stoi)}")
        return [stoi[char] for char in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[index] for index in ids)


def is_char_vocab(path: str | Path) -> bool:
    """Whether ``path`` names a ``meta.pkl`` (the file, or a directory holding one and no ``tokenizer.json``)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return (path / FILE).is_file() and not (path / "tokenizer.json").exists()
    return path.suffix == ".pkl"


def inspect_char_vocab(path: str | Path) -> CharVocab:
    """The vocabulary in the ``meta.pkl`` at ``path`` (or in the directory ``path``); ``ArtifactError`` naming the
    file and what is wrong with it."""
    path = Path(path).expanduser()
    file = path / FILE if path.is_dir() and path.name != FILE else path  # a directory named meta.pkl: unreadable
    try:
        meta = _PlainData(io.BytesIO(file.read_bytes())).load()
    except OSError as err:
        raise ArtifactError(str(file), f"unreadable ({err.strerror or err})") from None
    except Exception as err:  # a damaged pickle raises any of several types
        raise ArtifactError(str(file), f"not a nanoGPT meta.pkl: {err}") from None
    itos = meta.get("itos") if isinstance(meta, dict) else None
    if not isinstance(itos, dict) or not isinstance(meta.get("stoi"), dict):
        raise ArtifactError(str(file), "not a nanoGPT meta.pkl (a dict with itos and stoi: id <-> character)")
    size = len(itos)
    ids_ok = all(type(index) is int for index in itos) and sorted(itos) == list(range(size))
    chars_ok = all(isinstance(c, str) and len(c) == 1 for c in itos.values()) and len(set(itos.values())) == size
    if not (ids_ok and chars_ok):
        raise ArtifactError(
            str(file), f"its itos maps {size} entries, not the ids 0..{size - 1} to {size} distinct characters"
        )
    if meta["stoi"] != {char: index for index, char in itos.items()}:
        raise ArtifactError(str(file), "its stoi is not the inverse of its itos")
    if meta.get("vocab_size", size) != size:
        raise ArtifactError(str(file), f"vocab_size {meta['vocab_size']!r} is not the {size} characters it maps")
    return CharVocab(file, tuple(itos[index] for index in range(size)))
