"""Deterministic global batches, sharded over data-parallel ranks and micro-steps.

Every optimizer step consumes one *global batch* of ``micro_batch_size * grad_accum_steps * dp_size`` sequences,
drawn without replacement from a per-epoch permutation seeded by ``(seed, epoch)``. The global batch is laid out
as ``[micro_step][dp_rank][sample]``, so the union of what all ranks see in one step does not depend on how it is
split: 2 ranks x batch b, or 1 rank x 2 accumulation steps x batch b, or 1 rank x batch 2b train on the same
sequences. Within an epoch no sequence is seen twice; the tail that does not fill a global batch is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Batch:
    """One micro-batch: ``inputs`` and ``targets`` (next tokens), both int64 of shape (batch, seq)."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.targets.numel()

    def to(self, device: torch.device) -> Batch:
        return Batch(self.inputs.to(device, non_blocking=True), self.targets.to(device, non_blocking=True))


class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a 1-D stream; window i starts at ``i * seq_len``."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.offsets = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def batch(self, indices: torch.Tensor) -> Batch:
        windows = self.tokens[indices[:, None] * self.seq_len + self.offsets].long()
        return Batch(inputs=windows[:, :-1], targets=windows[:, 1:])


class GlobalBatchSampler:
    """Yields this rank's micro-batch indices for each optimizer step; its position can be saved and restored.

    Args:
        num_samples: windows in the dataset.
        micro_batch_size: sequences per rank per micro-step.
        grad_accum_steps: micro-steps per optimizer step.
        dp_rank: this rank's index on the data-parallel axis.
        dp_size: number of data-parallel ranks.
        seed: shuffling seed; epoch e uses the permutation of generator seed ``seed * 1_000_003 + e``.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        self.num_samples, self.micro_batch_size, self.grad_accum_steps = (
            num_samples,
            micro_batch_size,
            grad_accum_steps,
        )
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.global_batch_size = micro_batch_size * grad_accum_steps * dp_size
        if num_samples < self.global_batch_size:
            raise ValueError(
                f"dataset has {num_samples} sequences, fewer than one global batch of {self.global_batch_size}"
            )
        self.epoch, self.samples_in_epoch = 0, 0
        self._permutation = self._permute(0)

    def _permute(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def next_step(self) -> list[torch.Tensor]:
        """Indices of this rank's ``grad_accum_steps`` micro-batches for the next optimizer step."""
        if self.samples_in_epoch + self.global_batch_size > self.num_samples:
            self.epoch, self.samples_in_epoch = self.epoch + 1, 0
            self._permutation = self._permute(self.epoch)
        start = self.samples_in_epoch
        layout = self._permutation[start : start + self.global_batch_size].view(
            self.grad_accum_steps, self.dp_size, self.micro_batch_size
        )
        self.samples_in_epoch += self.global_batch_size
        return list(layout[:, self.dp_rank])

    def state_dict(self) -> dict[str, Any]:
        """The position as (epoch, samples consumed in it): valid for any batch layout, so a job resumed on a
        different number of ranks, or with another micro-batch split, continues with the next unseen sample."""
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.epoch, self.samples_in_epoch = state["seed"], state["epoch"], state["samples_in_epoch"]
        self._permutation = self._permute(self.epoch)


class TrainBatches:
    """This rank's training stream: each ``next_step()`` returns the micro-batches of one optimizer step."""

    def __init__(self, windows: TokenWindows, sampler: GlobalBatchSampler) -> None:
        self.windows, self.sampler = windows, sampler

    def next_step(self) -> list[Batch]:
        return [self.windows.batch(indices) for indices in self.sampler.next_step()]

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def validation_batches(
    windows: TokenWindows, *, micro_batch_size: int, num_batches: int, dp_rank: int, dp_size: int
) -> list[Batch]:
    """A fixed validation set, the first windows of the validation stream, split over data-parallel ranks.

    The set is the same for every run with the same batch settings, so validation losses are comparable. Every rank
    gets the same number of micro-batches (sharded strategies run collectives in each forward); a validation split
    smaller than one micro-batch per rank is used round robin, windows repeating.
    """
    per_step = micro_batch_size * dp_size
    num_batches = max(1, min(num_batches, len(windows) // per_step))
    batches = []
    for i in range(num_batches):
        start = i * per_step + dp_rank * micro_batch_size
        batches.append(windows.batch(torch.arange(start, start + micro_batch_size) % len(windows)))
    return batches
