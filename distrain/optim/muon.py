"""Muon: orthogonalised momentum for hidden matrices, with AdamW for every other parameter, in one optimizer, over
plain, replicated and sharded (DTensor) parameters.

The update of a Muon parameter ``W`` (a matrix, or a stack of matrices along its leading dimensions):

    buf <- lerp(buf, g, 1 - momentum)                       (an average of gradients, as torch.optim.Muon keeps it)
    u   <- lerp(g, buf, momentum) if nesterov else buf
    O   <- Newton-Schulz(u): 5 quintic iterations towards the nearest semi-orthogonal matrix (bf16 on GPUs, fp32 else)
    W   <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(rows, cols)) * O

The scale ``0.2 * sqrt(max(rows, cols))`` (Moonlight's) gives the update the root-mean-square of a typical AdamW
update (about 0.2), so Muon and the AdamW parameters share one learning rate, weight decay and schedule.

Where the Newton-Schulz work runs, and the collectives (all on the parameters' device):

- a plain parameter, ``replicated_over`` None (one process, a pipeline stage, DDP under ``comm=topk``'s update
  feedback, where each rank steps on its own gradient): on this rank, no collective;
- a plain parameter replicated over ``replicated_over`` (DDP): each rank of that group orthogonalises its share of
  the matrices (assigned by size), then one ``all_gather`` per bucket gives every rank every result, launched
  asynchronously so the next bucket's Newton-Schulz overlaps it;
- a DTensor sharded only along its stacking dimensions (experts split over ep ranks): on this rank, no collective;
- a DTensor with one ``Shard`` placement on a matrix dimension and ``Replicate`` on any other mesh dimension (FSDP2,
  HSDP, tensor parallelism): each matrix has an owner rank in that mesh dimension's group; per bucket, one
  ``all_to_all_single`` sends every shard to its owner, the owner orthogonalises the whole matrix, and a second
  ``all_to_all_single`` sends the shards of the result back. Every bucket's gather is launched first, so
  communication overlaps the owners' Newton-Schulz work;
- any other layout (a matrix sharded over two mesh dimensions, FSDP x tensor parallelism): ``full_tensor()`` on every
  rank (an all-gather over the mesh), every rank orthogonalises it and keeps its own shard.

``bytes_sent`` counts the bytes this rank's Muon collectives sent since it was last reset (its own share excluded).
A Muon parameter without a gradient counts as a zero gradient, so every rank joins every collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic of Keller Jordan's Muon: fast, not exactly orthogonal


def orthogonalize(update: Tensor, steps: int = 5) -> Tensor:
    """Newton-Schulz iteration over the last two dimensions of ``update`` (batched over any leading ones), in bf16
    on CUDA and fp32 elsewhere; returns the result in ``update``'s dtype and device."""
    x = update.to(torch.bfloat16 if update.is_cuda else torch.float32)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(update.dtype)


