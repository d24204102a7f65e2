"""Reading checkpoint files as data only: nothing in a checkpoint can run code when it is loaded.

Three kinds of file in a checkpoint are pickles: our ``rng_rank<r>.pt`` (``torch.save``), DCP's ``.metadata``
(plain ``pickle``) and DeepSpeed's ``*.pt`` (``torch.save``, which DeepSpeed itself would unpickle unrestricted).
A pickle can name any importable callable and call it while loading. Here every one of them is read by an
unpickler that accepts only tensors, plain Python values and an explicit list of data classes (DCP's metadata
records, three DeepSpeed records); anything else is refused with ``UnsafeCheckpointError`` before it is called.

``unsafe_content`` checks a whole checkpoint directory that way (tensor bytes are memory-mapped, not read), so a
checkpoint holding code is refused before any rank starts (``checkpoint.resume=<path>``) or skipped by
``resume=auto``, and the loaders below refuse it again at load time.
"""

from __future__ import annotations

import importlib
import io
import logging
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from distrain.errors import RunError

log = logging.getLogger(__name__)

# Classes DeepSpeed 0.19 pickles into its checkpoints: records of plain values, constructed without running code.
DEEPSPEED_DATA_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
# numpy arrays (RNG states of checkpoints written before they were stored as tensors): torch's documented set.
NUMPY_ARRAY_GLOBALS = (
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
)
# Every global DCP's ``.metadata`` pickle may name: its metadata records, shapes, layouts, paths (dtypes aside).
_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
}


class UnsafeCheckpointError(RunError):
    """A checkpoint file that holds Python objects other than data: loading it could run code."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(
            f"{path} holds Python objects that are not data ({detail}); refusing to load it: a checkpoint may "
            "hold only tensors and plain values"
        )


def _importable(name: str) -> type | None:
    module, attribute = name.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
        return None


def load_tensors_and_values(path: Path, **kwargs: Any) -> Any:
    """``torch.load`` that accepts only tensors, plain values and ``DEEPSPEED_DATA_CLASSES``; raises
    ``UnsafeCheckpointError`` otherwise. ``kwargs`` go to ``torch.load`` (``map_location``, ``mmap``)."""
    try:
        try:
            return torch.load(path, weights_only=True, **kwargs)
        except pickle.UnpicklingError as err:
            if "GLOBAL deepspeed." not in str(err) and "GLOBAL numpy." not in str(err):
                raise
        # Imported only for the files that name them (importing DeepSpeed is slow and prints).
        names = DEEPSPEED_DATA_CLASSES + NUMPY_ARRAY_GLOBALS
        with torch.serialization.safe_globals([cls for cls in map(_importable, names) if cls is not None]):
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL ([\w.]+)", str(err))
        detail = f"its pickle calls {named.group(1)}" if named else _weights_only_reason(str(err))
        raise UnsafeCheckpointError(path, detail) from None


def _weights_only_reason(message: str) -> str:
    """The line of torch's weights-only refusal that says what was refused (its message is a page long)."""
    reasons = [line.split("error:", 1)[-1].strip() for line in message.splitlines() if "Unpickler error" in line]
    return reasons[0] if reasons else message.splitlines()[0]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Exact (module, name) pairs only: pickle resolves a dotted name attribute by attribute, so "os.system"
        # under an allowed module would reach any callable.
        is_dtype = module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def load_dcp_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` file, read by an unpickler that constructs only DCP's own metadata records."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as err:
        raise UnsafeCheckpointError(path, str(err).splitlines()[0] if str(err) else type(err).__name__) from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(path, f"a {type(metadata).__name__}, not DCP metadata")
    return metadata


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with every saved non-tensor value (loop state, scheduler, scaler) first read with
    ``weights_only=True``: DCP itself unpickles those values unrestricted."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.getvalue()
        _load_data_bytes(data, read_item.dest_index.fqn)
        super().load_bytes(read_item, io.BytesIO(data))  # the same bytes, now known to name no callable


def _load_data_bytes(data: bytes, where: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL ([\w.]+)", str(err))
        raise UnsafeCheckpointError(where, f"its pickle calls {named.group(1)}" if named else "not data") from None


class DataOnlyReader(FileSystemReader):
    """DCP's file-system reader with the metadata read by ``load_dcp_metadata``; tensors are read by DCP itself
    (``weights_only=True``), other values through ``DataOnlyLoadPlanner``: pass both to ``dcp.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def unsafe_content(checkpoint: Path) -> str | None:
    """Why some pickle in ``checkpoint`` is not plain data (the first such file), or None when all are."""
    try:
        for file in sorted(checkpoint.rglob("*")):
            if file.name == ".metadata":
                _check_saved_values(file.parent, load_dcp_metadata(file))
            elif file.suffix == ".pt":
                load_tensors_and_values(file, map_location="cpu", mmap=True)
    except UnsafeCheckpointError as err:
        return str(err)
    return None


def _check_saved_values(directory: Path, metadata: Metadata) -> None:
    """Read every non-tensor value of a DCP checkpoint (stored as a pickle inside a ``.distcp`` file) as data."""
    values = {key for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, BytesStorageMetadata)}
    for index, stored in (metadata.storage_data or {}).items():
        if index.fqn in values:
            with (directory / stored.relative_path).open("rb") as file:
                file.seek(stored.offset)
                _load_data_bytes(file.read(stored.length), f"{directory / stored.relative_path} ({index.fqn})")


def saved_keys(path: Path) -> list[str]:
    """The flattened state keys of the DCP checkpoint at ``path`` (read from its metadata file)."""
    return list(load_dcp_metadata(path / ".metadata").state_dict_metadata)


def saved_optimizer_key(path: Path, wanted: str, rank: int, world_size: int) -> str:
    """Which optimizer state in the checkpoint at ``path`` this rank loads: its own key (``wanted``) when present,
    else the shared one (saved without per-rank optimizers), else rank 0's (saved with one state per rank, by fewer
    ranks or for a run that keeps one state). Rank 0 says so in one line when any rank falls back to rank 0's."""
    present = {key.split(".", 1)[0] for key in saved_keys(path)}
    per_rank = sum(1 for key in present if re.fullmatch(r"optimizer_rank\d+", key))
    if rank == 0 and per_rank and "optimizer" not in present:
        if wanted == "optimizer":
            log.warning("%s keeps one optimizer state per rank (comm=topk); every rank resumes from rank 0's", path)
        elif world_size > per_rank:
            log.warning(
                "%s has optimizer states for %d ranks; ranks %d-%d resume from rank 0's",
                path,
                per_rank,
                per_rank,
                world_size - 1,
            )
    for key in (wanted, "optimizer", "optimizer_rank0"):
        if key in present:
            return key
    return wanted  # nothing to choose from: the load names the missing keys


def holds_replica_state(path: Path) -> bool:
    """Whether the DCP checkpoint at ``path`` holds a replica-group quorum's state (written with ft=torchft)."""
    return (path / ".metadata").is_file() and any(key.startswith("extra.ft.") for key in saved_keys(path))
