"""Per-rank memory of a strategy at a world size this machine does not have, predicted in one process.

The model is built on the meta device (shapes only, no storage), then split and sharded by the strategies' own
functions (``split_stages``, ``parallelize_model``, ``shard_blocks_and_root``, ``compose``) over a DeviceMesh of the
target size. That needs a process group of the target's world size: the caller runs this under torch's fake process
group (``dry_run.py``), whose collectives do nothing. What each rank then holds gives its parameters (the local
shard's storage, FSDP's padding included); gradients take the same bytes and optimizer state
``optimizer_bytes`` per local element. DeepSpeed cannot be built this way, so ZeRO uses the formulas of
``distrain.planning.memory.predicted_model_state``.

Activations are the bytes autograd saves in one forward of this rank's modules on a micro-batch of the configured
shape (``saved_activation_bytes``, also on the meta device, tensor-parallel shards as they are), times the pipeline
micro-batches a schedule keeps in flight on the rank. ``gathered`` is what sharded strategies hold unsharded while
computing: FSDP's and ZeRO-3's all-gathered parameters of the root and the two largest blocks (the one computing and
the one prefetched), or of every block with FSDP stage 2, which keeps them from forward to backward.

Context parallelism (``parallelism.cp``) shards the model over dp x cp (the mesh's ``dp_cp``, as ``compose`` does)
and its activations are measured on the local seq_len / cp tokens with the all-gather attention running on meta
tensors; expert parallelism (``parallelism.ep``) holds n_experts / ep experts whole (measured from the held model)
and estimates its activations from the model without EP under balanced routing. Both are described, with what they
assume, in ``distrain.planning.context_expert``.

Not predicted: the allocator's fragmentation, communication buffers, the CUDA context and kernels' workspace.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distrain.models.meta import meta_device
from distrain.models.spec import spec_of
from distrain.parallelism.capabilities import declared
from distrain.parallelism.hybrid import build_mesh, compose
from distrain.parallelism.layout import Layout
from distrain.parallelism.pipeline import PipelineStrategy, rank_stages, split_stages
from distrain.parallelism.recompute import apply_activation_checkpointing, saved_activation_bytes
from distrain.parallelism.zero import ZeroStrategy
from distrain.planning.context_expert import not_gathered, whole_model_activations
from distrain.planning.memory import local, predicted_model_state
from distrain.precision.policy import PrecisionPolicy

ModelFactory = Callable[[], nn.Module]  # builds the model with activation checkpointing applied, on any device


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes one rank holds (``ranks`` says which ranks the row stands for)."""

    ranks: str
    params: int
    grads: int
    optimizer: int
    gathered: int  # parameters all-gathered for compute (FSDP, ZeRO-3), held only while computing
    activations: int  # saved for backward, at the schedule's peak
    buffers: int = 0  # communication buckets the strategy allocates (ZeRO's gradient buckets)

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_state + self.gathered + self.activations + self.buffers

    def as_dict(self) -> dict[str, object]:
        return asdict(self) | {"model_state": self.model_state, "total": self.total}


@dataclass(frozen=True)
class Workload:
    """What one optimizer step puts through each data-parallel replica."""

    micro_batch_size: int  # sequences per rank per micro-step
    grad_accum_steps: int
    seq_len: int
    optimizer_bytes: int  # optimizer state per parameter (AdamW 8, SGD with momentum 4)


@dataclass(frozen=True)
class _PlanInput:
    """A torch-native strategy as mesh degrees and how its data-parallel axis holds the model."""

    degrees: Layout
    dp_holds: str  # replicate (DDP, FSDP2's replicate) | shard (FSDP2)
    fsdp_stage: int = 3
    sequence_parallel: bool = False
    loss_parallel: bool = False
    pipeline: PipelineStrategy | None = None


def _plan_input(strategy: object, layout: Layout) -> _PlanInput:
    """What the planner needs of a torch-native strategy: its resolved layout and its tensor and pipeline options."""
    return _PlanInput(
        layout,
        layout.dp_holds,
        layout.sharding_stage or 3,
        sequence_parallel=bool(getattr(strategy, "sequence_parallel", False)),
        loss_parallel=bool(getattr(strategy, "loss_parallel", False)),
        pipeline=strategy if isinstance(strategy, PipelineStrategy) else None,
    )


