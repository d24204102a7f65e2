"""``data=mix``: train on several prepared datasets at once, each step drawing from them in configured proportions.

The mixture's windows are its sources' windows side by side: window ``offset[s] + j`` is window ``j`` of source
``s``. The ``MixtureSampler`` decides which source each sequence of the run comes from, one sequence at a time, as
Megatron's blended datasets do: sequence ``k`` goes to the source furthest behind its share (``weight * (k + 1)``
minus what it has had). So after any number of sequences each source's count stays within about one sequence of its
share (measured: at most 1.15 over random weights of 2 to 7 sources), and the order depends on nothing but the
weights. Within a source, sequences follow that source's own shuffled
epochs (a small source repeats while a large one is still in its first). The global batch is then laid out
``[micro_step][dp_rank][sample]`` as ``GlobalBatchSampler`` does, so 1, 2 or 4 data-parallel ranks train on the same
sequences, and the position (how many sequences each source has had) resumes exactly.

Memory: each source holds the permutation of its current epoch (4 bytes per window: 22 MB for a 1.4 GB source of
128-token windows), never tokens; windows are read from disk as ``data=tokens`` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from distrain.data.sampler import Batch, GlobalBatchSampler, token_windows
from distrain.data.tokens import token_corpus


@dataclass(frozen=True)
class MixtureSplit:
    """One split (train or validation) of every source, by name, and the sources' normalised weights."""

    sources: dict[str, Any]  # name -> ShardedTokens (Any: Hydra may wrap this dataclass in a config)
    weights: dict[str, float]

    def windows(self, seq_len: int) -> MixtureWindows:
        return MixtureWindows({name: token_windows(tokens, seq_len) for name, tokens in self.sources.items()}, self)

    def longest_run(self) -> int:
        """The shortest source's longest run: every source must hold a window of the chosen ``seq_len``."""
        return min(tokens.longest_run() for tokens in self.sources.values())

    def __len__(self) -> int:
        return sum(len(tokens) for tokens in self.sources.values())


@dataclass(frozen=True)
class MixtureCorpus:
    """The ``data=mix`` corpus: each split is a ``MixtureSplit``; one vocabulary (the sources must share it)."""

    name: str
    train: MixtureSplit
    val: MixtureSplit
    vocab_size: int
    eos_id: int | None = None  # the sources' end-of-document id (one tokenizer); None when one has none


SOURCE_KEYS = ("path", "weight")
DEFAULT_WEIGHT = 1.0


def source_settings(sources: Any) -> dict[str, tuple[Any, Any]]:
    """``data.sources`` as name -> (path, weight), the weight 1 where none is given (``data=mix`` checks both)."""
    return {name: (source.get("path"), source.get("weight", DEFAULT_WEIGHT)) for name, source in sources.items()}


def mixture_corpus(sources: Any, vocab_limit: int | None = None) -> MixtureCorpus:
    """``data.sources`` (name -> ``{path, weight}``) as a corpus; no token is read here."""
    settings = source_settings(sources)
    corpora = {name: token_corpus(path, vocab_limit) for name, (path, _) in settings.items()}
    total = sum(float(weight) for _, weight in settings.values())
    weights = {name: float(weight) / total for name, (_, weight) in settings.items()}
    return MixtureCorpus(
        name="mix:" + "+".join(corpora),
        train=MixtureSplit({name: corpus.train for name, corpus in corpora.items()}, weights),
        val=MixtureSplit({name: corpus.val for name, corpus in corpora.items()}, weights),
        vocab_size=max(corpus.vocab_size for corpus in corpora.values()),
        eos_id=common_value(corpus.eos_id for corpus in corpora.values()),
    )


def common_value(values: Iterable[Any]) -> Any:
    """The one value every source has, else None."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


class MixtureWindows:
    """The sources' windows side by side (``offsets[s]`` is source ``s``'s first); ``batch`` reads each row from
    its own source."""

    def __init__(self, by_source: dict[str, Any], split: MixtureSplit) -> None:
        self.by_source, self.split = by_source, split
        self.names = list(by_source)
        counts = [len(windows) for windows in by_source.values()]
        self.counts = dict(zip(self.names, counts, strict=True))
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def batch(self, indices: torch.Tensor) -> Batch:
        """Rows in the order of ``indices``, each read from its source."""
        source_of = np.searchsorted(self.offsets, indices.numpy(), side="right") - 1
        inputs: list[torch.Tensor | None] = [None] * len(indices)
        targets: list[torch.Tensor | None] = [None] * len(indices)
        for source in np.unique(source_of).tolist():
            rows = np.flatnonzero(source_of == source)
            local = indices[torch.from_numpy(rows)] - int(self.offsets[source])
            part = self.by_source[self.names[source]].batch(local)
            for position, row in enumerate(rows.tolist()):
                inputs[row], targets[row] = part.inputs[position], part.targets[position]
        return Batch(inputs=torch.stack(inputs), targets=torch.stack(targets))

    def source(self, name: str) -> Any:
        """One source's own windows (its validation set is read from them)."""
        return self.by_source[name]

    def sampler(self, **settings: Any) -> MixtureSampler:
        """The sampler ``build_data`` uses for these windows (``GlobalBatchSampler``'s settings)."""
        return MixtureSampler(windows=self, weights=self.split.weights, **settings)


