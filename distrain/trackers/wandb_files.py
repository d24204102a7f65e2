"""Read a W&B run's own data file (``run-<id>.wandb``) without the W&B service: for offline runs that were never
synced, for tests, and for the analysis notebooks.

The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks (CRC32, length, type) that join into
protobuf ``Record`` messages (W&B's ``wandb_internal.proto``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_FILE_HEADER = 7
_BLOCK = 32 * 1024
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes) -> list[bytes]:
    records, pending, pos = [], b"", _FILE_HEADER
    while pos + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if kind == 0:  # zero padding to the end of the block
            pos += left_in_block
            continue
        pending += data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind in (_FULL, _LAST):
            records.append(pending)
            pending = b""
    return records


def _value(text: str) -> Any:
    return json.loads(text)


def read_wandb_run(run_dir: Path) -> dict[str, Any]:
    """The run id, name, group, tags, config, history rows and summary of one ``wandb/*run-*`` directory."""
    from wandb.proto import wandb_internal_pb2

    (path,) = sorted(Path(run_dir).glob("run-*.wandb"))
    run: dict[str, Any] = {"config": {}, "history": [], "summary": {}}
    for raw in _records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info = record.run
            run |= {"id": info.run_id, "name": info.display_name, "group": info.run_group, "tags": list(info.tags)}
            run["config"] |= {item.key: _value(item.value_json) for item in info.config.update if item.key}
        elif kind == "config":
            run["config"] |= {item.key: _value(item.value_json) for item in record.config.update if item.key}
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): _value(item.value_json) for item in record.history.item}
            run["history"].append(row)
        elif kind == "summary":
            run["summary"] |= {item.key: _value(item.value_json) for item in record.summary.update if item.key}
    return run
