"""The one interface every parallelism strategy implements, and the shared step of strategies where torch owns
backward and the optimizer step.

A strategy owns one *whole optimizer step* (``train_step`` takes all micro-batches of the step), because the
strategies disagree on who drives forward and backward: DDP and FSDP let us loop over micro-batches, DeepSpeed's
engine owns backward and step, and a pipeline schedule owns forward and backward across stages. The train loop
only ever calls ``setup``, ``train_step``, ``eval_loss``, the checkpoint pair and the memory report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from distrain.comm.ddp_comm import DDPComm
from distrain.data.sampler import Batch, step_token_count
from distrain.errors import RunError
from distrain.launch.process_group import DistEnv
from distrain.models.spec import spec_of
from distrain.monitor.timing import Clock
from distrain.optim.groups import base_lr, kernels_kept
from distrain.parallelism.capabilities import Capabilities
from distrain.parallelism.dtensor import as_placed, full_value, is_dtensor, local_parts, local_value
from distrain.parallelism.gradients import clip_local_gradients
from distrain.planning.memory import ModelStateBytes, measure_torch_model_state
from distrain.precision.policy import PrecisionPolicy
from distrain.trainer.faults import maybe_inject_fault

if TYPE_CHECKING:
    from distrain.ft.replicas import ReplicaGroups

# (named_parameters, replicated_over=group or None) -> optimizer: ``distrain.optim.optimizers``.
OptimizerFactory = Callable[..., torch.optim.Optimizer]
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
    on_nonfinite: str  # skip | stop: what a non-finite gradient norm does (fp16 loss scaling handles its own)
    micro_batch_size: int  # sequences per rank per micro-step
    grad_accum_steps: int  # micro-steps per optimizer step
    run_dir: str
    clock: Clock  # phase timestamps for the step's time split (CUDA events on a GPU)
    # ft=torchft: averages gradients across replica groups and decides each step's commit (None: one group)
    replica_groups: ReplicaGroups | None = None


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step on this rank. Tensors are detached and stay on the rank's device.

    ``loss`` is this rank's token-mean loss over the step's micro-batches (not yet averaged across ranks);
    ``grad_norm`` is the global L2 norm of the (synchronised, unscaled) gradients before clipping.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: bool = False  # the update was not applied (non-finite gradients, on_nonfinite=skip)
    # ft=torchft: False when the replica groups' quorum did not commit the step (a group failed during it): nothing
    # was applied and the loop runs the step again.
    committed: bool = True
    # Phase timestamps (``distrain.monitor.timing``): backward_done, optimizer_done and, under DDP, comm_launch;
    # under DDP also the comm hook's traffic (``DDPComm.step_report``).
    marks: dict[str, Any] = field(default_factory=dict)


class NonFiniteGradientError(RunError, FloatingPointError):
    """Raised before the optimizer step when gradients are not finite and ``on_nonfinite=stop``: every rank sees
    the same all-reduced norm, so every rank raises it, and the job ends with its one line."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"{detail}; the weights are unchanged. Find the op that made it with debug=nan, or drop such updates "
            "with trainer.on_nonfinite=skip"
        )


class Strategy(Protocol):
    """What the train loop needs from a parallelism strategy."""

    name: str
    updating: bool  # True while parameters or optimizer state are being changed: a failure then is unrecoverable
    compile_unsupported: str | None  # why compile=true runs this strategy eagerly; None: it compiles

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

    def model_state_bytes(self) -> ModelStateBytes:
        """Parameter, gradient and optimizer-state bytes this rank holds (measured at the first step's end)."""

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        """Write this rank's part of a sharded checkpoint into ``path`` (collective), with ``extra`` loop state."""

    def save_checkpoint_async(self, path: Path, extra: dict[str, Any], process_group: dist.ProcessGroup) -> Future:
        """As ``save_checkpoint``, but return once a copy is staged in CPU memory: a background thread writes it,
        its collectives on ``process_group``; the future completes when the files are written. Only strategies
        whose capabilities say ``async_save``."""

    def load_checkpoint(self, path: Path, extra: dict[str, Any]) -> dict[str, Any]:
        """Restore from ``path`` (collective); ``extra`` is a template of the loop state, returned filled."""


