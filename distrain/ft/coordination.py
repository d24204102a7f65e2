"""What the launchers of one ``ft=torchft`` job share: the lighthouse and a small store.

One machine has one launcher (``train.py`` itself). A SLURM job has one per node: each SLURM task starts its node's
ranks and runs whole replica groups on them. The first launcher serves the store, on the first node, at the port
submitit derives from the job id. Unless ``ft.lighthouse`` names an external lighthouse, it also runs the embedded
one and publishes its address there. The store is where:
- every group's rank 0 checks in before the first quorum (``START_STORE_ENV``);
- a launcher whose group finished the run says so, which starts the others' grace period (``ft.timeout_s``);
- each launcher reports that it is done, so the first one keeps the lighthouse up until the last group has ended
  (at most ``ft.timeout_s`` after the run finished).
No tensor passes through it: the groups average through torchft's Manager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from omegaconf import DictConfig

from distrain.errors import RunError
from distrain.launch.ranks import slurm_step

log = logging.getLogger("distrain.launch")
T = TypeVar("T")


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
        tasks, _ = slurm_step()
        if tasks <= 1:
            return cls(index=0, count=1, host="127.0.0.1", port=0)
        from submitit.helpers import TorchDistributedEnvironment

        job = TorchDistributedEnvironment()
        return cls(index=job.rank, count=job.world_size, host=job.master_addr, port=job.master_port)


class JobCoordination:
    """The lighthouse (embedded unless ``ft.lighthouse`` is set) and the shared store, for one launcher's lifetime.

    Use as a context manager. On exit the first launcher keeps both up until every other launcher is done: without
    a deadline while no group has finished the run (the others may still be training), and for at most
    ``ft.timeout_s`` more once one has."""

    def __init__(self, launchers: Launchers, ft: DictConfig) -> None:
        self.launchers, self.ft = launchers, ft
        self.lighthouse_server: Any = None
        self.store: Any = None
        self.lighthouse: str = ft.lighthouse or ""

    def __enter__(self) -> JobCoordination:
        first = self.launchers.index == 0
        try:
            self.store = self._open_store(first)
            if first and not self.lighthouse:
                self._start_lighthouse()
            if first:
                self.store.set("lighthouse", self.lighthouse)
            else:  # waits (up to ft.quorum_timeout_s) for the first launcher to publish it
                self.lighthouse = self.store.get("lighthouse").decode()
        except Exception as err:
            if self.lighthouse_server is not None:
                self.lighthouse_server.shutdown()
            if first:
                raise
            raise RunError(
                f"the first node's task did not serve the replica groups' store at {self.launchers.host}:"
                f"{self.launchers.port} within ft.quorum_timeout_s={self.ft.quorum_timeout_s} s (it stopped before "
                f"starting its groups: its own log says why): {' '.join(str(err).split())[:160]}"
            ) from None
        return self

    def _open_store(self, first: bool) -> Any:
        from torch.distributed import TCPStore

        return TCPStore(
            self.launchers.host,
            self.launchers.port,
            is_master=first,
            timeout=timedelta(seconds=self.ft.quorum_timeout_s),
            wait_for_workers=False,
        )

    def _start_lighthouse(self) -> None:
        from torchft.coordination import LighthouseServer

        self.lighthouse_server = LighthouseServer(
            bind="[::]:0",
            min_replicas=self.ft.min_replicas,
            join_timeout_ms=self.ft.join_timeout_ms,
            heartbeat_timeout_ms=self.ft.heartbeat_timeout_ms,
            quorum_tick_ms=self.ft.quorum_tick_ms,
        )
        self.lighthouse = self.lighthouse_server.address()

    @property
    def store_address(self) -> str:
        """host:port of the shared store, for the groups' ranks."""
        return f"{self.launchers.host}:{self.store.port}"

    def announce_finished(self) -> None:
        """One of this launcher's groups finished the run."""
        self._ask(lambda: self.store.set("finished", "1"))

    def run_finished(self) -> bool:
        """Whether some launcher's group (this one's included) finished the run. False when the store cannot
        answer: the groups then learn of the first node's end from their own quorum timeouts."""
        if self.launchers.count == 1:
            return False
        return bool(self._ask(lambda: self.store.check(["finished"])))

    def __exit__(self, *exc: object) -> None:
        try:
            self._ask(lambda: self.store.add("launchers_done", 1))
            if self.launchers.index == 0 and self.launchers.count > 1:
                self._wait_for_the_other_launchers()
        finally:
            if self.lighthouse_server is not None:
                self.lighthouse_server.shutdown()

    def _wait_for_the_other_launchers(self) -> None:
        deadline = None
        while (self._ask(lambda: self.store.add("launchers_done", 0)) or 0) < self.launchers.count:
            if deadline is None and self.run_finished():
                deadline = time.monotonic() + self.ft.timeout_s
            if deadline is not None and time.monotonic() >= deadline:
                log.warning("replica groups: stopping the lighthouse %.0f s after the run finished", self.ft.timeout_s)
                return
            time.sleep(0.2)

    @staticmethod
    def _ask(call: Callable[[], T]) -> T | None:
        """``call()`` on the store, or None when its server (the first launcher) is gone."""
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - a store whose server exited raises a bare RuntimeError
            log.debug("replica groups' store: %s", err)
            return None


def groups_of(launchers: Launchers, replica_groups: int) -> range:
    """The replica groups this launcher runs: an equal, consecutive share of them (the first node's are 0, 1, ...)."""
    per_launcher = replica_groups // launchers.count
    return range(launchers.index * per_launcher, (launchers.index + 1) * per_launcher)
