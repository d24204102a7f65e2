"""Process-group setup for one rank: which device, which backend, which rank, and rank-aware logging."""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from distrain.launch.threads import use_intra_op_threads


@dataclass(frozen=True)
class DistEnv:
    """Where this rank sits: global and node-local rank and size, and the device its tensors live on."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device_type(device: str) -> str:
    """``auto`` is cuda when a GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(*, device: str, backend: str | None, timeout_s: float, threads_per_rank: int | None) -> DistEnv:
    """Join the process group described by the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Collective: ``init_process_group`` rendezvous of all ranks. On CUDA each rank takes GPU ``LOCAL_RANK``.
    On CPU the machine's cores are split between the node's ranks so they do not oversubscribe; only the training
    thread runs parallel loops (``use_intra_op_threads``: gloo's worker threads stay serial).
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device_type = resolve_device_type(device)
    backend = backend or default_backend(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        torch_device = torch.device("cpu")
        use_intra_op_threads(threads_per_rank or max(1, (os.cpu_count() or 1) // local_world_size))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=torch_device if device_type == "cuda" else None,
            store=_attempt_store(world_size, timeout),
        )
    return DistEnv(rank, world_size, local_rank, local_world_size, torch_device, backend)


def _attempt_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under the elastic agent, its TCPStore with keys private to this restart attempt; else None (env://).

    The agent keeps one store across restarts, so without a per-attempt prefix a restarted rank can read the
    address a dead rank of the previous attempt published and wait on it until gloo's connect times out.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"distrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown_distributed(graceful: bool = True) -> None:
    """Leave the process group; ``graceful`` (after success) first runs a barrier, a collective.

    After a failure there is no barrier: a peer may be blocked in another collective, and a barrier would
    pair with it and hang both.

    Drop every model wrapper (DDP's reducer holds the group) before calling this. The barrier lets gloo's
    worker threads finish releasing earlier collectives' Python tensors: destroying the group while one still
    needs the GIL deadlocks the process at exit (seen with torch 2.13 after all_gather_object).
    """
    if not dist.is_initialized():
        return
    if graceful:
        gc.unfreeze()  # the run's objects were frozen for the loop (build_and_train): now they may be collected
        gc.collect()
        with contextlib.suppress(RuntimeError):
            dist.barrier()
    dist.destroy_process_group()


_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)


class PeerFailedError(RuntimeError):
    """Raised on healthy ranks after another rank reported a failure at a step boundary."""


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` only says that another rank went away (a consequence, not the root cause)."""
    if isinstance(err, (PeerFailedError, dist.DistNetworkError)):
        return True
    return any(marker in str(err) for marker in _PEER_FAILURE_MARKERS)


def is_collective_timeout(err: BaseException) -> bool:
    """Whether ``err`` is a collective that waited ``distributed.timeout_s`` for a peer that never came."""
    return "Timed out waiting" in str(err) or "collective operation timeout" in str(err)


def configure_logging(rank: int, log_file: Path | None = None, replica_group: int | None = None) -> None:
    """Rank 0 logs INFO; the others WARNING and above, prefixed with their rank so a failing rank is named.

    Rank 0 also appends to ``log_file`` (the run directory's log) when given. Under replica groups (ft=torchft) the
    prefix names the group too, and only group 0's INFO lines reach the console (every group's reach its own log).
    """
    root = logging.getLogger("distrain")
    root.handlers.clear()
    where = f"rank{rank}" if replica_group is None else f"group{replica_group} rank{rank}"
    formatter = logging.Formatter(f"[{where}] %(levelname)s %(name)s: %(message)s")
    console = logging.StreamHandler(sys.stderr)
    if replica_group:
        console.setLevel(logging.WARNING)
    handlers: list[logging.Handler] = [console]
    if log_file is not None and rank == 0:
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