def as_tensor(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (a loss computed on sharded logits) as the plain tensor every rank holds."""
    return value.to_local() if is_dtensor(value) else value


def optimizer_metrics(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """What an optimizer that communicates (Muon) sent in its last step: ``optimizer_bytes_sent``, this rank's
    bytes (the counter is reset); empty for optimizers without collectives."""
    sent = getattr(optimizer, "bytes_sent", None)
    if sent is None:
        return {}
    optimizer.bytes_sent = 0
    return {"optimizer_bytes_sent": float(sent)}


class LocalBackwardStrategy:
    """Shared ``train_step`` for strategies where autograd runs on this rank and torch's optimizer steps.

    Subclasses say how to wrap the model (``wrap``) and how to keep gradients from synchronising on all but the
    last micro-batch (``gradient_sync``). The loss is normalised by the step's token count (``step_token_count``:
    this rank's, or under document masking the step's counted tokens per data-parallel rank), so k micro-batches
    of b sequences produce the same gradient as one batch of k*b, and the data-parallel mean is the global token
    mean. A comm option taking local steps (its ranks' gradients never averaged) divides by this rank's own count.
    """

    name = "local"
    capabilities = Capabilities()
    updating = False
    compile_unsupported: str | None = None

    def wrap(self, model: nn.Module, ctx: StrategyContext) -> nn.Module:
        return model

    def gradient_sync(self, enabled: bool) -> AbstractContextManager[None]:
        del enabled
        return contextlib.nullcontext()

    def loss_context(self) -> AbstractContextManager[None]:
        """Entered around forward, loss and backward (tensor parallelism's vocabulary-parallel loss)."""
        return contextlib.nullcontext()

    def setup(self, model: nn.Module, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.device = ctx.env.device
        self.spec = spec_of(model)
        self.unwrapped = model  # what the spec's auxiliary loss and metrics read (self.model may be DDP's wrapper)
        self.model = self.wrap(model.to(self.device), ctx)
        self.build_optimizer()

    def replicas(self) -> dist.ProcessGroup | None:
        """The process group over which every rank holds the same whole parameters (None: no such group): an
        optimizer may share work over it (Muon's Newton-Schulz)."""
        return None

    def build_optimizer(self) -> None:
        """Optimizer, LR scheduler and grad scaler over ``self.model``'s parameters (this rank's share)."""
        self.optimizer = self.ctx.build_optimizer(self.model.named_parameters(), replicated_over=self.replicas())
        self.scheduler = self.ctx.build_scheduler(self.optimizer)
        self.scaler = self.ctx.precision.grad_scaler(self.device)
        self._state_bytes: ModelStateBytes | None = None

    @property
    def data_parallel(self) -> tuple[int, int]:
        return self.ctx.env.rank, self.ctx.env.world_size

    def mark_comm_launch(self) -> None:
        """Called by a communication hook as each gradient bucket is launched; the last one counts."""
        self._marks["comm_launch"] = self.ctx.clock.mark()

    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        self.model.train()
        self._marks: dict[str, Any] = {}
        self.ctx.comm.begin_step()
        total_tokens = step_token_count(micro_batches, own=self.ctx.comm.local_steps)
        loss_sum = torch.zeros((), device=self.device)
        with self.ctx.comm.gradient_point():
            for index, batch in enumerate(micro_batches):
                batch = batch.to(self.device)
                with self.gradient_sync(index == len(micro_batches) - 1), self.loss_context():
                    with self.ctx.precision.autocast(self.device):
                        output = self.model(batch.inputs, **batch.model_kwargs)
                        objective, micro_loss = self.spec.objective(self.unwrapped, output, batch.targets)
                    self.scaler.scale(objective / total_tokens).backward()
                loss_sum += as_tensor(micro_loss.detach())
        self._marks["backward_done"] = self.ctx.clock.mark()
        self._marks |= self.ctx.comm.step_report()
        if self.ctx.replica_groups is not None and self.ctx.comm.syncs_replica_groups:  # at its outer steps only
            self._marks["replica_metrics"] = {"replica_groups": float(self.ctx.replica_groups.participants())}
        elif self.ctx.replica_groups is not None and not self._average_across_replicas(loss_sum):
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(loss=loss_sum / total_tokens, grad_norm=torch.zeros(()), committed=False)
        self._marks["model_metrics"] = self.spec.step_metrics(self.unwrapped)
        grad_norm = self.clip_gradients()
        skipped = False
        # The norm is computed from synchronised gradients, so every rank takes the same decision. With a grad
        # scaler, overflow is routine and the scaler itself skips the step and lowers the scale.
        # Under DiLoCo (each rank clips its own gradient) the decision is this rank's own: it skips its inner step,
        # and a stop would leave its peers waiting in the next sync; only the outer mean's finiteness stops all.
        shared_norm = not self.ctx.comm.local_steps or self.ctx.comm.shared_clip_norm
        if not self.scaler.is_enabled() and not torch.isfinite(grad_norm):
            if self.ctx.on_nonfinite == "stop" and shared_norm:
                raise NonFiniteGradientError(f"gradient norm is {grad_norm.item()}; the update was not applied")
            skipped = True
        self.updating = True
        if not skipped:
            self.scaler.step(self.optimizer)
        if self.ctx.comm.local_steps:  # every rank holds the same parameters again after this
            skipped = self._finish_local_update(skipped)
        maybe_inject_fault(self.ctx.env.rank, self.scheduler.last_epoch + 1, point="update")
        self.scaler.update()
        if self._state_bytes is None:  # once: gradients and optimizer state all exist only at this point
            self._state_bytes = measure_torch_model_state(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.updating = False
        self._marks["optimizer_done"] = self.ctx.clock.mark()
        self._marks["optimizer_metrics"] = optimizer_metrics(self.optimizer)
        return StepResult(loss=loss_sum / total_tokens, grad_norm=grad_norm, skipped=skipped, marks=self._marks)

    def _average_across_replicas(self, loss_sum: torch.Tensor) -> bool:
        """ft=torchft: average the gradients (and the step's loss, so every group logs the job's loss) across the
        replica groups of this step's quorum, after the group's own all-reduce; returns whether the quorum commits
        the step. Collective: one all-reduce of one flat buffer over torchft's process group."""
        # Rank r of every group holds the same shards (FSDP, tensor-parallel DTensors): its local parts average.
        grads = [local_value(p.grad) for p in self.model.parameters() if p.grad is not None]
        groups = self.ctx.replica_groups
        committed = groups.average([*grads, loss_sum])
        self._marks["replica_metrics"] = {"replica_groups": float(groups.participants())}
        if "comm_bytes" in self._marks:  # the cross-group all-reduce counts in the step's gradient traffic
            self._marks["comm_bytes"] += groups.bytes_sent
            self._marks["comm_dense_bytes"] += groups.bytes_sent
        return committed

    def replica_state(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and scaler state as plain tensors in memory: what a healing replica group
        copies from this one (ft=torchft). Sharded tensors travel as this rank's parts (rank r of the healing group
        holds the same shards as rank r here). With a comm option that syncs the groups itself (DiLoCo), also its
        state: the outer model and momentum are the job's."""
        # torchft serves these tensors while training goes on. Every step's commit ends the serving before the
        # optimizer steps; a comm option syncing the groups itself takes inner steps before its commit, so it serves
        # a copy (only made when some group heals).
        copy = self.ctx.comm.syncs_replica_groups
        state = local_parts(self._state_dict(), copy=copy)
        if copy:
            state["comm"] = local_parts(self.ctx.comm.state_dict(), copy=True)
        return state

    def load_replica_state(self, state: dict[str, Any]) -> None:
        """Take a live peer's ``replica_state`` (the comm option's own per-rank state starts afresh at its step,
        unless the peer sent it)."""
        self._apply_state(as_placed(self._state_dict(), state), self.own_optimizer_key())
        sent = state.get("comm")
        if sent:
            live = self.ctx.comm.state_dict()
            for key, value in sent.items():
                live[key].copy_(value)
        self.ctx.comm.on_resume(self.scheduler.last_epoch, restored=bool(sent))

    def _apply_state(self, state: dict[str, Any], optimizer_key: str) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        with kernels_kept(self.optimizer):
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state[optimizer_key]
            )
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])

    def _finish_local_update(self, skipped: bool) -> bool:
        """The comm option's exchange of the ranks' updates (``comm.local_steps``); returns whether the step counts
        as skipped: it was, or the ranks' mean update was not finite and no rank applied it."""
        exchange = self.ctx.comm.finish_update(stepped=not skipped)
        dropped = exchange.pop("update_dropped", False)
        self._marks |= exchange
        if dropped and self.ctx.on_nonfinite == "stop":
            raise NonFiniteGradientError("the ranks' mean update is not finite; it was not applied")
        return skipped or dropped

    def clip_gradients(self) -> torch.Tensor:
        """Unscale, then clip to the global norm; returns the norm before clipping (computed either way)."""
        self.scaler.unscale_(self.optimizer)
        if self.ctx.comm.local_steps and self.ctx.comm.shared_clip_norm:
            return clip_local_gradients(self.model.parameters(), self.ctx.grad_clip_norm, self.ctx.env.world_size)
        max_norm = self.ctx.grad_clip_norm if self.ctx.grad_clip_norm > 0 else float("inf")
        norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return full_value(norm).detach()

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> tuple[torch.Tensor, int]:
        self.model.eval()
        batch = batch.to(self.device)
        with self.loss_context(), self.ctx.precision.autocast(self.device):
            output = self.model(batch.inputs, **batch.model_kwargs)
            return as_tensor(self.spec.loss(output, batch.targets)), batch.num_tokens

    def current_lr(self) -> float:
        return base_lr(self.optimizer)

    def model_state_bytes(self) -> ModelStateBytes:
        if self._state_bytes is None:
            raise RuntimeError("model state is measured during the first train_step")
        return self._state_bytes

    _optimizer_source: str | None = None  # during a load: the key this rank's optimizer state is read from

    def own_optimizer_key(self) -> str:
        """The checkpoint key this rank saves its optimizer state under."""
        return "optimizer"

    def optimizer_key(self) -> str:
        return self._optimizer_source or self.own_optimizer_key()

    def _state_dict(self) -> dict[str, Any]:
        # DCP-ready: DDP's "module." prefix removed; FSDP/TP parameters and optimizer state stay sharded DTensors.
        # DCP is imported at the first save or load, not before the first step (see distrain.parallelism.dtensor).
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            self.optimizer_key(): optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save({**self._state_dict(), "extra": extra}, checkpoint_id=path)

    def save_checkpoint_async(self, path: Path, extra: dict[str, Any], process_group: dist.ProcessGroup) -> Future:
        import torch.distributed.checkpoint as dcp

        return dcp.async_save({**self._state_dict(), "extra": extra}, checkpoint_id=path, process_group=process_group)

    def load_checkpoint(self, path: Path, extra: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        from distrain.checkpoint.data_only import DataOnlyLoadPlanner, DataOnlyReader, saved_optimizer_key

        env = self.ctx.env
        source = self._optimizer_source = saved_optimizer_key(path, self.own_optimizer_key(), env.rank, env.world_size)
        try:
            state = {**self._state_dict(), "extra": extra}
            dcp.load(state, storage_reader=DataOnlyReader(path), planner=DataOnlyLoadPlanner())
        finally:
            self._optimizer_source = None
        self._apply_state(state, source)
        return state["extra"]
