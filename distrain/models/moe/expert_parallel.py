"""Expert parallelism (EP) for the mixture-of-experts model: the experts split over the ranks of an ep mesh.

Rank e of the ep group holds experts ``[e * E / ep, (e + 1) * E / ep)``. Every rank routes its own tokens (the ep ranks
are data-parallel ranks reading different data), sends each token-slot to the rank holding its expert (dispatch, an
all-to-all), runs its local experts on what it received, and a second all-to-all returns the results (combine), which
the layer weights by the gates and sums into the token outputs as without EP. The routing statistics and the auxiliary
loss stay this rank's own.

What a training strategy does, in this order:

1. build and initialise the full model (same seed on every rank), then ``parallelize_experts(model, ep_mesh,
   replicas_group)``: the expert weights become ``DTensor`` parameters ``Shard(0)`` on the 1-D ``ep_mesh``, sliced
   from the full weights (no communication), so torch.distributed.checkpoint saves and reshards them;
2. shard the rest with FSDP2 over the whole data-parallel mesh (which includes the ep ranks), passing
   ``ignored_params=expert_parameters(model)`` to every ``fully_shard`` call;
3. after the backward of the last micro-batch of a step, call ``sync_expert_gradients(model)``, then clip with
   ``distrain.parallelism.base.clip_grad_norm_across_meshes`` (torch's refuses gradients on two meshes), then step
   the optimizer;
4. to log: ``last_tokens_per_expert`` of each layer (this rank's routed slots per global expert, as without EP) and
   ``all_to_all_bytes(model)`` (bytes this rank sent since the last call).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from distrain.models.moe.model import MoEFeedForward

EXPERT_WEIGHTS = ("w1", "w3", "w2")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows (dim 0) over the ep group; its backward sends the gradients back along the same
    routes (the same collective with the splits swapped). Tensors stay on their device (CPU with gloo)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, rows: Tensor, output_splits: list[int], input_splits: list[int], state: ExpertParallel
    ) -> Tensor:
        ctx.output_splits, ctx.input_splits, ctx.state = output_splits, input_splits, state
        return state.exchange(rows, output_splits, input_splits)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.state.exchange(grad, ctx.input_splits, ctx.output_splits), None, None, None


class ExpertParallel:
    """The EP state of one ``MoEFeedForward`` (its ``expert_parallel`` attribute): the ep group, this rank's place in
    it, the group of ranks holding the same experts, and the count of bytes this rank sent.

    Args:
        ep_mesh: 1-D mesh of the ranks sharing the experts.
        replicas_group: the ranks holding the same experts as this one (one per ep group, dp / ep of them), or None
            when dp == ep.
    """

    def __init__(self, ep_mesh: DeviceMesh, replicas_group: dist.ProcessGroup | None = None) -> None:
        if ep_mesh.ndim != 1:
            raise ValueError(f"the ep mesh must be 1-D, not {ep_mesh.ndim}-D")
        self.mesh, self.group = ep_mesh, ep_mesh.get_group()
        self.size, self.rank = ep_mesh.size(), ep_mesh.get_local_rank()
        self.replicas_group = replicas_group
        self.replicas = 1 if replicas_group is None else dist.get_world_size(replicas_group)
        self.bytes_sent = 0  # summed over forwards and backwards until all_to_all_bytes resets it

    def exchange(self, rows: Tensor, output_splits: list[int], input_splits: list[int]) -> Tensor:
        """One ``all_to_all_single`` over the ep group: ``input_splits[r]`` rows of ``rows`` go to rank r, and
        ``output_splits[r]`` rows come from it; the bytes leaving this rank are counted (its own share stays)."""
        rows = rows.contiguous()
        received = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(received, rows, output_splits, input_splits, group=self.group)
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        self.bytes_sent += (rows.shape[0] - input_splits[self.rank]) * row_bytes
        return received

    def dispatch_and_combine(self, module: MoEFeedForward, grouped: Tensor, counts: Tensor) -> Tensor:
        """The experts' outputs for this rank's token-slots ``grouped`` (slots, d_model), sorted by global expert
        with ``counts`` (n_experts,) slots each; the result has the same rows in the same order.

        Collectives over the ep group: one all-to-all of the counts, then the dispatch and combine all-to-alls (and
        their two mirror images in backward). One host sync for the splits.
        """
        local = module.n_experts // self.size
        sent_counts = counts.view(self.size, local)  # row r: the slots for rank r's experts
        received_counts = torch.empty_like(sent_counts)  # row s: the slots source s sends to this rank's experts
        dist.all_to_all_single(received_counts, sent_counts, group=self.group)
        self.bytes_sent += (self.size - 1) * local * counts.element_size()
        send_splits = sent_counts.sum(dim=1).tolist()
        received_per_source, received_per_expert = received_counts.sum(dim=1), received_counts.sum(dim=0)
        receive_splits = received_per_source.tolist()

        received = _AllToAll.apply(grouped, receive_splits, send_splits, self)
        # The rows arrive source-major; sorted by local expert (stable: source order within each), every expert runs
        # one matmul on all its rows, in the order one process would see them with the batches concatenated.
        expert_of_row = torch.arange(local, device=counts.device).repeat(self.size)
        expert_of_row = expert_of_row.repeat_interleave(received_counts.flatten())
        order = expert_of_row.argsort(stable=True)
        weights = tuple(getattr(module, name).to_local() for name in EXPERT_WEIGHTS)
        out = module._experts(received.index_select(0, order), received_per_expert.tolist(), weights)
        out = torch.zeros_like(out).index_copy(0, order, out)  # back to source-major, as the senders expect
        return _AllToAll.apply(out, send_splits, receive_splits, self)


def _ep_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward) and m.expert_parallel is not None]


@torch.no_grad()
def parallelize_experts(model: nn.Module, ep_mesh: DeviceMesh, replicas_group: dist.ProcessGroup | None = None) -> None:
    """Put every ``MoEFeedForward`` of ``model`` into EP mode, in place: ``w1``, ``w3`` and ``w2`` become DTensor
    parameters ``Shard(0)`` on ``ep_mesh``, each rank keeping its own experts sliced from the full-size weights (no
    collective: every rank must hold the same initialised full weights, e.g. from one seed).

    Call it on the materialised, initialised model, before ``fully_shard``. ``replicas_group``: see
    ``ExpertParallel`` (needed when the data-parallel degree is a multiple k > 1 of ep).
    """
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not layers:
        raise ValueError("the model holds no MoEFeedForward layer")
    for layer in layers:
        if layer.expert_parallel is not None:
            raise ValueError("parallelize_experts was already applied to this model")
        if layer.n_experts % ep_mesh.size():
            raise ValueError(f"{layer.n_experts} experts do not split evenly over ep = {ep_mesh.size()} ranks")
        for name in EXPERT_WEIGHTS:
            full = getattr(layer, name)
            # src_data_rank=None: each rank slices its own shard of its own copy, without a scatter from rank 0.
            shard = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(layer, name, nn.Parameter(shard, requires_grad=full.requires_grad))
        layer.expert_parallel = ExpertParallel(ep_mesh, replicas_group)


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The expert weights of ``model``'s layers in EP mode: pass them to FSDP2 as ``fully_shard(...,
    ignored_params=...)``, which leaves them alone (no sharding over dp, no gradient reduction)."""
    return {getattr(layer, name) for layer in _ep_layers(model) for name in EXPERT_WEIGHTS}


