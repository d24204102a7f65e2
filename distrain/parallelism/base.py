"""The one interface every parallelism strategy implements, and the shared step of strategies where torch owns
backward and the optimizer step.

A strategy owns one *whole optimizer step* (``train_step`` takes all micro-batches of the step), because the
strategies disagree on who drives forward and backward: DDP and FSDP let us loop over micro-batches, DeepSpeed's
engine owns backward and step, and a pipeline schedule owns forward and backward across stages. The train loop
only ever calls ``setup``, ``train_step``, ``eval_loss`` and the state-dict pair.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from distrain.comm.ddp_comm import DDPComm
from distrain.data.sampler import Batch
from distrain.dist import DistEnv
from distrain.precision.policy import PrecisionPolicy

OptimizerFactory = Callable[[Iterable[tuple[str, nn.Parameter]]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass(frozen=True)
class StrategyContext:
    """Everything a strategy needs besides the model, built once by train.py."""

    env: DistEnv
    build_optimizer: OptimizerFactory
    build_scheduler: SchedulerFactory
    precision: PrecisionPolicy
    comm: DDPComm
    grad_clip_norm: float  # 0 disables clipping


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step on this rank. Tensors are detached and stay on the rank's device.

    ``loss`` is this rank's token-mean loss over the step's micro-batches (not yet averaged across ranks);
    ``grad_norm`` is the global L2 norm of the (synchronised, unscaled) gradients before clipping.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor


class Strategy(Protocol):
    """What the train loop needs from a parallelism strategy."""

    name: str

    def setup(self, model: nn.Module, ctx: StrategyContext) -> None:
        """Place, wrap or shard ``model`` and build its optimizer and scheduler."""

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) of this rank on the data-parallel axis: which shard of every global batch it reads."""

    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """Forward and backward over all micro-batches, gradient sync, clipping, optimizer and scheduler step."""

    def eval_loss(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Summed token loss on ``batch`` and its token count, without gradients."""

    def current_lr(self) -> float: ...

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and scaler state, as sharded tensors where the strategy shards."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy, computed in fp32 whatever the autocast dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


class LocalBackwardStrategy:
    """Shared ``train_step`` for strategies where autograd runs on this rank and torch's optimizer steps.

    Subclasses say how to wrap the model (``wrap``) and how to keep gradients from synchronising on all but the
    last micro-batch (``gradient_sync``). The loss is normalised by the step's total token count on this rank,
    so k micro-batches of b sequences produce the same gradient as one batch of k*b; with equal token counts
    on every rank, the data-parallel mean then equals the global token mean.
    """

    name = "local"

    def wrap(self, model: nn.Module, ctx: StrategyContext) -> nn.Module:
        return model

    def gradient_sync(self, enabled: bool) -> AbstractContextManager[None]:
        del enabled
        return contextlib.nullcontext()

    def setup(self, model: nn.Module, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.device = ctx.env.device
        self.model = self.wrap(model.to(self.device), ctx)
        self.optimizer = ctx.build_optimizer(self.model.named_parameters())
        self.scheduler = ctx.build_scheduler(self.optimizer)
        self.scaler = ctx.precision.grad_scaler(self.device)

    @property
    def data_parallel(self) -> tuple[int, int]:
        return self.ctx.env.rank, self.ctx.env.world_size

    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        self.model.train()
        total_tokens = sum(batch.num_tokens for batch in micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for index, batch in enumerate(micro_batches):
            batch = batch.to(self.device)
            with self.gradient_sync(index == len(micro_batches) - 1):
                with self.ctx.precision.autocast(self.device):
                    micro_loss = token_loss_sum(self.model(batch.inputs), batch.targets)
                self.scaler.scale(micro_loss / total_tokens).backward()
            loss_sum += micro_loss.detach()
        grad_norm = self.clip_gradients()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepResult(loss=loss_sum / total_tokens, grad_norm=grad_norm)

    def clip_gradients(self) -> torch.Tensor:
        """Unscale, then clip to the global norm; returns the norm before clipping (computed either way)."""
        self.scaler.unscale_(self.optimizer)
        max_norm = self.ctx.grad_clip_norm if self.ctx.grad_clip_norm > 0 else float("inf")
        return nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).detach()

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> tuple[torch.Tensor, int]:
        self.model.eval()
        batch = batch.to(self.device)
        with self.ctx.precision.autocast(self.device):
            return token_loss_sum(self.model(batch.inputs), batch.targets), batch.num_tokens

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
