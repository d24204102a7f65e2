"""Inspector of a set of safetensors weight files: one ``.safetensors`` file, or a directory of them (the shards
``save_pretrained`` writes, named by ``model.safetensors.index.json``).

Only the headers are read (8 bytes of length, then a JSON table of each tensor's dtype, shape and byte range), so a
set of many gigabytes is inspected in milliseconds. What it establishes: every file the index names exists, every
file is a whole safetensors file (its header parses, each tensor's byte range matches its dtype and shape, and the
data ends exactly where the file does: a truncated copy is caught), no tensor is stored twice, and the index's
tensor names are the ones the files hold.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from distrain.errors import ArtifactError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "C64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip


@dataclass(frozen=True)
class SafetensorsSet:
    """What a set of safetensors files holds, from their headers: tensor name -> shape and dtype, and the files."""

    files: tuple[Path, ...]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    @property
    def bytes(self) -> int:
        return sum(math.prod(shape) * DTYPE_BYTES.get(self.dtypes[name], 0) for name, shape in self.shapes.items())


def inspect_safetensors(path: str | Path) -> SafetensorsSet:
    """The safetensors set at ``path`` (a file, or a directory's ``*.safetensors`` through its index when it has
    one); ``ArtifactError`` naming the file and what is wrong with it otherwise."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ArtifactError(str(path), "no such file or directory")
    index = path / INDEX
    if path.is_file():
        files, named = [path], None
    elif index.is_file():
        files, named = _indexed_files(index)
    elif (path / SINGLE).is_file():  # what transformers loads without an index (a stray file beside it is not)
        files, named = [path / SINGLE], None
    else:
        files, named = sorted(path.glob("*.safetensors")), None
    if not files:
        raise ArtifactError(str(path), "no *.safetensors file in it (weights are read from safetensors only)")
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for file in files:
        for name, (dtype, shape) in read_header(file).items():
            if name in shapes:
                raise ArtifactError(str(file), f"tensor {name} is also in another file of the set")
            shapes[name], dtypes[name] = shape, dtype
    if named is not None:
        _check_index_names(index, named, shapes)
    return SafetensorsSet(tuple(files), shapes, dtypes)


def _indexed_files(index: Path) -> tuple[list[Path], dict[str, str]]:
    """The shard files ``index`` names (each must exist) and its tensor name -> file name map."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not an object of file names")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ArtifactError(str(index), f"an unreadable index ({type(err).__name__}: {err})") from None
    files = sorted({index.parent / name for name in weight_map.values()})
    missing = [file for file in files if not file.is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ArtifactError(str(missing[0]), f"missing: {index.name} names it{more}")
    return files, weight_map


def _check_index_names(index: Path, named: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> None:
    """The index names exactly the tensors its shards hold."""
    unlisted = sorted(shapes.keys() - named.keys())
    absent = sorted(named.keys() - shapes.keys())
    if absent:
        raise ArtifactError(str(index.parent / named[absent[0]]), f"lacks tensor {absent[0]}, which {INDEX} puts there")
    if unlisted:
        raise ArtifactError(str(index), f"does not name tensor {unlisted[0]}, which a shard holds")


def read_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor in the safetensors ``file``, read from its header only; the header's
    byte ranges are checked against the dtypes, the shapes and the file's size."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as stream:
            length = int.from_bytes(stream.read(8), "little")
            if size < 8 or length > min(size - 8, MAX_HEADER_BYTES):
                raise ValueError(f"{size} bytes, no safetensors header")
            header = json.loads(stream.read(length))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (OSError, ValueError) as err:
        raise ArtifactError(str(file), f"not a safetensors file ({err})") from None
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            begin, stop = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(str(file), f"a damaged header: tensor {name} has no dtype, shape and offsets") from None
        if dtype in DTYPE_BYTES and stop - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise ArtifactError(str(file), f"a damaged header: tensor {name} spans {stop - begin} bytes, not {shape}")
        tensors[name], end = (dtype, shape), max(end, stop)
    data = size - 8 - length
    if end != data:
        state = "truncated" if end > data else f"{data - end} bytes longer than its tensors"
        raise ArtifactError(str(file), f"{state}: its header describes {8 + length + end} bytes, the file has {size}")
    return tensors