@torch.no_grad()
def sync_expert_gradients(model: nn.Module) -> None:
    """Scale the expert gradients to the gradient of the mean over the data-parallel ranks' objectives, in place.

    Through the all-to-all backward an owner's expert gradient already sums the contributions of every ep rank's
    tokens: it is divided by ep. When the dp ranks form k > 1 ep groups, the k ranks holding the same experts first
    sum theirs (one all_reduce over the replicas group of all layers' gradients flattened; tensors on their device)
    and divide by dp = k * ep. Call once per optimizer step, after the last backward, before clipping. A missing
    gradient (an expert layer without backward) counts as zero, so every replica joins the all_reduce.
    """
    layers = _ep_layers(model)
    if not layers:
        return
    state = layers[0].expert_parallel
    params = [getattr(layer, name) for layer in layers for name in EXPERT_WEIGHTS]
    params = [param for param in params if param.requires_grad]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    grads = [param.grad.to_local() for param in params]
    scale = 1.0 / (state.size * state.replicas)
    if state.replicas_group is None:
        torch._foreach_mul_(grads, scale)
        return
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat, group=state.replicas_group)
    flat.mul_(scale)
    for grad, piece in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
        grad.copy_(piece.view_as(grad))


def all_to_all_bytes(model: nn.Module, reset: bool = True) -> int:
    """Bytes this rank sent to the other ep ranks (token rows, their gradients and the counts; its own share is a
    local copy) over all EP layers since the last reset: read once per step it covers every forward and backward of
    the step (micro-batches and recomputed forwards included). Host-side counters: no sync, no collective."""
    layers = _ep_layers(model)
    total = sum(layer.expert_parallel.bytes_sent for layer in layers)
    if reset:
        for layer in layers:
            layer.expert_parallel.bytes_sent = 0
    return total
