"""Checkpoint files are read as data only: no pickle in a checkpoint can call anything while it is loaded."""

import io
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from distrain.checkpoint.checkpointer import rng_snapshot, rng_state, set_rng_state
from distrain.checkpoint.data_only import (
    DataOnlyLoadPlanner,
    DataOnlyReader,
    UnsafeCheckpointError,
    load_dcp_metadata,
    load_tensors_and_values,
    unsafe_content,
)


class RunsCode:
    """Unpickling this creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def short_unicode(text):
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def test_a_code_pickle_in_a_saved_value_of_a_dcp_checkpoint_is_refused(tmp_path):
    """DCP stores non-tensor values as pickles inside its .distcp files and would load them unrestricted."""
    marker = tmp_path / "code_ran"
    dcp.save(
        {"weight": torch.ones(3), "extra": {"bad": RunsCode(marker)}}, checkpoint_id=tmp_path / "ckpt", no_dist=True
    )
    problem = unsafe_content(tmp_path / "ckpt")
    assert problem is not None and "its pickle calls io.open" in problem and "extra.bad" in problem
    state = {"weight": torch.zeros(3), "extra": {"bad": None}}
    with pytest.raises(CheckpointException, match="its pickle calls io.open"):  # DCP wraps what a rank raised
        dcp.load(state, storage_reader=DataOnlyReader(tmp_path / "ckpt"), planner=DataOnlyLoadPlanner(), no_dist=True)
    assert not marker.exists()


def test_plain_values_of_a_dcp_checkpoint_load(tmp_path):
    dcp.save({"weight": torch.ones(3), "extra": {"step": 7, "name": "a"}}, checkpoint_id=tmp_path, no_dist=True)
    assert unsafe_content(tmp_path) is None
    state = {"weight": torch.zeros(3), "extra": {"step": 0, "name": ""}}
    dcp.load(state, storage_reader=DataOnlyReader(tmp_path), planner=DataOnlyLoadPlanner(), no_dist=True)
    assert state["extra"] == {"step": 7, "name": "a"} and state["weight"].sum() == 3


def test_dcp_metadata_naming_a_callable_through_an_allowed_module_is_refused(tmp_path):
    """Pickle resolves dotted names attribute by attribute: "os.getpid" under DCP's own module reaches os."""
    payload = b"\x80\x04" + short_unicode("torch.distributed.checkpoint.filesystem") + short_unicode("os.getpid")
    (tmp_path / ".metadata").write_bytes(payload + b"\x93)R.")  # STACK_GLOBAL, EMPTY_TUPLE, REDUCE, STOP
    with pytest.raises(UnsafeCheckpointError, match="os.getpid is not allowed"):
        load_dcp_metadata(tmp_path / ".metadata")


def test_rng_states_round_trip_as_tensors_and_old_numpy_ones_still_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(load_tensors_and_values(tmp_path / "rng.pt"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    # The format checkpoints had before: tuples holding a numpy array.
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        tmp_path / "old.pt",
    )
    expected = (random.random(), np.random.rand())
    set_rng_state(load_tensors_and_values(tmp_path / "old.pt"))
    assert (random.random(), np.random.rand()) == expected


def test_the_snapshot_a_failed_step_rolls_back_to_restores_every_generator():
    random.seed(4), np.random.seed(5), torch.manual_seed(6)
    snapshot = rng_snapshot()

    def draws() -> tuple:
        return random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(2).tolist()

    expected = draws()
    set_rng_state(snapshot)
    assert draws() == expected


def test_a_code_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "code_ran"
    buffer = io.BytesIO()
    torch.save({"torch": RunsCode(marker)}, buffer)
    (tmp_path / "rng_rank0.pt").write_bytes(buffer.getvalue())
    with pytest.raises(UnsafeCheckpointError, match="its pickle calls io.open"):
        load_tensors_and_values(tmp_path / "rng_rank0.pt")
    assert unsafe_content(tmp_path) is not None
    assert not marker.exists()
