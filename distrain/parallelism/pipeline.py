"""``parallelism=pipeline``: the model's blocks split into stages across ranks, driven by a
``torch.distributed.pipelining`` schedule (GPipe, 1F1B, or interleaved 1F1B with several virtual stages per rank).

Every rank builds the whole model on CPU, keeps only the parts of its stages and moves them to its device. Each
optimizer step concatenates the step's micro-batches and lets the schedule split them into
``microbatches`` pipeline micro-batches: the schedule owns forward and backward, sending activations forward and
gradients backward between neighbouring stages (point-to-point send/recv on the default group).

Collectives per step besides the schedule's send/recv: one all-reduce of the squared gradient norm (clipping needs
the norm over every stage's parameters) and one broadcast of the loss from the last stage. Every rank reads the same
batches (no data parallelism inside a pure pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import _init_optim_state, get_model_state_dict, set_model_state_dict
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from distrain.checkpoint.data_only import DataOnlyLoadPlanner, DataOnlyReader
from distrain.data.sampler import Batch, step_token_count
from distrain.models.spec import spec_of
from distrain.optim.groups import kernels_kept
from distrain.parallelism.base import (
    LocalBackwardStrategy,
    NonFiniteGradientError,
    StepResult,
)
from distrain.parallelism.gradients import scale_to_norm, squared_grad_norm
from distrain.parallelism.layout import Layout
from distrain.parallelism.recompute import apply_activation_checkpointing
from distrain.planning.memory import measure_torch_model_state

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def balanced_split(block_params: Sequence[int], num_stages: int, first_extra: int, last_extra: int) -> list[int]:
    """Contiguous stage boundaries over the blocks (``num_stages + 1`` indices) that balance parameters per stage,
    counting the embeddings in the first stage and the output head in the last. Every stage gets a block."""
    weights = list(block_params)
    weights[0] += first_extra
    weights[-1] += last_extra
    total, bounds, acc = sum(weights), [0], 0
    for index, weight in enumerate(weights):
        acc += weight
        stages_left = num_stages - len(bounds)
        blocks_left = len(weights) - index - 1
        # cut after this block when the running share is reached, or when the remaining blocks are just enough
        if stages_left > 0 and (acc >= total * len(bounds) / num_stages or blocks_left == stages_left):
            bounds.append(index + 1)
    bounds.append(len(weights))
    return bounds


def rank_stages(rank: int, ranks: int, num_stages: int) -> list[int]:
    """Stage s lives on rank s % ranks: rank r holds stages r, r + ranks, ... (the interleaved layout)."""
    return list(range(rank, num_stages, ranks))


def split_stages(
    model: nn.Module, num_stages: int, split_points: Sequence[int], stage_indices: Sequence[int]
) -> list[nn.Module]:
    """The ``stage_indices`` of ``model`` split into ``num_stages`` contiguous stages at ``split_points`` (block
    indices where stages begin), or balanced by parameters when there are none. Each stage is the model itself with
    the parts it does not hold removed (``ModelSpec.stage``); parameters are shared with ``model``."""
    spec = spec_of(model)
    blocks = spec.block_modules(model)
    block_ids = list(blocks.keys())
    if split_points:
        bounds = [0, *split_points, len(block_ids)]
    else:
        sizes = [sum(p.numel() for p in blocks[i].parameters()) for i in block_ids]
        first, last = (
            sum(p.numel() for name in names for p in model.get_submodule(name).parameters())
            for names in (spec.before_blocks, spec.after_blocks)
        )
        bounds = balanced_split(sizes, num_stages, first, last)
    return [
        spec.stage(model, block_ids[bounds[s] : bounds[s + 1]], first=s == 0, last=s == num_stages - 1)
        for s in stage_indices
    ]


def rank_modules(model: nn.Module, stages: Sequence[nn.Module]) -> nn.Module:
    """All parameters this rank holds (its stages together) as one module under the full model's names: what the
    optimizer, gradient clipping and checkpoints see. Never called: each stage runs its own forward."""
    spec = spec_of(model)
    return spec.stage(
        model,
        [key for stage in stages for key in spec.block_modules(stage)],
        first=any(spec.is_first_stage(stage) for stage in stages),
        last=any(spec.is_last_stage(stage) for stage in stages),
    )


class PipelineStrategy(LocalBackwardStrategy):
    """Pipeline parallelism over all ranks.

    Args:
        schedule: ``gpipe`` (all forwards, then all backwards), ``1f1b`` (one forward one backward in steady
            state: activations of at most ``ranks`` micro-batches alive), ``interleaved`` (1F1B over
            ``virtual_stages`` stages per rank: a smaller bubble for more communication).
        microbatches: pipeline micro-batches per optimizer step; the step's sequences
            (``data.micro_batch_size x trainer.grad_accum_steps``) must divide evenly among them.
        virtual_stages: stages per rank with ``interleaved`` (1 otherwise).
        split_points: block indices where stages begin (``num_stages - 1`` of them); empty: balanced by parameters.
        recompute_stages: stage indices whose blocks keep only their inputs and recompute the rest in
            backward (e.g. ``[0]``: under 1F1B the first stage holds the most micro-batches in flight).

    Each step reports the stage's measured idle fraction (the bubble) beside the schedule's theoretical one:
    busy is the time in this rank's forward and backward chunks, idle the rest of the schedule's time.
    """

    @staticmethod
    def resolve_layout(parallelism: Any, world_size: int, ranks_per_node: int | None = None, **_: Any) -> Layout:
        """A pipeline over every rank: the target of ``parallelism=pipeline`` checkpoints saved before it became a
        preset of the mesh layout."""
        return Layout(pp=world_size)

    compile_unsupported = "the schedule runs each stage's forward and backward itself (not compiled here)"

    def __init__(
        self,
        *,
        name: str = "pipeline",
        schedule: str,
        microbatches: int,
        virtual_stages: int,
        split_points: Sequence[int],
        recompute_stages: Sequence[int] = (),
    ) -> None:
        self.name, self.schedule_name, self.microbatches = name, schedule, microbatches
        self.recompute_stages = set(recompute_stages)
        self.virtual_stages = virtual_stages if schedule == "interleaved" else 1
        self.split_points = list(split_points)

    def setup(self, model: nn.Module, ctx: Any) -> None:
        self.ctx, self.device = ctx, ctx.env.device
        rank, ranks, self.pp_group = self.pipeline_ranks(ctx)
        self.pp_rank = rank
        num_stages = ranks * self.virtual_stages
        self.stage_indices = rank_stages(rank, ranks, num_stages)
        self.stage_modules = []
        self.spec = spec_of(model)
        stages = split_stages(model, num_stages, self.split_points, self.stage_indices)
        for s, stage in zip(self.stage_indices, stages, strict=True):
            if s in self.recompute_stages:
                apply_activation_checkpointing(stage, "full")
            self.stage_modules.append(self.parallelize_stage(stage.to(self.device)))
        self.model = rank_modules(model, self.stage_modules)
        self.is_last = num_stages - 1 in self.stage_indices
        self.last_stage_rank = (num_stages - 1) % ranks  # within the pipeline group
        self.stages = [
            PipelineStage(module, s, num_stages, self.device, group=self.pp_group)
            for module, s in zip(self.stage_modules, self.stage_indices, strict=True)
        ]
        self.build_optimizer()
        self._busy: list[tuple[Any, Any]] = []
        for stage in self.stages:
            self._time_chunks(stage)
        # Idle fraction of an ideal schedule: (p - 1) / (v m + p - 1) for p ranks, v stages each, m micro-batches.
        self.theoretical_bubble = (ranks - 1) / (self.virtual_stages * self.microbatches + ranks - 1)
        self._step_tokens = 1
        # Scale inside the loss (token mean over the whole step), not by the number of micro-batches.
        if self.schedule_name == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(
                self.stages, self.microbatches, loss_fn=self._loss, scale_grads=False
            )
        else:
            single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule_name]
            self.schedule = single(self.stages[0], self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _time_chunks(self, stage: PipelineStage) -> None:
        """Record (start, end) clock marks of every forward and backward chunk the schedule runs on ``stage``."""
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            run = getattr(stage, method)

            def timed(*args: Any, _run: Any = run, **kwargs: Any) -> Any:
                start = self.ctx.clock.mark()
                try:
                    return _run(*args, **kwargs)
                finally:
                    self._busy.append((start, self.ctx.clock.mark()))

            setattr(stage, method, timed)

    def train_mode(self, training: bool) -> None:
        """Training or evaluation mode for every stage (the stages' roots are not children of ``self.model``)."""
        self.model.train(training)
        for module in self.stage_modules:
            module.train(training)

    def pipeline_ranks(self, ctx: Any) -> tuple[int, int, dist.ProcessGroup | None]:
        """This rank's position in its pipeline, the pipeline's size, and its process group (None: all ranks)."""
        return ctx.env.rank, ctx.env.world_size, None

    def parallelize_stage(self, module: nn.Module) -> nn.Module:
        """Hook for composed strategies: shard or split a stage's module before it joins the schedule."""
        return module

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.spec.loss(logits, targets) / self._step_tokens

    @property
    def data_parallel(self) -> tuple[int, int]:
        return 0, 1  # every stage reads the same batch

    def _run_schedule(
        self, run: Any, inputs: torch.Tensor, targets: torch.Tensor, model_kwargs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``schedule.step`` or ``schedule.eval`` on this rank's stages; returns the summed loss of the last stage,
        broadcast to every rank. Only the first stage takes inputs; every stage passes the targets along, and
        every stage takes ``model_kwargs`` (document masking's documents), split into micro-batches as inputs are."""
        losses: list[torch.Tensor] = []
        self._busy, started = [], self.ctx.clock.mark()
        with self.ctx.precision.autocast(self.device):
            run(*([inputs] if 0 in self.stage_indices else []), target=targets, losses=losses, **model_kwargs)
        self._schedule_span = (started, self.ctx.clock.mark())
        loss = torch.stack(losses).sum().detach().float() if self.is_last else torch.zeros((), device=self.device)
        dist.broadcast(loss, group=self.pp_group, group_src=self.last_stage_rank)
        return loss

    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        self.train_mode(True)
        inputs = torch.cat([b.inputs for b in micro_batches]).to(self.device)
        targets = torch.cat([b.targets for b in micro_batches]).to(self.device)
        model_kwargs = {
            name: torch.cat([b.model_kwargs[name] for b in micro_batches]).to(self.device)
            for name in micro_batches[0].model_kwargs
        }
        self._step_tokens = step_token_count(micro_batches)
        loss = self._run_schedule(self.schedule.step, inputs, targets, model_kwargs)
        marks: dict[str, Any] = {
            "backward_done": self.ctx.clock.mark(),
            "stage_intervals": self._busy,
            "schedule_span": self._schedule_span,
            "theoretical_bubble": self.theoretical_bubble,
        }
        grad_norm = self.clip_gradients()
        if not torch.isfinite(grad_norm):
            raise NonFiniteGradientError(f"gradient norm is {grad_norm.item()}; the update was not applied")
        self.updating = True
        self.optimizer.step()
        if self._state_bytes is None:
            self._state_bytes = measure_torch_model_state(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.updating = False
        marks["optimizer_done"] = self.ctx.clock.mark()
        return StepResult(loss=loss, grad_norm=grad_norm, marks=marks)

    def clip_gradients(self) -> torch.Tensor:
        """Global L2 norm over every stage's gradients (one all-reduce of this rank's squared norm over the
        pipeline, after DTensor's own reductions of sharded gradients), then clip."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        squared = squared_grad_norm(grads, self.device)
        dist.all_reduce(squared, group=self.pp_group)
        return scale_to_norm(grads, squared, self.ctx.grad_clip_norm)

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Forward-only through the pipeline; every rank returns the last stage's summed loss (one broadcast)."""
        self.train_mode(False)
        self._step_tokens = 1
        batch = batch.to(self.device)
        inputs, targets, model_kwargs = batch.inputs, batch.targets, batch.model_kwargs
        if self.is_last and 0 in self.stage_indices:
            # Every stage on this one rank: run them in order. torch's interleaved schedule cannot evaluate two
            # stages of one rank (its forward-only pass asserts on the hand-over between them).
            with self.ctx.precision.autocast(self.device):
                for module in self.stage_modules:
                    inputs = module(inputs, **model_kwargs)
                loss = self._loss(inputs, targets).detach().float()
        else:
            loss = self._run_schedule(self.schedule.eval, inputs, targets, model_kwargs)
        # evaluate_sets() sums over ranks; every rank of a pipeline holds the same loss here, so count it once.
        if not self.reports_eval_loss():
            return torch.zeros((), device=self.device), 0
        return loss, batch.num_tokens

    def reports_eval_loss(self) -> bool:
        return self.ctx.env.rank == 0

    def _state_dict(self) -> dict[str, Any]:
        # Each pipeline rank's optimizer state under its own key: the stages hold disjoint parameters, and DCP's
        # flattened optimizer format lost the hyperparameters of all but one rank's param groups (seen with torch
        # 2.13). Data- and tensor-parallel peers of a composed pipeline share the key and fill its DTensors' shards.
        return {
            "model": get_model_state_dict(self.model),
            "optimizer": {f"rank{self.pp_rank}": self.optimizer.state_dict()},
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_checkpoint(self, path: Path, extra: dict[str, Any]) -> dict[str, Any]:
        """Resume on the same number of ranks and stage layout that saved (collective)."""
        # DCP fills only the entries a template has: create the optimizer's (lazy) state first, as get_state_dict
        # does for the other strategies, with torch's helper that steps at learning rate 0.
        _init_optim_state(self.optimizer)
        state = {**self._state_dict(), "extra": extra}
        dcp.load(state, storage_reader=DataOnlyReader(path), planner=DataOnlyLoadPlanner())
        set_model_state_dict(self.model, state["model"])
        with kernels_kept(self.optimizer):
            self.optimizer.load_state_dict(state["optimizer"][f"rank{self.pp_rank}"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["extra"]