def update_scale(shape: Sequence[int]) -> float:
    """The factor that gives an orthogonalised update of this shape AdamW's update RMS (0.2)."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def balanced_owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """An owner rank per item, largest first to the least loaded rank (the same on every rank)."""
    load, owners = [0] * ranks, [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[index] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[index]] += sizes[index]
    return owners


def buckets(indices: Sequence[int], nbytes: Callable[[int], int], limit: int) -> list[list[int]]:
    """Consecutive runs of ``indices`` of about ``limit`` bytes each (at least one item each)."""
    runs: list[list[int]] = [[]]
    total = 0
    for index in indices:
        if runs[-1] and total + nbytes(index) > limit:
            runs.append([])
            total = 0
        runs[-1].append(index)
        total += nbytes(index)
    return [run for run in runs if run]


def chunk_sizes(length: int, ranks: int) -> list[int]:
    """How ``Shard`` splits a dimension of ``length`` over ``ranks`` (``torch.chunk``: equal ceil-sized chunks,
    the last ones shorter or empty)."""
    size = -(-length // ranks)
    return [max(0, min(size, length - rank * size)) for rank in range(ranks)]


class Muon(torch.optim.Optimizer):
    """Muon for the groups with ``use_muon`` and ``torch.optim.AdamW`` for the others, sharing one state.

    Groups carry ``weight_decay`` and, where they differ from the defaults, ``lr`` and ``use_muon``
    (``distrain.optim.groups.param_groups``); ``momentum``, ``nesterov``, ``betas`` and ``eps`` come from the
    defaults. See the module docstring for the update and where it
    runs.
    """

    def __init__(
        self,
        params: Any,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int = 5,
        bucket_bytes: int = 32 * 2**20,
        replicated_over: dist.ProcessGroup | None = None,
        foreach: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr, "weight_decay": 0.0, "use_muon": False, "momentum": momentum, "nesterov": nesterov,
            "betas": betas, "eps": eps,
        }  # fmt: skip
        super().__init__(params, defaults)
        self.ns_steps, self.bucket_bytes, self.replicated_over = ns_steps, bucket_bytes, replicated_over
        self.foreach = foreach
        self.bytes_sent = 0
        self._bind_adamw()

    def _bind_adamw(self) -> None:
        """An AdamW over this optimizer's non-Muon groups (the same dicts) and state; rebuilt after loading."""
        groups = [group for group in self.param_groups if not group["use_muon"]]
        self._adamw = None
        if groups:
            self._adamw = torch.optim.AdamW(groups, lr=groups[0]["lr"], foreach=self.foreach)
            self._adamw.param_groups, self._adamw.state = groups, self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._bind_adamw()
        self.bytes_sent = 0  # the state-initialising step a checkpoint load runs is no training step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._adamw.step()
        items = [(p, group) for group in self.param_groups if group["use_muon"] for p in group["params"]]
        updates = [self._momentum_update(p, group) for p, group in items]
        for (p, group), orthogonal in zip(items, self._orthogonalize(updates), strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(orthogonal, alpha=-group["lr"] * update_scale(p.shape))
        return loss

    def _momentum_update(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer.clone()

    # ------------------------------------------------------------------------------------ where the work runs
    def _orthogonalize(self, updates: list[Tensor]) -> list[Tensor]:
        """The orthogonalised ``updates``, each in its own layout (plain, or a DTensor with its placements). The
        path of each is decided from its type and placements alone, which every rank holding it shares, so all
        ranks run the same collectives; a path's buckets hold one dtype."""
        results: list[Tensor | None] = [None] * len(updates)
        replicated: dict[torch.dtype, list[int]] = {}
        owned: dict[tuple[Any, int, torch.dtype], list[int]] = {}
        share_work = self.replicated_over is not None and dist.get_world_size(self.replicated_over) > 1
        for index, update in enumerate(updates):
            if not isinstance(update, DTensor):
                if share_work:
                    replicated.setdefault(update.dtype, []).append(index)
                else:
                    results[index] = orthogonalize(update, self.ns_steps)
                continue
            sharded = [(dim, p) for dim, p in enumerate(update.placements) if not p.is_replicate()]
            if all(type(p) is Shard and p.dim < update.ndim - 2 for _, p in sharded):
                local = orthogonalize(update.to_local(), self.ns_steps)
                results[index] = DTensor.from_local(
                    local, update.device_mesh, update.placements, run_check=False, shape=update.shape,
                    stride=update.stride(),
                )  # fmt: skip
            elif len(sharded) == 1 and type(sharded[0][1]) is Shard:
                owned.setdefault((update.device_mesh, sharded[0][0], update.dtype), []).append(index)
            else:
                full = orthogonalize(update.full_tensor(), self.ns_steps)
                results[index] = distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)
                self.bytes_sent += update.to_local().numel() * update.element_size()  # a lower bound (ring)
        for indices in replicated.values():
            for index, result in zip(indices, self._share_replicated([updates[i] for i in indices]), strict=True):
                results[index] = result
        for (mesh, mesh_dim, _), indices in owned.items():
            for index, result in zip(indices, self._owner_exchange(updates, indices, mesh, mesh_dim), strict=True):
                results[index] = result
        return results  # type: ignore[return-value]

    def _bucketed_owners(
        self, sizes: Sequence[int], element_size: int, ranks: int
    ) -> tuple[list[list[int]], list[int]]:
        """Buckets of consecutive items, each about ``bucket_bytes`` per rank, and an owner per item balanced
        within its bucket (so a bucket's work, and an all_gather's padding, is even over the ranks)."""
        runs = buckets(range(len(sizes)), lambda i: sizes[i] * element_size, self.bucket_bytes * ranks)
        owners = [0] * len(sizes)
        for run in runs:
            for index, owner in zip(run, balanced_owners([sizes[i] for i in run], ranks), strict=True):
                owners[index] = owner
        return runs, owners

    def _share_replicated(self, updates: list[Tensor]) -> list[Tensor]:
        """Each rank of ``replicated_over`` orthogonalises its share; per bucket one ``all_gather`` (async) of the
        results, padded to the largest share of the bucket, gives every rank all of them."""
        group = self.replicated_over
        ranks, me = dist.get_world_size(group), dist.get_rank(group)
        runs, owners = self._bucketed_owners([u.numel() for u in updates], updates[0].element_size(), ranks)
        results: list[Tensor | None] = [None] * len(updates)
        pending = []
        for run in runs:
            per_rank = [[i for i in run if owners[i] == rank] for rank in range(ranks)]
            width = max(sum(updates[i].numel() for i in share) for share in per_rank)
            mine = [orthogonalize(updates[i], self.ns_steps).flatten() for i in per_rank[me]]
            padded = torch.zeros(width, dtype=updates[run[0]].dtype, device=updates[run[0]].device)
            if mine:
                padded[: sum(m.numel() for m in mine)] = torch.cat(mine)
            gathered = [torch.empty_like(padded) for _ in range(ranks)]
            pending.append((dist.all_gather(gathered, padded, group=group, async_op=True), gathered, per_rank))
            self.bytes_sent += padded.numel() * padded.element_size() * (ranks - 1)
        for work, gathered, per_rank in pending:
            work.wait()
            for rank, share in enumerate(per_rank):
                offset = 0
                for i in share:
                    results[i] = gathered[rank][offset : offset + updates[i].numel()].view_as(updates[i])
                    offset += updates[i].numel()
        return results  # type: ignore[return-value]

    def _owner_exchange(self, updates: list[Tensor], indices: list[int], mesh: Any, mesh_dim: int) -> list[Tensor]:
        """Orthogonalise the DTensors ``updates[indices]``, each ``Shard(d)`` on ``mesh_dim`` of ``mesh``: per bucket
        one ``all_to_all_single`` brings every shard to the matrix's owner, the owner orthogonalises it, a second
        one returns the shards of the result. All gathers are launched before any owner computes."""
        group, ranks, me = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        items = [updates[i] for i in indices]
        dims = [u.placements[mesh_dim].dim for u in items]
        runs, owners = self._bucketed_owners([u.numel() for u in items], items[0].element_size(), ranks)
        splits = [chunk_sizes(u.shape[d], ranks) for u, d in zip(items, dims, strict=True)]
        # A hand-made DTensor split otherwise than Shard's torch.chunk: every rank learns it (one all_reduce) and
        # raises, rather than the ranks whose shard looks right waiting in an all_to_all the others never join.
        wrong = any(u.to_local().shape[d] != split[me] for u, d, split in zip(items, dims, splits, strict=True))
        flag = torch.tensor([float(wrong)], device=items[0].to_local().device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            raise ValueError(
                "Muon: a sharded matrix is not split as Shard splits it (torch.chunk) on every rank; build sharded "
                "parameters with FSDP2, tensor parallelism or distribute_tensor"
            )

        def shard_shape(k: int, rank: int) -> list[int]:
            shape = list(items[k].shape)
            shape[dims[k]] = splits[k][rank]
            return shape

        def shard_numel(k: int, rank: int) -> int:
            return math.prod(shard_shape(k, rank))

        gathers = []
        for run in runs:
            order = [k for rank in range(ranks) for k in run if owners[k] == rank]  # grouped by destination
            send = torch.cat([items[k].to_local().flatten() for k in order])
            input_splits = [sum(shard_numel(k, me) for k in run if owners[k] == rank) for rank in range(ranks)]
            output_splits = [sum(shard_numel(k, rank) for k in run if owners[k] == me) for rank in range(ranks)]
            received = send.new_empty(sum(output_splits))
            work = dist.all_to_all_single(received, send, output_splits, input_splits, group=group, async_op=True)
            self.bytes_sent += (send.numel() - input_splits[me]) * send.element_size()
            gathers.append((run, work, received, output_splits))
        returns = []
        for run, work, received, output_splits in gathers:
            work.wait()
            mine = [k for k in run if owners[k] == me]
            sources = received.split(output_splits)
            shards: dict[int, list[Tensor]] = {k: [] for k in mine}
            for rank, source in enumerate(sources):
                pieces = source.split([shard_numel(k, rank) for k in mine])
                for k, piece in zip(mine, pieces, strict=True):
                    shards[k].append(piece.view(shard_shape(k, rank)))
            results = {
                k: orthogonalize(torch.cat(shards[k], dims[k]), self.ns_steps).split(splits[k], dims[k]) for k in mine
            }
            send = torch.cat([results[k][rank].flatten() for rank in range(ranks) for k in mine] or [received[:0]])
            input_splits = [sum(shard_numel(k, rank) for k in mine) for rank in range(ranks)]
            output_splits = [sum(shard_numel(k, me) for k in run if owners[k] == rank) for rank in range(ranks)]
            back = send.new_empty(sum(output_splits))
            work = dist.all_to_all_single(back, send, output_splits, input_splits, group=group, async_op=True)
            self.bytes_sent += (send.numel() - input_splits[me]) * send.element_size()
            returns.append((run, work, back, output_splits))
        local: dict[int, Tensor] = {}
        for run, work, back, output_splits in returns:
            work.wait()
            for rank, source in enumerate(back.split(output_splits)):
                owned_by_rank = [k for k in run if owners[k] == rank]
                sizes = [shard_numel(k, me) for k in owned_by_rank]
                for k, piece in zip(owned_by_rank, source.split(sizes), strict=True):
                    local[k] = piece.view(shard_shape(k, me))
        return [
            DTensor.from_local(
                local[k], mesh, items[k].placements, run_check=False, shape=items[k].shape, stride=items[k].stride()
            )
            for k in range(len(items))
        ]
