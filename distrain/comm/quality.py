"""The quality guard of compressed communication: how far the gradient every rank applied is from the dense one.

Every ``quality_every`` optimizer steps each rank keeps its own dense gradient at a fixed random sample of entries
(as the hook receives it, before compression), and after backward those samples are summed on rank 0 (one
``reduce`` of ``SAMPLE_SIZE`` fp32 values on a process group of their own, so the guard's collective never
interleaves with the hook's). Rank 0 compares the dense mean with the gradient it applied at the same entries:
``||applied - dense|| / ||dense||``. Sampling keeps it cheap: at most 64 KiB from each rank per check, whatever
the model's size, and the comparison runs on rank 0 only.

Per-step error is large for every compressor that relies on error feedback (what is not sent this step is sent
later), so the guard warns only when the error *stays* above ``quality_threshold`` for ``PATIENCE`` checks in a
row, once per run, in one line. It catches gross failures (classic residual feedback under AdamW, PowerSGD at
rank 1 here); a per-step error does not rank the options that lose a little quality (docs/communication.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrain.comm.checks import check_quality_guard
from distrain.comm.ddp_comm import DDPComm
from distrain.launch.process_group import DistEnv

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from distrain.config.options import Placement

log = logging.getLogger(__name__)

SAMPLE_SIZE = 16384  # gradient entries compared per check (all of them for smaller models)
PATIENCE = 2  # consecutive checks above the threshold before the one warning


class CompressedComm(DDPComm):
    """A DDP communication hook that sends less than the gradient, with the quality guard (module docstring).

    Args:
        quality_every: check the applied gradient against the dense one every this many optimizer steps;
            0 turns the guard off.
        quality_threshold: warn (once) when the relative error stays above this for ``PATIENCE`` checks.
    """

    guard_measures = "the gradient every rank applies differs from the dense gradient"  # the warning's subject

    def __init__(self, *, quality_every: int, quality_threshold: float, **ddp: Any) -> None:
        super().__init__(**ddp)
        self.quality_every, self.quality_threshold = quality_every, quality_threshold
        self._above = 0
        self._warned = False

    @classmethod
    def check_config(cls, cfg: DictConfig, placement: Placement) -> list[str]:
        return [*super().check_config(cfg, placement), *check_quality_guard(cfg)]

    def prepare(self, model: DistributedDataParallel, env: DistEnv) -> None:
        """With the guard on: chooses the sampled entries (the same on every rank) and creates the guard's process
        group (collective). Subclasses that build their own state call this first."""
        if self.quality_every <= 0:
            return
        params = [p for p in model.module.parameters() if p.requires_grad]
        sizes = torch.tensor([p.numel() for p in params])
        ends = sizes.cumsum(0)
        # Positions drawn with replacement (duplicates dropped) so the draw costs SAMPLE_SIZE, not the model's size.
        drawn = torch.randint(int(ends[-1]), (SAMPLE_SIZE,), generator=torch.Generator().manual_seed(0)).unique()
        owner = torch.searchsorted(ends, drawn, right=True)  # which parameter each position falls in
        self._sampled: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        for index in owner.unique().tolist():
            inside = drawn[owner == index] - (ends[index] - sizes[index])
            self._sampled[id(params[index])] = (params[index], inside.to(params[index].device))
        self._local: dict[int, torch.Tensor] = {}
        self._group = dist.new_group()

    def checking(self) -> bool:
        """Whether this optimizer step is one the guard checks."""
        return self.quality_every > 0 and self.step % self.quality_every == 0

    def _launch(
        self, bucket: dist.GradBucket, on_launch: Callable[[], None] | None
    ) -> torch.futures.Future[torch.Tensor]:
        if self.checking():  # before the option compresses the bucket in place
            for p, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                if id(p) in self._sampled:
                    self._local[id(p)] = grad.reshape(-1)[self._sampled[id(p)][1]].float()
        return super()._launch(bucket, on_launch)

    def step_report(self) -> dict[str, Any]:
        """The step's traffic, and on checked steps (on rank 0) ``grad_compression_error``. Collective on checked
        steps: one reduce to rank 0 on the guard's group."""
        report = super().step_report()
        if not (self.registered and self.checking()):
            return report
        error = self._relative_error()
        self._local = {}
        if error is None:
            return report
        self._note(error)
        return report | {"comm_quality": {"grad_compression_error": error}}

    def _relative_error(self) -> float | None:
        """Collective on the guard's group: one reduce (sum) of this rank's sampled dense gradient to rank 0."""
        sampled = [(key, p, index) for key, (p, index) in self._sampled.items()]
        missing = {key: torch.zeros(len(index), device=index.device) for key, _, index in sampled}
        dense = torch.cat([self._local.get(key, missing[key]) for key, _, _ in sampled])
        dist.reduce(dense, dst=0, op=dist.ReduceOp.SUM, group=self._group)
        if self.rank != 0:
            return None
        dense /= self.world_size
        applied = torch.cat(
            [missing[key] if p.grad is None else p.grad.reshape(-1)[index].float() for key, p, index in sampled]
        )
        norm = dense.norm().item()
        return (applied - dense).norm().item() / norm if norm > 0 else 0.0

    def _note(self, error: float) -> None:
        """Count checks in a row above the threshold; warn once when there are ``PATIENCE`` of them."""
        self._above = self._above + 1 if not math.isfinite(error) or error > self.quality_threshold else 0
        if self._above >= PATIENCE and not self._warned:
            self._warned = True
            log.warning(
                f"comm={self.name}: {self.guard_measures} by {error:.0%} (relative error, {PATIENCE} checks in a "
                f"row above comm.quality_threshold={self.quality_threshold}); expect a worse model than "
                "comm=default (docs/communication.md)"
            )
