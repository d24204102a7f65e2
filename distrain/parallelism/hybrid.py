"""``parallelism=hybrid``: data, context, tensor, pipeline and expert parallelism composed on one device mesh.

The mesh is built once from the degrees, ``pp x dp_replicate x dp x cp x tp == world size`` (axes of degree 1 other
than pp, dp and tp are left out), with ``tp`` the fastest-varying axis (the ranks of a tensor-parallel group are
neighbours, on one node when degrees allow: the axis with the most traffic) and ``pp`` the slowest. ``ep`` is not a
factor of the world size: it splits the dp axis into (``dp_mod_ep``, ``ep``). In each pipeline stage (the whole
model when ``pp == 1``):

1. every block is split over the ``tp`` axis (``distrain.parallelism.tensor.parallelize_model``);
2. with ``ep > 1`` the experts are split over ``ep`` (the model spec's ``expert_parallel`` plan);
3. then the blocks and the rest are sharded with FSDP2 (``distrain.parallelism.fsdp.shard_blocks_and_root``) over
   ``dp`` (``dp x cp`` flattened with context parallelism; with ``dp_replicate``, HSDP: replicated across it):
   parameters become DTensors (sharded, and tp-split when tp > 1); expert weights are left to their plan;
4. with ``cp > 1`` every sequence is split over ``cp`` (``distrain.parallelism.context``) before the model sees it;
5. with ``pp > 1`` the stages join a ``torch.distributed.pipelining`` schedule over the ``pp`` axis.

Collectives: tensor parallelism's activation all-reduces inside each ``tp`` group; FSDP's all-gathers and gradient
reduce-scatters inside each dp (or dp x cp) group, and all-reduces across replicas; context parallelism's key/value
all-gather in forward and all-to-all in backward inside each ``cp`` group; expert parallelism's two all-to-alls
each way inside each ``ep`` group and the experts' gradient all-reduce over ``dp_mod_ep``; the schedule's send/recv
between neighbouring stages of a ``pp`` group; gradient clipping's norm reductions over each axis. Ranks with the
same ``dp_replicate`` and ``dp`` coordinates read the same batch.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel as vocabulary_parallel_loss

from distrain.data.sampler import Batch, step_token_count
from distrain.models.spec import spec_of
from distrain.parallelism.base import (
    LocalBackwardStrategy,
    StepResult,
    StrategyContext,
)
from distrain.parallelism.capabilities import Capabilities
from distrain.parallelism.checks import check_mesh
from distrain.parallelism.context import ContextParallel, shard_sequence
from distrain.parallelism.fsdp import shard_blocks_and_root
from distrain.parallelism.gradients import clip_grad_norm_across_meshes
from distrain.parallelism.layout import Layout
from distrain.parallelism.pipeline import PipelineStrategy
from distrain.parallelism.tensor import parallelize_model
from distrain.precision.policy import PrecisionPolicy

if TYPE_CHECKING:
    from typing import Unpack

AXES = ("pp", "dp", "tp")  # always in the mesh, even at degree 1


def build_mesh(degrees: Layout, device_type: str, dp_mode: str = "fsdp") -> DeviceMesh:
    """The (pp, dp, tp) mesh over all ranks (collective: creates one process group per axis slice). With
    ``dp_mode="replicate"`` a ``dp_shard`` axis of size 1 follows ``dp``: FSDP2 over (dp, dp_shard) replicates over
    ``dp`` and shards over nothing. With ``degrees.replicate > 1`` a ``dp_replicate`` axis precedes ``dp``: FSDP2 over
    (dp_replicate, dp) shards within each ``dp`` group and replicates across them (HSDP). With ``degrees.cp > 1`` a
    ``cp`` axis sits between ``dp`` and ``tp``, and ``dp`` x ``cp`` is also flattened into ``dp_cp``: the ranks
    FSDP shards over (the cp ranks of a batch hold one model copy, so their gradients are averaged too). With
    ``degrees.ep > 1`` the dp axis is built as (``dp_mod_ep``, ``ep``) and flattened back into ``dp``: ``ep`` groups
    neighbouring dp ranks that split the experts, ``dp_mod_ep`` joins the ranks holding the same experts."""
    if dp_mode == "replicate":
        shape, names = (degrees.pp, degrees.dp, 1, degrees.tp), ("pp", "dp", "dp_shard", "tp")
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    data = [("dp", degrees.dp)] if degrees.ep == 1 else [("dp_mod_ep", degrees.dp // degrees.ep), ("ep", degrees.ep)]
    axes = [("pp", degrees.pp), ("dp_replicate", degrees.replicate), *data, ("cp", degrees.cp)]
    axes = [(name, size) for name, size in axes if size > 1 or name in (*AXES, "dp_mod_ep")] + [("tp", degrees.tp)]
    mesh = init_device_mesh(device_type, tuple(size for _, size in axes), mesh_dim_names=tuple(n for n, _ in axes))
    if degrees.ep > 1:
        mesh["dp_mod_ep", "ep"]._flatten("dp")
    if degrees.cp > 1:
        mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def axes(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """``mesh[names]``, flattened axes (``dp`` under ep, ``dp_cp``) included. torch 2.13 warns on every slice of a
    flattened axis from the root mesh that this will be deprecated; the slice is the mesh ``_flatten`` built, and no
    replacement API exists in this version, so the warning is silenced here only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?i).*flatten")
        return mesh[names[0] if len(names) == 1 else names]


