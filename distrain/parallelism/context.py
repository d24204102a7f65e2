"""Exact, load-balanced context-parallel attention over plain ``torch.distributed`` collectives (gloo included).

Context parallelism splits every sequence of length ``S`` over the ``cp`` ranks of a group. The sequence is cut into
``2 * cp`` equal chunks and rank ``r`` holds chunk ``r`` followed by chunk ``2 * cp - 1 - r``: under a causal mask
an early chunk has little work and a late one much, so pairing them gives every rank the same amount. Every layer but
attention is per-token and runs unchanged on the local tokens. Attention takes the all-gather form (as in the Llama 3
paper): each rank all-gathers the keys and values of the group (kv heads only, before grouped-query repetition, to
send fewer bytes), puts them in global sequence order and attends from its local queries to the whole sequence under
a mask built from global positions. The gather's backward sends each rank the gradients every rank computed for its
slice (``all_to_all``; gloo has no reduce_scatter) and sums them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def load_balanced_positions(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> Tensor:
    """The global positions (long, on ``device``) of the tokens ``rank`` of ``cp`` holds, in local order: chunk
    ``rank`` then chunk ``2 * cp - 1 - rank`` of the ``2 * cp`` equal chunks of the sequence. No collective."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} is not in [0, {cp}) for cp={cp}")
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp}: load-balanced context parallelism "
            f"cuts every sequence into 2 * cp equal chunks"
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    mirror = 2 * cp - 1 - rank
    second = torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device)
    return torch.cat((first, second))


def shard_sequence(tensor: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's part of ``tensor`` (batch, seq, ...) along the sequence dimension ``dim`` (token ids, targets),
    in the order of ``load_balanced_positions``; a copy on the tensor's device. No collective."""
    positions = load_balanced_positions(tensor.shape[dim], cp, rank, tensor.device)
    return tensor.index_select(dim, positions)


class _GatherOverGroup(torch.autograd.Function):
    """All-gather a same-shaped tensor from every rank of a group into a new leading dimension (size, *shape).

    Backward: the gradient of the stacked output is split along the leading dimension, slice ``j`` is sent to rank
    ``j`` (``all_to_all_single``), and the slices received from every rank are summed, so the local input's gradient
    is the sum over ranks of the gradient with respect to this rank's slice.
    """

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup | None, size: int) -> Tensor:
        ctx.group = group
        # Gloo takes only the concatenated form of the output (size * dim 0), so the stack is a view of it.
        gathered = local.new_empty((size * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(gathered, local.contiguous(), group=group)
        return gathered.view(size, *local.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        received = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)
        # Low-precision partial gradients from the ranks are added in fp32 (a no-op change for fp32 ones).
        return received.sum(0, dtype=torch.float32).to(grad.dtype), None, None


def gather_over_group(local: Tensor, group: dist.ProcessGroup | None, size: int) -> Tensor:
    """``local`` from every rank of ``group``, stacked in group-rank order (size, *local.shape) on the local
    tensor's device; autograd-aware (backward: ``all_to_all_single`` then a sum)."""
    return _GatherOverGroup.apply(local, group, size)


@dataclass(frozen=True)
class ContextParallel:
    """One rank's place in a context-parallel group: ``group`` (None: the default group), its ``size`` and this
    process's ``rank`` in it (the group rank, not the global one)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    def __deepcopy__(self, memo: dict[int, Any]) -> ContextParallel:
        # A process group cannot be copied; a deep-copied model must keep talking to the same ranks.
        return self

    def positions(self, local_seq_len: int, device: torch.device | str | None = None) -> Tensor:
        """Global positions (long, on ``device``) of this rank's ``local_seq_len`` tokens of a sequence of length
        ``local_seq_len * size``. No collective."""
        return load_balanced_positions(local_seq_len * self.size, self.size, self.rank, device)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, n_rep: int, scale: float, mask: Tensor | None = None
    ) -> Tensor:
        """Exact causal attention of the local queries over the whole sequence.

        ``q`` (batch, n_heads, local, head_dim) and ``k``/``v`` (batch, n_kv_heads, local, head_dim) are this rank's
        tokens, already rotated with their global positions; query head ``j`` reads kv head ``j // n_rep``. Runs one
        all-gather of the stacked k and v over ``group`` (one all-to-all in backward); every tensor stays on the
        inputs' device. ``mask`` (bool, (batch, 1, local, whole sequence) in global key order; document masking)
        replaces the causal one. Returns (batch, n_heads, local, head_dim).
        """
        if self.size == 1:  # nothing to gather: exactly the single-process attention
            keys, values = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale)
        local, device = q.shape[2], q.device
        if k.shape[2] != local or v.shape != k.shape:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} hold different tokens")
        gathered = gather_over_group(torch.stack((k, v)), self.group, self.size)  # (size, 2, b, h, local, d)
        # Concatenating the ranks' tokens gives rank order (rank r's token i at r * local + i); argsort of the
        # concatenated global positions maps each global position to its place in that order.
        held = torch.cat([load_balanced_positions(local * self.size, self.size, r, device) for r in range(self.size)])
        kv = gathered.movedim(0, 3).flatten(3, 4).index_select(3, held.argsort())
        keys, values = (t.repeat_interleave(n_rep, dim=1) for t in kv.unbind(0))
        if mask is None:
            key_positions = torch.arange(local * self.size, device=device)
            mask = self.positions(local, device)[:, None] >= key_positions[None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
