"""What the launchers of one ``ft=torchft`` job share: the lighthouse and a small store.

One machine has one launcher (``train.py`` itself). A SLURM job has one per node: each SLURM task starts its node's
ranks and runs whole replica groups on them. The first launcher serves the store, on the first node, at the port
submitit derives from the job id. Unless ``ft.lighthouse`` names an external lighthouse, it also runs the embedded
one and publishes its address there. The store is where:
- every group's rank 0 checks in before the first quorum (``START_STORE_ENV``);
- a launcher whose group finished the run says so, which starts the others' grace period;
- each launcher reports that it is done, so the first one keeps the lighthouse up until the last group has ended.
No tensor passes through it: the groups average through torchft's Manager.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from omegaconf import DictConfig

from distrain.launch.ranks import slurm_tasks

log = logging.getLogger("distrain.launch")


@dataclass(frozen=True)
class Launchers:
    """This launcher's place among the job's: ``index`` of ``count``; the first serves at ``host:port`` (port 0:
    any free port, when it is alone)."""

    index: int
    count: int
    host: str
    port: int

    @classmethod
    def of_this_job(cls) -> Launchers:
        """One per SLURM task (SLURM's task index, the first node's name and submitit's port for the job), else one."""
        tasks, _ = slurm_tasks()
        if tasks <= 1:
            return cls(index=0, count=1, host="127.0.0.1", port=0)
        from submitit.helpers import TorchDistributedEnvironment

        job = TorchDistributedEnvironment()
        return cls(index=job.rank, count=job.world_size, host=job.master_addr, port=job.master_port)


class JobCoordination:
    """The lighthouse (embedded unless ``ft.lighthouse`` is set) and the shared store, for one launcher's lifetime.

    Use as a context manager: the first launcher starts them on entry and, on exit, waits up to ``ft.timeout_s`` for
    every other launcher to be done before stopping them."""

    def __init__(self, launchers: Launchers, ft: DictConfig) -> None:
        self.launchers, self.ft = launchers, ft
        self.lighthouse_server: Any = None
        self.store: Any = None
        self.lighthouse: str = ft.lighthouse or ""

    def __enter__(self) -> JobCoordination:
        from torch.distributed import TCPStore

        first = self.launchers.index == 0
        timeout = timedelta(seconds=self.ft.quorum_timeout_s)
        self.store = TCPStore(
            self.launchers.host, self.launchers.port, is_master=first, timeout=timeout, wait_for_workers=False
        )
        if first and not self.lighthouse:
            from torchft.coordination import LighthouseServer

            self.lighthouse_server = LighthouseServer(
                bind="[::]:0",
                min_replicas=self.ft.min_replicas,
                join_timeout_ms=self.ft.join_timeout_ms,
                heartbeat_timeout_ms=self.ft.heartbeat_timeout_ms,
                quorum_tick_ms=self.ft.quorum_tick_ms,
            )
            self.lighthouse = self.lighthouse_server.address()
        if first:
            self.store.set("lighthouse", self.lighthouse)
        else:  # waits (up to ft.quorum_timeout_s) for the first launcher to publish it
            self.lighthouse = self.store.get("lighthouse").decode()
        return self

    @property
    def store_address(self) -> str:
        """host:port of the shared store, for the groups' ranks."""
        return f"{self.launchers.host}:{self.store.port}"

    def announce_finished(self) -> None:
        """One of this launcher's groups finished the run."""
        self._try(lambda: self.store.set("finished", "1"))

    def finished_elsewhere(self) -> bool:
        """Whether another launcher's group finished the run (or the first launcher is gone: nothing to join)."""
        if self.launchers.count == 1:
            return False
        answer = self._try(lambda: self.store.check(["finished"]))
        return answer is None or bool(answer)

    def __exit__(self, *exc: object) -> None:
        try:
            self._try(lambda: self.store.add("launchers_done", 1))
            if self.launchers.index == 0 and self.launchers.count > 1:
                deadline = time.monotonic() + self.ft.timeout_s
                while time.monotonic() < deadline and self._launchers_done() < self.launchers.count:
                    time.sleep(0.2)
        finally:
            if self.lighthouse_server is not None:
                self.lighthouse_server.shutdown()

    def _launchers_done(self) -> int:
        return self._try(lambda: self.store.add("launchers_done", 0)) or 0

    @staticmethod
    def _try(call: Any) -> Any:
        """``call()``, or None when the store's server (the first launcher) is gone."""
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - a store whose server exited raises a bare RuntimeError
            log.debug("replica groups' store: %s", err)
            return None


def groups_of(launchers: Launchers, replica_groups: int) -> range:
    """The replica groups this launcher runs: an equal, consecutive share of them (the first node's are 0, 1, ...)."""
    per_launcher = replica_groups // launchers.count
    return range(launchers.index * per_launcher, (launchers.index + 1) * per_launcher)