def compose(
    module: nn.Module,
    mesh: DeviceMesh,
    degrees: Layout,
    precision: PrecisionPolicy,
    stage: int,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    cpu_offload: bool = False,
) -> nn.Module:
    """Tensor parallelism on ``tp``, the experts split on ``ep``, then FSDP on ``dp`` (``dp_cp`` with context
    parallelism; sharded, or replicated when the mesh has a ``dp_shard`` axis), in place; axes of degree 1 are
    skipped. The tensor options need a whole model (validation refuses them for pipeline stages); ``cpu_offload``
    keeps FSDP's shards in CPU memory."""
    if degrees.tp > 1:
        parallelize_model(module, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    shard = "dp_cp" if degrees.cp > 1 else "dp"  # the ranks sharing one model copy's parameters
    ignored: set[nn.Parameter] = set()
    if degrees.ep > 1:  # before FSDP, which then leaves the experts (DTensors on the ep axis) alone
        plan = spec_of(module).expert_parallel
        replicas = mesh["dp_mod_ep"].get_group() if degrees.dp > degrees.ep else None
        plan.parallelize(module, mesh["ep"], replicas)
        ignored = plan.parameters(module)
    if degrees.dp > 1 and "dp_shard" in (mesh.mesh_dim_names or ()):
        shard_blocks_and_root(module, mesh["dp", "dp_shard"], precision, stage=2)
    elif degrees.replicate > 1:  # HSDP: gradients reduce-scattered within dp, then all-reduced across replicas
        sharded = axes(mesh, "dp_replicate", shard)
        shard_blocks_and_root(module, sharded, precision, stage=stage, cpu_offload=cpu_offload, ignored_params=ignored)
    elif degrees.dp * degrees.cp > 1 or cpu_offload:  # offload needs FSDP even over one rank (one GPU)
        shard_blocks_and_root(
            module, axes(mesh, shard), precision, stage=stage, cpu_offload=cpu_offload, ignored_params=ignored
        )
    return module


class MeshSettings(TypedDict, total=False):
    """The mesh's keys of ``parallelism=hybrid`` (and its presets), as the config and ``HybridStrategy`` take them.

    dp_replicate: copies of the model's FSDP groups (HSDP: shard within a group of ``dp`` ranks, replicate across
        groups); -1: one per node.
    dp: data-parallel (FSDP sharding) degree; -1: world size / (dp_replicate x cp x tp x pp).
    tp: tensor-parallel degree (heads and MLP units split); -1 as dp (one of dp, tp, pp may be -1).
    pp: pipeline-parallel degree (stages); -1 as dp.
    cp: context-parallel degree: every sequence split over ``cp`` ranks, load-balanced
        (``distrain.parallelism.context``); ``pp == 1`` only.
    ep: expert-parallel degree: the experts split over ``ep`` of the dp ranks, token-slots sent to their expert's
        rank by all-to-all (the model spec's ``expert_parallel`` plan); FSDP shards the rest over dp.
    fsdp_stage: FSDP sharding on the dp axis: 2 keeps gathered parameters from forward to backward, 3 frees them.
    dp_mode: ``fsdp`` shards parameters, gradients and optimizer state over dp (reduce-scatter of gradients);
        ``replicate`` keeps them whole on every dp rank and all-reduces gradients once per step: DDP's semantics,
        through FSDP2's replicate dimension (the one data-parallel wrapper that composes with DTensor tensor
        parallelism and pipeline stages).
    cpu_offload: FSDP's parameter, gradient and optimizer shards kept in CPU memory (GPU runs only).
    stage: the old name of ``fsdp_stage``; it wins when set.
    """

    dp_replicate: int
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    fsdp_stage: int
    dp_mode: str
    cpu_offload: bool
    stage: int | None


@dataclass(frozen=True)
class ConfiguredMesh:
    """The configured degrees (``dp=-1``: the rest of the world size) and how the dp axis holds the model."""

    dp: int
    tp: int
    pp: int
    dp_mode: str
    fsdp_stage: int
    dp_replicate: int = 1
    cp: int = 1
    ep: int = 1
    cpu_offload: bool = False

    @classmethod
    def from_settings(cls, settings: Any, *, with_experts: bool = True) -> ConfiguredMesh:
        """From a ``parallelism`` config node or ``HybridStrategy``'s mesh keywords (``MeshSettings``; a key left
        out takes the schema's default). Without ``with_experts`` ep is 1 (its own check names it)."""
        unknown = set(settings) - set(MeshSettings.__annotations__) if isinstance(settings, dict) else set()
        if unknown:
            raise TypeError(f"HybridStrategy got unexpected keyword arguments {sorted(unknown)}")
        stage = settings.get("stage")
        return cls(
            dp=int(settings.get("dp", 1)),
            tp=int(settings.get("tp", 1)),
            pp=int(settings.get("pp", 1)),
            dp_mode=str(settings.get("dp_mode", "fsdp")),
            fsdp_stage=int(settings.get("fsdp_stage", 3) if stage is None else stage),
            dp_replicate=int(settings.get("dp_replicate", 1)),
            cp=int(settings.get("cp", 1)),
            ep=int(settings.get("ep", 1)) if with_experts else 1,
            cpu_offload=bool(settings.get("cpu_offload", False)),
        )

    def degrees(self, world_size: int, ranks_per_node: int | None) -> Layout:
        return Layout.resolve(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            world_size=world_size,
            replicate=self.dp_replicate,
            ranks_per_node=ranks_per_node,
            cp=self.cp,
            ep=self.ep,
            dp_holds="shard" if self.dp_mode == "fsdp" else "replicate",
            sharding_stage=self.fsdp_stage if self.dp_mode == "fsdp" else None,
        )

    def build(self, world_size: int, device_type: str, ranks_per_node: int | None = None) -> tuple[DeviceMesh, Layout]:
        """The degrees for ``world_size`` ranks and their mesh (collective)."""
        degrees = self.degrees(world_size, ranks_per_node)
        return build_mesh(degrees, device_type, self.dp_mode), degrees


def data_parallel_rank(mesh: DeviceMesh, degrees: Layout) -> int:
    """This rank's index among the ranks reading different data: replica-major, then its place in the dp group."""
    replica = mesh["dp_replicate"].get_local_rank() if degrees.replicate > 1 else 0
    return replica * degrees.dp + axes(mesh, "dp").get_local_rank()


def HybridStrategy(  # noqa: N802 - the config's target, named like the other strategies
    *,
    name: str = "hybrid",
    sequence_parallel: bool,
    loss_parallel: bool,
    schedule: str,
    pipeline_microbatches: int,
    virtual_stages: int,
    split_points: list[int],
    recompute_stages: list[int],
    microbatches: int | None = None,
    activation_checkpointing: list[int] | None = None,
    **mesh: Unpack[MeshSettings],
) -> PipelineStrategy | LocalBackwardStrategy:
    """A pipeline of composed stages when ``pp != 1`` (-1: the ranks the other degrees leave, even one), else one
    composed model driven like the other local-backward strategies; the mesh (``MeshSettings``: its degrees and how
    dp holds the model) is built at setup, when the world size is known.

    Args:
        sequence_parallel, loss_parallel: tensor parallelism's options (``pp == 1`` only).
        schedule, pipeline_microbatches, virtual_stages, split_points, recompute_stages: the pipeline's,
            as in ``parallelism=pipeline``.
        microbatches, activation_checkpointing: the old names of ``pipeline_microbatches`` and
            ``recompute_stages``; they win when set.

    ``parallelism=fsdp``, ``hsdp``, ``tensor`` and ``pipeline`` are presets of this strategy (config files that set
    the degrees: fsdp ``dp=-1``; hsdp ``dp_replicate=-1 dp=-1``; tensor ``dp=1 tp=-1``; pipeline ``dp=1 pp=-1``).
    """
    configured = ConfiguredMesh.from_settings(mesh)
    if configured.pp != 1:  # -1: a pipeline over the ranks the other degrees leave
        return _ComposedPipeline(
            configured,
            name=name,
            schedule=schedule,
            microbatches=pipeline_microbatches if microbatches is None else microbatches,
            virtual_stages=virtual_stages,
            split_points=split_points,
            recompute_stages=recompute_stages if activation_checkpointing is None else activation_checkpointing,
        )
    return _ComposedModel(configured, name=name, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def resolve_hybrid_layout(
    parallelism: Any, world_size: int, ranks_per_node: int | None = None, *, with_experts: bool = True
) -> Layout:
    """The layout a ``parallelism=hybrid`` config (or a preset of it) resolves to; ValueError when its degrees do not
    fit ``world_size``. The same resolution the strategy's setup makes (``ConfiguredMesh.degrees``)."""
    configured = ConfiguredMesh.from_settings(parallelism, with_experts=with_experts)
    return configured.degrees(world_size, ranks_per_node)


# Any ranks, DCP checkpoints that reshard; inside a replica group when it has no pipeline stages (ft's check).
HybridStrategy.capabilities = Capabilities(device_mesh=True, replica_groups=True)
HybridStrategy.resolve_layout = resolve_hybrid_layout
HybridStrategy.check_config = check_mesh  # its own checks before any rank starts


class _ComposedModel(LocalBackwardStrategy):
    """pp == 1: the whole model, tensor-parallel on ``tp``, its experts split on ``ep``, FSDP-sharded (or replicated)
    on ``dp`` (x ``cp``), each sequence split over ``cp``."""

    def __init__(self, configured: ConfiguredMesh, *, name: str, sequence_parallel: bool, loss_parallel: bool) -> None:
        self.name, self.sequence_parallel, self.loss_parallel = name, sequence_parallel, loss_parallel
        self.configured = configured

    def loss_context(self) -> AbstractContextManager[None]:
        return vocabulary_parallel_loss() if self.loss_parallel else contextlib.nullcontext()

    def setup(self, model: nn.Module, ctx: StrategyContext) -> None:
        self.mesh, self.degrees = self.configured.build(
            ctx.env.world_size, ctx.env.device.type, ctx.env.local_world_size
        )
        super().setup(model, ctx)

    def wrap(self, model: nn.Module, ctx: StrategyContext) -> nn.Module:
        if self.degrees.cp > 1:
            cp_axis = self.mesh["cp"]
            context = ContextParallel(cp_axis.get_group(), self.degrees.cp, cp_axis.get_local_rank())
            spec_of(model).context_parallel(model, context)
        return compose(
            model,
            self.mesh,
            self.degrees,
            ctx.precision,
            self.configured.fsdp_stage,
            self.sequence_parallel,
            self.loss_parallel,
            self.configured.cpu_offload,
        )

    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        step_tokens = step_token_count(micro_batches)
        return super().train_step([self._local_part(batch, step_tokens) for batch in micro_batches])

    def eval_loss(self, batch: Batch) -> tuple[torch.Tensor, int]:
        return super().eval_loss(self._local_part(batch))

    def _local_part(self, batch: Batch, step_tokens: float | None = None) -> Batch:
        """This cp rank's load-balanced share of every sequence of ``batch`` (the whole batch when cp == 1): the
        cp ranks of a batch each hold as many tokens, so the loss normalised by local tokens and averaged by FSDP
        over dp x cp is the global token mean. Under document masking each cp rank counts different tokens, so
        each divides by its share ``1 / cp`` of the step's counted tokens; the documents stay whole: attention
        needs the document of every key of the sequence."""
        if self.degrees.cp == 1:
            return batch
        cp, rank = self.degrees.cp, self.mesh["cp"].get_local_rank()
        inputs, targets = shard_sequence(batch.inputs, cp, rank), shard_sequence(batch.targets, cp, rank)
        if batch.documents is None:
            return Batch(inputs, targets)
        counted = float(batch.num_tokens) if step_tokens is None else step_tokens  # None: the batch is the step
        return replace(batch, inputs=inputs, targets=targets, step_tokens=counted / cp)

    def clip_gradients(self) -> torch.Tensor:
        """One norm over every gradient: DTensors on each mesh (FSDP's, tp's, the experts') reduced over that mesh
        by one all-reduce, plain gradients (replicated over tp) counted once. Expert gradients, outside FSDP, are
        first scaled (and reduced over their replicas) by the model's expert plan."""
        if self.degrees.ep > 1:
            spec_of(self.unwrapped).expert_parallel.sync_gradients(self.unwrapped)
        self.scaler.unscale_(self.optimizer)
        max_norm = self.ctx.grad_clip_norm if self.ctx.grad_clip_norm > 0 else math.inf
        return clip_grad_norm_across_meshes(self.model.parameters(), max_norm).detach()

    def gradient_sync(self, enabled: bool) -> AbstractContextManager[None]:
        if self.degrees.data_parallel * self.degrees.cp > 1 or self.configured.cpu_offload:  # FSDP-wrapped
            self.model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    @property
    def data_parallel(self) -> tuple[int, int]:
        return data_parallel_rank(self.mesh, self.degrees), self.degrees.data_parallel


class _ComposedPipeline(PipelineStrategy):
    """pp != 1: pipeline stages over ``pp``, each tensor-parallel on ``tp`` and FSDP-sharded (or replicated) on
    ``dp``."""

    def __init__(self, configured: ConfiguredMesh, **pipeline: Any) -> None:
        super().__init__(**pipeline)
        self.configured = configured

    def setup(self, model: nn.Module, ctx: StrategyContext) -> None:
        self.mesh, self.degrees = self.configured.build(
            ctx.env.world_size, ctx.env.device.type, ctx.env.local_world_size
        )
        super().setup(model, ctx)

    def pipeline_ranks(self, ctx: Any) -> tuple[int, int, dist.ProcessGroup | None]:
        return self.mesh["pp"].get_local_rank(), self.degrees.pp, self.mesh["pp"].get_group()

    def parallelize_stage(self, module: nn.Module) -> nn.Module:
        configured = self.configured
        return compose(
            module,
            self.mesh,
            self.degrees,
            self.ctx.precision,
            configured.fsdp_stage,
            cpu_offload=configured.cpu_offload,
        )

    @property
    def data_parallel(self) -> tuple[int, int]:
        return data_parallel_rank(self.mesh, self.degrees), self.degrees.data_parallel

    def reports_eval_loss(self) -> bool:
        # One rank per data-parallel group: all ranks of a pipeline and its tensor-parallel peers hold the same loss.
        return self.mesh["pp"].get_local_rank() == 0 and self.mesh["tp"].get_local_rank() == 0


_ComposedModel.capabilities = _ComposedPipeline.capabilities = HybridStrategy.capabilities  # what it builds, too
