"""How a DDP-wrapped model communicates gradients: reducer bucket settings and the communication hook.

``comm=default`` is DDP's bucketed ring all-reduce; the compressing variants (``distrain.comm.compression``: cast and
PowerSGD, ``distrain.comm.topk``; their quality guard in ``distrain.comm.quality``) and the hierarchical one
(``distrain.comm.hierarchical``) replace how one bucket is averaged and keep everything else (bucketing, overlap
with backward, ``no_sync`` accumulation, bytes and time accounting).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from distrain.comm.checks import check_averaging
from distrain.comm.traffic import all_reduce_bytes
from distrain.launch.process_group import DistEnv
from distrain.monitor.timing import Clock

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from distrain.config.options import Placement
    from distrain.ft.replicas import ReplicaGroups


class DDPComm:
    """DDP's default bucketed all-reduce, overlapped with backward.

    Args:
        name: the comm option's name.
        bucket_cap_mb: gradients are all-reduced in buckets of about this many MiB, each launched as soon as
            all its gradients are ready during backward (overlap).
        gradient_as_bucket_view: gradients alias the flat bucket buffers (saves one copy and its memory).
        static_graph: the set of used parameters never changes, letting DDP skip per-step bookkeeping.

    Per step it reports (``step_report``) the bytes this rank sent for gradients (``distrain.comm.traffic``), the
    bytes a dense fp32 ring all-reduce would have sent, and each bucket's (launch, done) timestamps, from which
    the logging window derives communication time and how much of it backward hid.
    """

    # True when each rank's optimizer steps on its own gradient and the option exchanges the resulting updates
    # (``comm=topk comm.feedback=update``): the strategy then clips with a norm all ranks share, keeps the
    # optimizer's state per rank, and calls ``finish_update`` after the optimizer step.
    local_steps = False
    # With local_steps: whether the ranks clip with one shared norm (top-k's local clipping, one scalar all-reduce
    # per step) or each its own gradient with the whole threshold (DiLoCo's inner steps: no collective).
    shared_clip_norm = True
    # Under ft=torchft: True when this option syncs the replica groups itself, at the steps ``quorum_due`` names
    # (DiLoCo's outer steps), instead of the strategy averaging every step's gradients across them.
    syncs_replica_groups = False
    replica_groups: ReplicaGroups | None = None  # set by ``sync_replica_groups`` when the option does

    def __init__(self, *, name: str, bucket_cap_mb: float, gradient_as_bucket_view: bool, static_graph: bool) -> None:
        self.name = name
        self.bucket_launches = 0
        self.bucket_cap_mb, self.gradient_as_bucket_view, self.static_graph = (
            bucket_cap_mb,
            gradient_as_bucket_view,
            static_graph,
        )
        self.step = 0  # optimizer steps begun (``begin_step``), restored from checkpoints by stateful hooks
        self.registered = False
        self._new_step_counters()

    @classmethod
    def check_config(cls, cfg: DictConfig, placement: Placement) -> list[str]:
        """This option's checks before any rank starts (``distrain.config.options``): the bucket size; a method
        other than this plain averaging runs as a DDP communication hook, which the strategy must accept.
        Subclasses add their own keys' checks to these."""
        del placement
        return check_averaging(cfg, as_hook=cls is not DDPComm)

    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel``."""
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph,
        }

    def register(
        self,
        model: DistributedDataParallel,
        env: DistEnv,
        clock: Clock,
        on_launch: Callable[[], None] | None = None,
    ) -> None:
        """Install this option's bucket averaging as ``model``'s communication hook. Every launch is counted
        (``bucket_launches``) and reported to ``on_launch`` (the step timer) as it happens."""
        self.world_size, self.rank, self.clock = dist.get_world_size(), dist.get_rank(), clock
        self.prepare(model, env)

        # No annotations: DDP inspects them and rejects the strings that postponed evaluation makes of them.
        def hook(process_group, bucket):  # noqa: ANN001, ANN202
            del process_group  # always the default group: DDP is built over all ranks
            return self._launch(bucket, on_launch)

        model.register_comm_hook(None, hook)
        self.registered = True

    def prepare(self, model: DistributedDataParallel, env: DistEnv) -> None:
        """Build what the hook needs (groups, per-parameter state) before the first step; collective if it makes
        process groups."""

    def average_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Average ``bucket.buffer()`` over ranks; return a future of the averaged flat buffer, and add the bytes
        this rank sends to ``self.bytes_sent``. Default: one ring all-reduce (sum) after dividing by world size."""
        buffer = bucket.buffer()
        self.bytes_sent += all_reduce_bytes(buffer.numel() * buffer.element_size(), self.world_size)
        return default_hooks.allreduce_hook(None, bucket)

    def in_order(self, average: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        """Run ``average`` (blocking collectives for one bucket) on this option's one worker thread and return a
        future of its result. Buckets then communicate one after another in launch order, identical on every
        rank, while backward keeps computing. Needed where a bucket runs several dependent collectives: gloo
        matches collectives by issue order, and follow-up collectives issued from completion callbacks of
        different buckets could interleave differently on different ranks."""
        if not hasattr(self, "_worker"):
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"comm-{self.name}")
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def run() -> None:
            try:
                future.set_result(average())
            except BaseException as error:  # noqa: BLE001 - handed to DDP, which re-raises it in backward
                future.set_exception(error)

        self._worker.submit(run)
        return future

    def begin_step(self) -> None:
        """Called by the strategy before each optimizer step's first micro-batch."""
        self.step += 1
        self._new_step_counters()

    def step_report(self) -> dict[str, Any]:
        """This step's gradient traffic on this rank (empty when no hook is installed, e.g. under fsdp)."""
        if not self.registered:
            return {}
        return {"comm_bytes": self.bytes_sent, "comm_dense_bytes": self.dense_bytes, "comm_intervals": self.intervals}

    def gradient_point(self) -> AbstractContextManager[None]:
        """Entered around the step's forward and backward passes: where the gradient is taken (here: at the
        parameters as they are)."""
        return nullcontext()

    def finish_update(self, *, stepped: bool = True) -> dict[str, Any]:
        """Called after the optimizer step (``local_steps`` options only; ``stepped=False`` when the step was
        skipped): exchange the ranks' updates so every rank holds the same parameters again; returns entries for
        the step's report."""
        return {}

    def set_schedule(self, is_exact_step: Callable[[int], bool]) -> None:
        """Which optimizer steps the loop evaluates or checkpoints after (the last among them): an option that
        holds updates back sends them there, so evaluations and checkpoints see every update."""
        self.is_exact_step = is_exact_step

    def is_exact_step(self, step: int) -> bool:
        """Whether the loop evaluates or checkpoints after optimizer step ``step`` (none until ``set_schedule``)."""
        del step
        return False

    def sync_replica_groups(self, replica_groups: ReplicaGroups) -> None:
        """Under ft=torchft, for an option that ``syncs_replica_groups``: exchange across the groups through
        ``replica_groups`` (its quorum then runs only at the steps ``quorum_due`` names)."""
        self.replica_groups = replica_groups
        replica_groups.quorum_due = self.quorum_due

    def quorum_due(self, step: int) -> bool:
        """Whether optimizer step ``step`` syncs the replica groups (an option that ``syncs_replica_groups``)."""
        del step
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per-rank state a checkpoint must keep for an exact resume (error feedback residuals); live tensors, so
        a checkpoint load fills them in place. Empty for stateless options."""
        return {}

    def on_resume(self, step: int, restored: bool) -> None:
        """After a checkpoint load: ``step`` is the checkpoint's step; ``restored`` whether ``state_dict``'s
        tensors were filled from it (False when it has none for this rank, or was saved by another world size)."""
        self.step = step

    def _new_step_counters(self) -> None:
        self.bytes_sent = 0
        self.dense_bytes = 0
        # A fresh list each step: a callback can never add to the next step's report.
        self.intervals: list[tuple[Any, Any]] = []

    def _launch(
        self, bucket: dist.GradBucket, on_launch: Callable[[], None] | None
    ) -> torch.futures.Future[torch.Tensor]:
        self.bucket_launches += 1
        if on_launch is not None:
            on_launch()
        buffer = bucket.buffer()
        self.dense_bytes += all_reduce_bytes(buffer.numel() * 4, self.world_size)
        launched, intervals, clock = self.clock.mark(), self.intervals, self.clock

        def done(future: torch.futures.Future) -> torch.Tensor:
            intervals.append((launched, clock.mark()))
            return future.value()

        return self.average_bucket(bucket).then(done)
