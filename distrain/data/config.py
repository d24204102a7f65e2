"""The ``data`` group's schemas (``conf/data/*.yaml`` extend them): the built-in corpora and token shards on disk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass(kw_only=True)
class StdlibCorpusConfig:
    """Bytes of the Python standard library's own source files: real text on every machine, no download."""

    _target_: str = "distrain.data.corpus.stdlib_source_corpus"
    max_bytes: int = 4_000_000
    val_fraction: float = 0.05


@dataclass(kw_only=True)
class SyntheticCorpusConfig:
    """Uniformly random tokens, for benchmarks where the data must cost nothing."""

    _target_: str = "distrain.data.corpus.synthetic_corpus"
    num_tokens: int = 2_000_000
    vocab_size: int = 256
    seed: int = 1234
    val_fraction: float = 0.05


@dataclass(kw_only=True)
class StdlibDataConfig:
    micro_batch_size: int = 8  # sequences per data-parallel rank per micro-step
    # Sequences per optimizer step over all ranks (null: micro_batch_size x grad_accum_steps x data-parallel
    # degree). When set, trainer.grad_accum_steps is derived from it and the layout, so a layout change keeps it.
    global_batch_size: int | None = None
    seq_len: int = 128  # tokens per sequence (at most model.max_seq_len)
    document_masking: bool = False  # refused: this corpus is one stream without documents
    corpus: StdlibCorpusConfig = field(default_factory=StdlibCorpusConfig)


@dataclass(kw_only=True)
class SyntheticDataConfig:
    micro_batch_size: int = 8
    global_batch_size: int | None = None
    seq_len: int = 128
    document_masking: bool = False  # refused: this corpus is one stream without documents
    corpus: SyntheticCorpusConfig = field(default_factory=SyntheticCorpusConfig)


@dataclass(kw_only=True)
class TokensCorpusConfig:
    """The splits of a tokenised dataset directory, read window by window (``distrain/data/token_format.py``)."""

    _target_: str = "distrain.data.tokens.token_corpus"
    path: str = "${data.path}"
    # Ids at or above the model's vocabulary are refused as windows are read (null: the index's vocab_size only).
    vocab_limit: int | None = "${oc.select:model.vocab_size,null}"


@dataclass(kw_only=True)
class TokensDataConfig:
    """A tokenised dataset on disk: ``python -m distrain.data.prepare``'s output, or nanoGPT's train.bin/val.bin."""

    micro_batch_size: int = 8
    global_batch_size: int | None = None
    seq_len: int = 128
    path: str = MISSING  # the dataset directory
    verify_checksums: bool = True  # every shard's CRC-32 (or SHA-256) against its index before any rank starts
    prefetch: bool = True  # the next step's batches read by a background thread during this step
    # Positions restart and attention stays inside each document of a window; boundary targets not counted.
    document_masking: bool = False
    corpus: TokensCorpusConfig = field(default_factory=TokensCorpusConfig)


@dataclass(kw_only=True)
class MixSourceConfig:
    """One source of a mixture: a prepared dataset and its share of the training sequences (normalised over all)."""

    path: str = MISSING
    weight: float = 1.0


@dataclass(kw_only=True)
class MixCorpusConfig:
    """The sources' splits side by side (``distrain/data/mixture.py``)."""

    _target_: str = "distrain.data.mixture.mixture_corpus"
    sources: Any = "${data.sources}"
    vocab_limit: int | None = "${oc.select:model.vocab_size,null}"


@dataclass(kw_only=True)
class MixDataConfig:
    """Several prepared datasets (same tokenizer), each step drawing from them in proportion to their weights;
    ``val/<name>/loss`` per source, ``val_loss`` their weighted mean."""

    micro_batch_size: int = 8
    global_batch_size: int | None = None
    seq_len: int = 128
    sources: Any = None  # name -> {path, weight} (MixSourceConfig); Any: the command line may set the whole mapping
    verify_checksums: bool = True
    prefetch: bool = True
    # Positions restart and attention stays inside each document of a window; boundary targets not counted.
    document_masking: bool = False
    corpus: MixCorpusConfig = field(default_factory=MixCorpusConfig)