class MixtureSampler:
    """This rank's micro-batch indices for each optimizer step, drawn from the sources in proportion to their
    weights (see the module's docstring). ``GlobalBatchSampler``'s interface; no collective."""

    def __init__(
        self,
        *,
        windows: MixtureWindows,
        weights: dict[str, float],
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        num_samples: int | None = None,
        limit_batches: int = 0,
    ) -> None:
        del num_samples  # GlobalBatchSampler's setting: each source counts its own windows
        self.windows, self.names = windows, windows.names
        self.weights = np.array([weights[name] for name in self.names], dtype=np.float64)
        self.micro_batch_size, self.grad_accum_steps = micro_batch_size, grad_accum_steps
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.global_batch_size = micro_batch_size * grad_accum_steps * dp_size
        # trainer.overfit_batches: the first ``limit_batches`` global batches' worth of windows in all, each source
        # keeping its weight's share of them (at least one window).
        limit = limit_batches * self.global_batch_size if limit_batches > 0 else None
        self.sizes = [
            min(windows.counts[name], max(1, math.ceil(weights[name] * limit))) if limit else windows.counts[name]
            for name in self.names
        ]
        self.drawn = np.zeros(len(self.names), dtype=np.int64)  # sequences each source has given the run
        # The counts when these weights took effect: a run resumed with other weights follows them from there on,
        # instead of catching up on the sequences the old weights drew.
        self.since = np.zeros(len(self.names), dtype=np.int64)
        self._epochs: dict[int, tuple[int, torch.Tensor]] = {}  # source -> (epoch, its permutation)

    def next_step(self) -> list[torch.Tensor]:
        """Indices of this rank's ``grad_accum_steps`` micro-batches for the next optimizer step."""
        sources = self._assign(self.global_batch_size)
        chosen = np.empty(self.global_batch_size, dtype=np.int64)
        for source in np.unique(sources).tolist():
            slots = np.flatnonzero(sources == source)
            chosen[slots] = self._windows(source, int(self.drawn[source]), len(slots))
            self.drawn[source] += len(slots)
        layout = torch.from_numpy(chosen).view(self.grad_accum_steps, self.dp_size, self.micro_batch_size)
        return list(layout[:, self.dp_rank])

    def _assign(self, count: int) -> np.ndarray:
        """The sources of the run's next ``count`` sequences: each goes to the source furthest behind its share
        (the first such source on a tie). Plain floats: numpy's per-call overhead would dominate 3-element sums."""
        weights, drawn = self.weights.tolist(), (self.drawn - self.since).tolist()
        total, order = sum(drawn), range(len(weights))
        sources = np.empty(count, dtype=np.int64)
        for slot in range(count):
            total += 1
            source = max(order, key=lambda s: weights[s] * total - drawn[s])
            sources[slot] = source
            drawn[source] += 1
        return sources

    def _windows(self, source: int, first: int, count: int) -> np.ndarray:
        """The mixture indices of source ``source``'s draws ``first .. first + count - 1``: its epochs' shuffled
        order, epoch after epoch."""
        size, parts, draw = self.sizes[source], [], first
        while draw < first + count:
            epoch, position = divmod(draw, size)
            take = min(size - position, first + count - draw)
            parts.append(self._permutation(source, epoch)[position : position + take].numpy())
            draw += take
        return np.concatenate(parts).astype(np.int64) + int(self.windows.offsets[source])

    def _permutation(self, source: int, epoch: int) -> torch.Tensor:
        """Source ``source``'s order in ``epoch``; only the current epoch's is kept."""
        if self._epochs.get(source, (None,))[0] != epoch:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1_009 + source)
            self._epochs[source] = (epoch, torch.randperm(self.sizes[source], generator=generator, dtype=torch.int32))
        return self._epochs[source][1]

    def fractions(self, position: dict[str, Any]) -> dict[str, float]:
        """Each source's share of the sequences drawn up to ``position`` (a ``state_dict``): the run's realised
        mixture, ``data/<name>/fraction`` in the logs."""
        drawn = position["drawn"]
        total = max(1, sum(drawn.values()))
        return {f"data/{name}/fraction": drawn[name] / total for name in self.names}

    @property
    def num_samples(self) -> int:
        """Windows the sources hold together (one epoch of each; the dry run's steps per epoch)."""
        return sum(self.sizes)

    # The global batch's settings and start-up line are one dataset's: the same attributes, the same layout.
    batch_settings = GlobalBatchSampler.batch_settings

    def describe(self, seq_len: int) -> str:
        """One line: the global batch as micro-batch x accumulation x data-parallel degree, and the weights."""
        shares = ", ".join(f"{name} {weight:.0%}" for name, weight in zip(self.names, self.weights, strict=True))
        return f"{GlobalBatchSampler.describe(self, seq_len)}, mixed {shares}"

    def state_dict(self) -> dict[str, Any]:
        """The position: how many sequences each source has given (by name), the counts when the current weights
        took effect, the weights and the seed."""
        by_name = lambda counts: dict(zip(self.names, counts.tolist(), strict=True))  # noqa: E731
        weights = dict(zip(self.names, self.weights.tolist(), strict=True))
        return {"seed": self.seed, "drawn": by_name(self.drawn), "since": by_name(self.since), "weights": weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; with weights other than the saved ones, they apply from this position on."""
        self.seed = state["seed"]
        self.drawn = np.array([int(state["drawn"][name]) for name in self.names], dtype=np.int64)
        saved = np.array([float(state["weights"][name]) for name in self.names])
        same_weights = np.allclose(saved, self.weights, rtol=0, atol=1e-12)
        since = [int(state["since"][name]) for name in self.names] if same_weights else self.drawn.tolist()
        self.since = np.array(since, dtype=np.int64)
        self._epochs = {}
