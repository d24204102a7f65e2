"""Deterministic global batches, sharded over data-parallel ranks and micro-steps.

Every optimizer step consumes one *global batch* of ``micro_batch_size * grad_accum_steps * dp_size`` sequences,
drawn without replacement from a per-epoch permutation seeded by ``(seed, epoch)``. The global batch is laid out
as ``[micro_step][dp_rank][sample]``, so the union of what all ranks see in one step does not depend on how it is
split: 2 ranks x batch b, or 1 rank x 2 accumulation steps x batch b, or 1 rank x batch 2b train on the same
sequences. Within an epoch no sequence is seen twice; the tail that does not fill a global batch is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from distrain.errors import ArtifactError

# The target id cross-entropy skips (torch's default ``ignore_index``): a next token the loss must not count.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    """One micro-batch: ``inputs`` and ``targets`` (next tokens), both int64 of shape (batch, seq).

    With document masking (``distrain.data.packing``) ``documents`` holds each input token's document number inside
    its sequence (int64, (batch, seq)), the model's forward takes it (``model_kwargs``) to restart positions and keep
    attention inside documents, and targets across a boundary are ``IGNORE_INDEX``. ``step_tokens`` is then the
    step's counted tokens per data-parallel rank (the mean over ranks, ``distrain.data.packing.count_step_tokens``):
    what every rank divides its summed loss by.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    documents: torch.Tensor | None = None
    step_tokens: float | None = None

    @property
    def num_tokens(self) -> int:
        """The targets the loss counts."""
        if self.documents is None:
            return self.targets.numel()
        return int((self.targets != IGNORE_INDEX).sum())

    @property
    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """What the model's forward takes besides the inputs."""
        return {} if self.documents is None else {"documents": self.documents}

    def to(self, device: torch.device) -> Batch:
        documents = None if self.documents is None else self.documents.to(device, non_blocking=True)
        inputs, targets = (t.to(device, non_blocking=True) for t in (self.inputs, self.targets))
        return replace(self, inputs=inputs, targets=targets, documents=documents)

    def pinned(self) -> Batch:
        """The batch in pinned CPU memory (an asynchronous copy to a GPU)."""
        documents = None if self.documents is None else self.documents.pin_memory()
        return replace(self, inputs=self.inputs.pin_memory(), targets=self.targets.pin_memory(), documents=documents)


def step_token_count(micro_batches: Sequence[Batch], own: bool = False) -> float:
    """What a rank divides the summed loss of a step's ``micro_batches`` by, so that the data-parallel mean of the
    ranks' gradients is the gradient of the global batch's token mean: the step's counted tokens per data-parallel
    rank when the batches carry it (document masking counts different tokens on each rank), else this rank's.
    ``own``: this rank's count whatever the batches carry (its gradient is not averaged with other ranks')."""
    given = micro_batches[0].step_tokens if micro_batches and not own else None
    return given if given is not None else sum(batch.num_tokens for batch in micro_batches)


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


class Windows(Protocol):
    """What the samplers read from: a number of windows, and a Batch of any of them."""

    def __len__(self) -> int: ...

    def batch(self, indices: torch.Tensor) -> Batch: ...


def token_windows(stream: Any, seq_len: int) -> Windows:
    """The windows of a split: an in-memory token tensor's ``TokenWindows``, or those a stream on disk makes itself
    (``distrain.data.tokens.ShardedTokens.windows``)."""
    return stream.windows(seq_len) if hasattr(stream, "windows") else TokenWindows(stream, seq_len)


def longest_window(stream: Any) -> int:
    """The longest ``seq_len`` a split's windows can have: its longest run of tokens (a shard, on disk) less one."""
    return stream.longest_run() - 1 if hasattr(stream, "longest_run") else len(stream) - 1


class GlobalBatchSampler:
    """Yields this rank's micro-batch indices for each optimizer step; its position can be saved and restored.

    Args:
        num_samples: windows in the dataset.
        micro_batch_size: sequences per rank per micro-step.
        grad_accum_steps: micro-steps per optimizer step.
        dp_rank: this rank's index on the data-parallel axis.
        dp_size: number of data-parallel ranks.
        seed: shuffling seed; epoch e uses the permutation of generator seed ``seed * 1_000_003 + e``.
        limit_batches: when > 0, only the first ``limit_batches`` global batches' worth of windows are sampled
            (``trainer.overfit_batches``): every epoch is those windows again, reshuffled.
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
        limit_batches: int = 0,
    ) -> None:
        global_batch_size = micro_batch_size * grad_accum_steps * dp_size
        if limit_batches > 0:
            num_samples = min(num_samples, limit_batches * global_batch_size)
        self.num_samples, self.micro_batch_size, self.grad_accum_steps = (
            num_samples,
            micro_batch_size,
            grad_accum_steps,
        )
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.global_batch_size = global_batch_size
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

    def fractions(self, position: dict[str, Any]) -> dict[str, float]:
        """Each source's share of the sequences drawn up to ``position`` (a mixture's ``data/<name>/fraction``):
        none for one dataset."""
        del position
        return {}

    def batch_settings(self) -> dict[str, int]:
        """The global batch and the factors it is made of (for the start-up line and ``summary.json``)."""
        return {
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "data_parallel": self.dp_size,
        }

    def describe(self, seq_len: int) -> str:
        """One line: the global batch as micro-batch x accumulation x data-parallel degree, in tokens too."""
        return (
            f"global batch {self.global_batch_size} sequences = micro-batch {self.micro_batch_size} x accumulation "
            f"{self.grad_accum_steps} x data-parallel {self.dp_size} ({self.global_batch_size * seq_len:,} tokens "
            "per step)"
        )

    def state_dict(self) -> dict[str, Any]:
        """The position as (epoch, samples consumed in it): valid for any batch layout, so a job resumed on a
        different number of ranks, or with another micro-batch split, continues with the next unseen sample."""
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.epoch, self.samples_in_epoch = state["seed"], state["epoch"], state["samples_in_epoch"]
        self._permutation = self._permute(self.epoch)


def sampler_for(windows: Windows, **settings: Any) -> Any:
    """The sampler of a split's training windows (``GlobalBatchSampler``'s keyword ``settings``, but
    ``num_samples``): a mixture's own, which draws from each source by weight, else a ``GlobalBatchSampler``."""
    own = getattr(windows, "sampler", None)
    return own(**settings) if own is not None else GlobalBatchSampler(num_samples=len(windows), **settings)