def predict_rank_memory(
    strategy: object,
    *,
    layout: Layout,
    new_model: ModelFactory,
    precision: PrecisionPolicy,
    workload: Workload,
) -> list[RankMemory]:
    """Predicted memory of every distinct kind of rank of ``strategy`` (an instantiated ``parallelism`` target) in
    ``layout`` (its config's, resolved for the target): one row, or one per pipeline rank. Needs a default process
    group of the layout's world size (the fake one: no collective runs) for all but the replicated layouts and ZeRO."""
    if declared(strategy).deepspeed_optimizer:
        return [_zero(strategy, new_model, layout.world_size, precision, workload)]
    layout = _plan_input(strategy, layout)
    mesh = None
    if layout.degrees.tp > 1 or layout.degrees.pp > 1 or layout.dp_holds == "shard":
        mesh = build_mesh(layout.degrees, "cpu", "fsdp" if layout.dp_holds == "shard" else "replicate")
    pipeline = layout.pipeline
    ranks = layout.degrees.pp
    stages_total = ranks * (pipeline.virtual_stages if pipeline else 1)
    rows = []
    for pp_rank in range(ranks):
        held = _rank_modules(new_model, layout, pp_rank, stages_total, precision, mesh, shard=True)
        computing = _rank_modules(new_model, layout, pp_rank, stages_total, precision, mesh, shard=False)
        elements, params = _local_elements_and_bytes(held)
        gathered = _gathered_bytes(computing, layout, skip=not_gathered(computing[0], held[0], layout.degrees))
        if pipeline:
            in_flight = _in_flight(pipeline, ranks, pp_rank)
            sequences = workload.micro_batch_size * workload.grad_accum_steps // pipeline.microbatches
            per_micro_batch = max(
                _activation_bytes(module, sequences, workload.seq_len, precision) for module in computing
            )
            activations = in_flight * per_micro_batch
            label = f"pipeline rank {pp_rank} (stages {', '.join(map(str, rank_stages(pp_rank, ranks, stages_total)))})"
        else:
            activations = whole_model_activations(
                computing[0],
                held[0],
                layout.degrees,
                mesh,
                workload.seq_len,
                precision,
                lambda module, seq_len: _activation_bytes(module, workload.micro_batch_size, seq_len, precision),
            )
            sharded = layout.dp_holds == "shard" and layout.degrees.dp * layout.degrees.cp * layout.degrees.tp > 1
            label = "every rank (rank 0's shard, the largest)" if sharded else "every rank"
        rows.append(
            RankMemory(
                ranks=label,
                params=params,
                grads=params,
                optimizer=elements * workload.optimizer_bytes,
                gathered=gathered,
                activations=activations,
            )
        )
    return rows


def _rank_modules(
    new_model: ModelFactory,
    layout: _PlanInput,
    pp_rank: int,
    stages_total: int,
    precision: PrecisionPolicy,
    mesh: DeviceMesh | None,
    *,
    shard: bool,
) -> list[nn.Module]:
    """This pipeline rank's modules on the meta device, tensor-parallel on ``tp`` and, with ``shard``, held on the
    data-parallel axis as the strategy holds them at rest. Without ``shard``: as they compute (parameters in the
    compute dtype, whole over ``dp``)."""
    with meta_device():
        model = new_model()
    if not shard and precision.uses_autocast:
        model = model.to(precision.compute_dtype)  # activations in the compute dtype, as under autocast
    pipeline = layout.pipeline
    if pipeline:
        indices = rank_stages(pp_rank, layout.degrees.pp, stages_total)
        modules: list[nn.Module] = split_stages(model, stages_total, pipeline.split_points, indices)
        for index, module in zip(indices, modules, strict=True):
            if index in pipeline.recompute_stages:
                apply_activation_checkpointing(module, "full")
    else:
        modules = [model]
    if mesh is None:
        return modules
    degrees = layout.degrees
    if not shard:
        degrees = Layout(pp=degrees.pp, dp=1, tp=degrees.tp)
    for module in modules:
        compose(
            module,
            mesh,
            degrees,
            precision,
            layout.fsdp_stage,
            sequence_parallel=layout.sequence_parallel,
            loss_parallel=layout.loss_parallel,
        )
    return modules


def _local_elements_and_bytes(modules: Sequence[nn.Module]) -> tuple[int, int]:
    """Elements of this rank's parameter shards, and the bytes of the storage behind them (FSDP pads each shard
    to an equal share of dim 0)."""
    elements = nbytes = 0
    for module in modules:
        for parameter in module.parameters():
            shard = local(parameter)
            elements += shard.numel()
            nbytes += max(shard.untyped_storage().nbytes(), shard.numel() * shard.element_size())
    return elements, nbytes


