"""One rank's side of ``ft=torchft``: its replica group's torchft Manager, which averages gradients across groups,
decides each step's commit with the quorum, and heals a restarted group from a live peer.

Where tensors live: gradients are flattened into one CPU (or device) buffer per step and all-reduced over torchft's
process group, which joins rank r of every group in the quorum (rank r of each group holds the same data-parallel
position inside its group). A healing group receives the peer's model, optimizer, scheduler and loop state over
torchft's HTTP transport, in memory: no checkpoint is read.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from distrain.comm.traffic import all_reduce_bytes
from distrain.ft.checks import check_replica_groups
from distrain.trainer.preemption import StopRequest

log = logging.getLogger("distrain.train")

# Set by the launcher (distrain.ft.launch) in each group's supervisor, inherited by that group's ranks.
REPLICA_GROUP_ENV = "DISTRAIN_REPLICA_GROUP"
START_STORE_ENV = "DISTRAIN_REPLICA_START"  # host:port of the launcher's store where the groups meet at the start
HEALING_KEY = "distrain"


def replica_group() -> int | None:
    """This process's replica group under ``ft=torchft`` (None outside one)."""
    value = os.environ.get(REPLICA_GROUP_ENV)
    return int(value) if value is not None else None


class ReplicaGroups:
    """The ``ft=torchft`` option: settings from the config, the Manager once ``connect`` runs on a rank."""

    check_config = staticmethod(check_replica_groups)

    def __init__(
        self,
        *,
        name: str = "torchft",
        replica_groups: int,
        min_replicas: int,
        lighthouse: str | None,
        max_restarts: int,
        timeout_s: float,
        quorum_timeout_s: float,
        join_timeout_ms: int,
        heartbeat_timeout_ms: int,
        quorum_tick_ms: int,
    ) -> None:
        self.name, self.count, self.min_replicas, self.lighthouse = name, replica_groups, min_replicas, lighthouse
        self.max_restarts, self.timeout_s, self.quorum_timeout_s = max_restarts, timeout_s, quorum_timeout_s
        self.join_timeout_ms, self.heartbeat_timeout_ms = join_timeout_ms, heartbeat_timeout_ms
        self.quorum_tick_ms = quorum_tick_ms
        self.group = replica_group() or 0
        self.manager: Any = None
        self._quorum_started = False
        self.healed_at: int | None = None  # the step this group took from a peer when it (re)joined
        self.stop: AgreedStop | None = None  # what the group's step-end agreement reads (``agreed_stop``)
        self.bytes_sent = 0  # by this rank in the last cross-group all-reduce (ring over the quorum's groups)
        self.last_failure: str | None = None  # why the last step was not committed, as torchft reported it

    def data_parallel(self, inside: tuple[int, int]) -> tuple[int, int]:
        """This rank's (position, size) on the job's data-parallel axis: the groups are its outer part, so group g's
        ranks read the shards a plain data-parallel job's ranks g*size..(g+1)*size-1 would read."""
        rank, size = inside
        return self.group * size + rank, self.count * size

    def connect(self, save: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        """Create this rank's Manager (rank 0 of the group also starts the group's manager server, which talks to
        the lighthouse). ``save``/``load`` give and take the state a healing peer copies."""
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        # torchft logs each quorum and commit, and a peer's death as a traceback: the step's warning names it in one
        # line instead (``last_failure``). A healed state arrives in read-only buffers, which torch warns about.
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        timeout = timedelta(seconds=self.timeout_s)
        self._store = self._attempt_store(timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # a healed group must hold the peer's state before its forward pass
            timeout=timeout,
            quorum_timeout=timedelta(seconds=self.quorum_timeout_s),
            connect_timeout=timeout,
            replica_id=f"distrain_group{self.group}",
            lighthouse_addr=self.lighthouse,
            init_sync=False,  # every group seeds the same initial weights
            store_addr=self._store.host,
            store_port=self._store.port,
        )
        self.manager.register_state_dict_fn(HEALING_KEY, load, save)

    def _attempt_store(self, timeout: timedelta) -> Any:
        """A store of this attempt's own, served by the group's rank 0 (its address broadcast over the group):
        torchft's Manager publishes its server's address in the store it is given, and the launcher's store
        outlives a restart of the group, where a rank would read the dead attempt's address.
        Collective: one broadcast_object_list on the group's default process group."""
        import torch.distributed as dist
        from torch.distributed import TCPStore

        self.group_rank = dist.get_rank()
        store = None
        if self.group_rank == 0:
            store = TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), 0, is_master=True, wait_for_workers=False)
        address = [(store.host, store.port) if store is not None else None]
        dist.broadcast_object_list(address, src=0)
        if store is None:
            store = TCPStore(address[0][0], address[0][1], is_master=False, timeout=timeout)
        return store

    def join(self) -> None:
        """The first quorum, before the run's reporting starts: a group that (re)starts while others train takes
        their state here (step, data position, model, optimizer). The first step then uses this quorum."""
        # torchft heals a group only when its step is below the others'. Steps count commits, which under DiLoCo
        # happen only at outer steps: a restarted attempt could match the live groups' count (killed before their
        # first commit, or resumed from a checkpoint of their last one) and train on from its own state. So the live
        # groups count from 1 and a restarted attempt joins at 0: it always takes a live group's state.
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:  # the group's agent did not restart it
            self._meet_the_other_groups()
            if self.manager.current_step() == 0:
                self.manager.load_state_dict({"step": 1, "batches_committed": 0})
        else:
            self.manager.load_state_dict({"step": 0, "batches_committed": 0})
        before = self.manager.current_step()
        self.manager.start_quorum()
        self._quorum_started = True
        if self.manager.current_step() != before:
            self.healed_at = self.manager.current_step()

    def _meet_the_other_groups(self) -> None:
        """At the job's start, wait until every group has its Manager (its rank 0 heartbeats to the lighthouse), so
        the first quorum holds them all. A restarted group skips this: the others are training."""
        address = os.environ.get(START_STORE_ENV)
        if not address or self.group_rank != 0:
            return
        from torch.distributed import TCPStore

        host, port = address.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=self.quorum_timeout_s))
        store.add("groups_connected", 1)
        deadline = time.monotonic() + self.quorum_timeout_s
        while int(store.add("groups_connected", 0)) < self.count and time.monotonic() < deadline:
            time.sleep(0.05)

    def begin_step(self, step: int) -> None:
        """Start step ``step``'s quorum (blocking) when one is due: it may reconfigure the cross-group process group
        after a group left or joined, and heal this group when it is behind. Every step has one, unless the comm
        option syncs the groups itself at steps of its own (``quorum_due``: DiLoCo's outer steps)."""
        if self._quorum_started:
            self._quorum_started = False
            return
        if self.quorum_due(step):
            self.manager.start_quorum()

    @staticmethod
    def quorum_due(step: int) -> bool:
        """Whether optimizer step ``step`` runs a quorum (replaced by a comm option that syncs the groups itself)."""
        del step
        return True

    def average(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Average ``tensors`` in place across the groups of this step's quorum (one all-reduce of one flat buffer),
        then ask the quorum whether the step commits. False: a group failed during the step (the tensors may be
        partial); the caller drops the step and runs it again."""
        # One more entry carries whether a stop signal had reached this rank: the groups' step-end agreements read
        # only what this all-reduce carried (``AgreedStop``), so every group stops after the same step, as the
        # ranks of one job do; a signal that arrives later rides in the next step's all-reduce.
        signal_name = self._signal_name()
        flag = torch.full((1,), float(signal_name is not None), dtype=tensors[0].dtype, device=tensors[0].device)
        flat = _flatten_dense_tensors([*tensors, flag])
        self.manager.allreduce(flat).wait()
        self.bytes_sent = all_reduce_bytes(flat.numel() * flat.element_size(), self.participants())
        committed = self._decide(flat[-1], signal_name)
        if committed:
            for tensor, averaged in zip(tensors, _unflatten_dense_tensors(flat, list(tensors)), strict=False):
                tensor.copy_(averaged)
        return committed

    def average_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """Average ``flat`` in place across the groups of the current quorum and return it (one all-reduce over
        torchft's process group); for a comm option that syncs the groups itself. Its values count only once
        ``commit`` says so: after a group failed they may be partial."""
        self.manager.allreduce(flat).wait()
        return flat

    def commit(self) -> bool:
        """End a sync made of ``average_flat`` calls: one more all-reduce carries the stop flag (as ``average``
        does), then the quorum's decision. False: a group failed during the sync; its averages are void."""
        signal_name = self._signal_name()
        flag = torch.full((1,), float(signal_name is not None))
        self.manager.allreduce(flag).wait()
        return self._decide(flag[0], signal_name)

    def _signal_name(self) -> str | None:
        return self.stop.request.signal_name if self.stop is not None else None

    def _decide(self, flag: torch.Tensor, signal_name: str | None) -> bool:
        """``should_commit``; when committed and some group's flag was set, the agreed stop takes it."""
        committed = self.manager.should_commit()
        error = self.manager.errored()
        self.last_failure = " ".join(str(error.original_exception).split())[:200] if error is not None else None
        if committed and flag > 0 and self.stop is not None:
            self.stop.signal_name = signal_name or "a signal to another replica group"
        return committed

    def agreed_stop(self, request: StopRequest) -> AgreedStop:
        """The stop record this rank's step-end agreement reads under replica groups (see ``average``)."""
        self.stop = AgreedStop(request)
        return self.stop

    def participants(self) -> int:
        """The replica groups in this step's quorum."""
        return self.manager.num_participants()

    def saves_checkpoints(self) -> bool:
        """One group writes the job's checkpoints: rank 0 of the current quorum (any group, after group 0 died). Read
        after the step's quorum (it would wait for it)."""
        return self.manager.participating_rank() == 0

    def state_dict(self) -> dict[str, int]:
        """The quorum's step and committed batches, saved in checkpoints."""
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Take the quorum's step and committed batches from a checkpoint."""
        self.manager.load_state_dict(state)

    def shutdown(self) -> None:
        """Stop the Manager's servers (the group's manager server, the healing transport)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None


class AgreedStop:
    """A stop signal as the replica groups agreed on it: ``signal_name`` is set once a committed step's cross-group
    all-reduce carried some rank's signal (``request`` records the signals this rank received)."""

    def __init__(self, request: StopRequest) -> None:
        self.request = request
        self.signal_name: str | None = None


def group_run_dir(run_dir: str) -> str:
    """Where this rank's group writes its log and metrics: the run directory for group 0 (and without groups),
    ``replica_group_<g>/`` inside it for the others."""
    group = replica_group()
    if not group:
        return run_dir
    path = Path(run_dir) / f"replica_group_{group}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)