class TrainBatches:
    """This rank's training stream: each ``next_step()`` returns the micro-batches of one optimizer step.

    With ``prefetch``, a background thread reads step k+1's windows while step k computes (into pinned memory with
    ``pin_memory``, so the copy to the GPU is asynchronous). The sampler advances in the caller's thread only, and
    ``state_dict()`` is the position after the last step *returned*, never after one prefetched: a checkpoint
    resumes exactly with the next step the run would have trained on.
    """

    def __init__(
        self,
        windows: Windows,
        sampler: GlobalBatchSampler,
        *,
        prefetch: bool = False,
        pin_memory: bool = False,
        transform: Callable[[Batch], Batch] | None = None,
    ) -> None:
        self.windows, self.sampler, self.pin_memory = windows, sampler, pin_memory
        self.transform = transform  # applied to each batch as it is read (document masking)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distrain-data") if prefetch else None
        self._pending: tuple[Future | list[Batch], dict[str, Any]] | None = None
        self._returned_state: dict[str, Any] | None = None

    def _read(self, indices: list[torch.Tensor]) -> list[Batch]:
        batches = [self.windows.batch(step_indices) for step_indices in indices]
        if self.transform is not None:
            batches = [self.transform(batch) for batch in batches]
        if self.pin_memory:
            batches = [batch.pinned() for batch in batches]
        return batches

    def _request_next(self) -> tuple[Future | list[Batch], dict[str, Any]]:
        indices = self.sampler.next_step()
        state = self.sampler.state_dict()
        if self._reader is None:
            return self._read(indices), state
        return self._reader.submit(self._read, indices), state

    def next_step(self) -> list[Batch]:
        pending, state = self._pending or self._request_next()
        self._pending = None  # a read that failed is not handed out again: a retry reads afresh
        batches = pending.result() if isinstance(pending, Future) else pending
        self._returned_state = state
        self._pending = self._request_next() if self._reader is not None else None
        return batches

    def failed_read(self) -> BaseException | None:
        """The known data failure (``ArtifactError``: an id above the vocabulary, a shard shorter than its index)
        of the next step's prefetched read, waiting for that read; None when it succeeded or nothing is prefetched.
        Asked at the end of a step, so every rank learns of it at the step boundary instead of the failing rank
        alone at the start of the next step, while its peers wait in a collective."""
        if self._pending is None or not isinstance(self._pending[0], Future):
            return None
        error = self._pending[0].exception()
        return error if isinstance(error, ArtifactError) else None

    def state_dict(self) -> dict[str, Any]:
        return dict(self._returned_state) if self._returned_state is not None else self.sampler.state_dict()

    def fractions(self) -> dict[str, float]:
        """A mixture's realised shares over the steps returned so far (not the one prefetched)."""
        return self.sampler.fractions(self.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._pending is not None and isinstance(self._pending[0], Future):
            # Let the read in flight finish before its sampler position is dropped; its error, if any, concerns a
            # step that will be read again from the restored position.
            self._pending[0].exception()
        self._pending, self._returned_state = None, None
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        """Stop the background reader (a read in flight finishes first)."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)


def validation_batches(
    windows: Windows, *, micro_batch_size: int, num_batches: int, dp_rank: int, dp_size: int, replica_groups: int = 1
) -> list[Batch]:
    """A fixed validation set, the first windows of the validation stream, split over data-parallel ranks.

    The set is the same for every run with the same batch settings, so validation losses are comparable. Every rank
    gets the same number of micro-batches (sharded strategies run collectives in each forward); a validation split
    smaller than one micro-batch per rank is used round robin, windows repeating. With ``replica_groups`` (ft=torchft:
    ``dp_rank``/``dp_size`` are the position inside one group) each group takes the set a job of all the groups'
    ranks would share, ``replica_groups`` times as many micro-batches per rank.
    """
    per_step = micro_batch_size * dp_size
    # With replica groups (ft=torchft) each group validates on the set all of the job's ranks would share.
    num_batches = max(1, min(num_batches, len(windows) // (per_step * replica_groups))) * replica_groups
    batches = []
    for i in range(num_batches):
        start = i * per_step + dp_rank * micro_batch_size
        batches.append(windows.batch(torch.arange(start, start + micro_batch_size) % len(windows)))
    return batches