def _whole_bytes(module: nn.Module, skip: Collection[int] = ()) -> int:
    return sum(local(p).numel() * local(p).element_size() for p in module.parameters() if id(p) not in skip)


def _gathered_bytes(computing: Sequence[nn.Module], layout: _PlanInput, skip: Collection[int] = ()) -> int:
    """FSDP's all-gathered parameters (in the compute dtype) while a rank computes: the root's, plus the two largest
    blocks' (stage 3) or every block's (stage 2). FSDP shards over dp x cp; the parameters of ``skip`` (ids: the
    experts under ep) are not FSDP's to gather."""
    if layout.dp_holds != "shard" or layout.degrees.dp * layout.degrees.cp == 1:
        return 0
    total = 0
    for module in computing:  # already in the compute dtype
        units = spec_of(module).block_modules(module).values()
        blocks = sorted((_whole_bytes(block, skip) for block in units), reverse=True)
        root = _whole_bytes(module, skip) - sum(blocks)
        total += root + (sum(blocks) if layout.fsdp_stage == 2 else sum(blocks[:2]))
    return total


def _in_flight(pipeline: PipelineStrategy, ranks: int, pp_rank: int) -> int:
    """Micro-batches whose activations a pipeline rank holds at the schedule's peak: GPipe all of them, 1F1B its
    warm-up forwards plus one, interleaved 1F1B the warm-up of torch's schedule (in stage chunks)."""
    m = pipeline.microbatches
    if pipeline.schedule_name == "gpipe":
        return m
    if pipeline.schedule_name == "1f1b":
        return min(m, ranks - pp_rank)
    v = pipeline.virtual_stages
    return min(v * m, 2 * (ranks - pp_rank - 1) + (v - 1) * ranks + 1)


def _activation_bytes(module: nn.Module, sequences: int, seq_len: int, precision: PrecisionPolicy) -> int:
    """Bytes saved for backward by one forward (and the loss, on a stage with the head) of ``sequences``."""
    spec = spec_of(module)
    if spec.is_first_stage(module):
        inputs = torch.zeros(sequences, seq_len, dtype=torch.long, device="meta")
    else:
        width = spec.hidden_width(module)
        dtype = precision.compute_dtype if precision.uses_autocast else torch.float32
        inputs = torch.zeros(sequences, seq_len, width, dtype=dtype, device="meta", requires_grad=True)
    targets = torch.zeros(sequences, seq_len, dtype=torch.long, device="meta")
    loss = (lambda logits: spec.loss(logits, targets)) if spec.is_last_stage(module) else None
    return saved_activation_bytes(module, inputs, loss=loss, backward=False)


def _zero(
    strategy: ZeroStrategy,
    new_model: ModelFactory,
    world_size: int,
    precision: PrecisionPolicy,
    workload: Workload,
) -> RankMemory:
    with meta_device():
        model = new_model()
    num_params = sum(p.numel() for p in model.parameters())
    low_precision = precision.uses_autocast
    state = predicted_model_state(
        strategy="zero",
        stage=strategy.stage,
        num_params=num_params,
        world_size=world_size,
        optimizer_bytes=workload.optimizer_bytes,
        low_precision=low_precision,
        master_copy=True,
    )
    gathered = 0
    if strategy.stage == 3:
        param_bytes = 2 if low_precision else 4
        units = spec_of(model).block_modules(model).values()
        blocks = sorted((sum(p.numel() for p in b.parameters()) for b in units), reverse=True)
        gathered = (num_params - sum(blocks) + sum(blocks[:2])) * param_bytes
    if low_precision:
        model = model.to(precision.compute_dtype)
    activations = _activation_bytes(model, workload.micro_batch_size, workload.seq_len, precision)
    # The gradient bucket backward fills, in the gradients' dtype: two with overlap_comm below stage 3; DeepSpeed
    # uses it whenever gradients are contiguous, which offloading the optimizer forces.
    settings = strategy.sized_to(num_params)
    count = 2 if settings["overlap_comm"] and strategy.stage < 3 else 1
    buckets = count * settings["reduce_bucket_size"] * (2 if low_precision else 4)
    contiguous = settings["contiguous_gradients"] or "offload_optimizer" in settings
    return RankMemory(
        ranks="every rank",
        params=state.params,
        grads=state.grads,
        optimizer=state.optimizer,
        gathered=gathered,
        activations=activations,
        buffers=buckets if contiguous else 0,
    )
