"""``python -m distrain.data.prepare``: tokenise a corpus once into token shards (``distrain.data.token_format``).

    python -m distrain.data.prepare --input corpus/ extra.jsonl --out data/tokens --vocab-size 32000 --workers 8

What runs where: the main process finds and reads the input documents (three passes, all deterministic: count
and split them, train the BPE tokenizer on the train documents, tokenise), trains the tokenizer (Rust threads)
and writes the shards; ``--workers`` spawned processes, each holding the tokenizer once and single-threaded,
encode batches of documents with ``encode_batch``. Batches are handed out and collected in order, so the output is
byte-identical for any number of workers. Everything is written under ``DATA_DIR/.prepare-tmp`` and moved into
place at the end (``prepare_output.publish``); ``prepare.json`` records inputs and settings so that running the
same command again on a finished dataset does nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import tokenizers
from tqdm import tqdm

from distrain.artifacts.outputs import check_writable, refuse_replacing
from distrain.data.documents import ReadStats, batches, find_input_files, iter_documents
from distrain.data.prepare_output import (
    TEMPORARY,
    TOKENIZER,
    ShardWriter,
    build_summary,
    foreign_outputs,
    fresh_temporary,
    input_fingerprints,
    is_output,
    nothing_to_do,
    publish,
    up_to_date,
)
from distrain.data.token_format import SPLITS, DataError, SplitIndex, dtype_for
from distrain.data.tokenizer_files import (
    DEFAULT_EOS,
    TokenizerSource,
    WorkerDied,
    check_bpe_vocab_size,
    encode_batch,
    eos_id_of,
    load_tokenizer,
    resolve_tokenizer_path,
    train_bpe,
    vocab_size_of,
    worker_pool,
    worker_tokenizer,
)
from distrain.errors import ArtifactError

PREPARE_VERSION = 1  # bumped when the same inputs and settings would give different shards
DEFAULT_SHARD_TOKENS = 1 << 28
BATCH_DOCUMENTS = 4096  # at most, per batch handed to a worker (batches: about 1 MB of text)


@dataclass(frozen=True)
class Settings:
    """What the output depends on besides the inputs (``--workers`` is not among it)."""

    tokenizer: str  # "bpe", or the resolved tokenizer.json the ids come from
    vocab_size: int | None  # bpe only
    min_frequency: int | None  # bpe only
    eos_token: str
    text_field: str
    val_fraction: float
    seed: int
    shard_tokens: int


@dataclass(frozen=True)
class Plan:
    """The documents found by the counting pass, and how many of them the seeded draw sent to validation."""

    documents: int
    val_documents: int


def prepare(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike = "bpe",
    vocab_size: int = 32000,
    workers: int | None = None,
    text_field: str = "text",
    val_fraction: float = 0.005,
    seed: int = 1234,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    eos_token: str | None = None,
    min_frequency: int = 2,
    overwrite: bool = False,
    progress: bool | None = None,
    quiet: bool = False,
) -> dict:
    """Tokenise ``inputs`` into the dataset directory ``out``; the summary (also printed as one line on stdout
    unless ``quiet``). ``workers``: tokenising processes (default: the CPUs this process may use); ``progress``:
    the tqdm bar on stderr (default: when stderr is a terminal); ``overwrite``: replace files of prepare's output
    names (``train.json``, shards, ...) that an earlier prepare did not write. DataError for bad input or options,
    ArtifactError for an output directory that cannot be written or holds files that are not prepare's."""
    started = time.perf_counter()
    workers = _available_cpus() if workers is None else workers
    _check_options(workers, val_fraction, shard_tokens, min_frequency, text_field)
    out = Path(out).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise DataError(str(out), "is a file; --out wants a directory (created when missing)")
    check_writable(out, directory=True)
    if not overwrite and (foreign := foreign_outputs(out)):  # the user's own train.json is not ours to replace
        refuse_replacing(foreign[0], writer="python -m distrain.data.prepare", flag="--overwrite")
    # Never a file prepare wrote, even with --out inside (or equal to) an input directory.
    files = find_input_files(inputs, exclude=out, skip=lambda path: is_output(out, path))
    source = None if str(tokenizer) == "bpe" else resolve_tokenizer_path(tokenizer)
    if source is None:
        check_bpe_vocab_size(vocab_size)
    settings = _settings(source, vocab_size, min_frequency, eos_token, text_field, val_fraction, seed, shard_tokens)
    record = {
        "version": PREPARE_VERSION,
        "inputs": input_fingerprints(files),
        "settings": asdict(settings),
        "tokenizer_source": {"file": str(source.file), "sha256": source.sha256} if source else None,
    }
    done, damaged = up_to_date(out, record)
    if done is not None:
        shutil.rmtree(out / TEMPORARY, ignore_errors=True)  # an interrupted later run's leftovers
        return _report({**done, "up_to_date": True, "message": nothing_to_do(out)}, quiet)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    temporary = fresh_temporary(out)
    try:
        summary = _run(files, settings, source, out, temporary, workers, progress, started)
        software = {"tokenizers": tokenizers.__version__, "numpy": np.__version__}
        publish(out, temporary, summary.pop("indexes"), {**record, "software": software, "summary": summary})
    except BaseException:
        # An error or Ctrl-C leaves no temporary files behind (a killed run's are removed by the next run); what
        # is in DATA_DIR is the previous dataset, or, if publishing had begun, no index at all; a DATA_DIR this
        # run created goes too.
        shutil.rmtree(out if created else temporary, ignore_errors=True)
        raise
    if damaged:  # same inputs and settings, but a shard (or index) was not what the index said
        summary["re_prepared_because"] = damaged
        summary["message"] += f"; re-prepared because {damaged}"
    return _report(summary, quiet)


def _run(
    files: list[Path],
    settings: Settings,
    source: TokenizerSource | None,
    out: Path,
    temporary: Path,
    workers: int,
    progress: bool | None,
    started: float,
) -> dict:
    """Count, train (bpe) and tokenise into ``temporary``; the summary, with the two indexes under ``indexes``."""
    # A given tokenizer is read (and its EOS checked) before the corpus, so that a bad one fails at once.
    json_text = _given_tokenizer(source, settings, temporary) if source else None
    stats = ReadStats()
    plan = _count(files, settings, stats, temporary)
    show = sys.stderr.isatty() if progress is None else progress
    tokenizer_started = time.perf_counter()
    json_text = json_text or _train_tokenizer(files, settings, plan, temporary, show)
    tokenizer_seconds = time.perf_counter() - tokenizer_started if source is None else 0.0
    tokenize_started = time.perf_counter()
    indexes = _tokenize(files, settings, plan, temporary, json_text, workers, show)
    seconds = {"tokenizer": tokenizer_seconds, "tokenize": time.perf_counter() - tokenize_started}
    seconds["total"] = time.perf_counter() - started
    summary = build_summary(out, indexes, seconds, len(stats.binary_files), stats.empty_documents)
    return {**summary, "indexes": indexes}


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _check_options(workers: int, val_fraction: float, shard_tokens: int, min_frequency: int, field: str) -> None:
    if workers < 1:
        raise DataError("--workers", f"must be >= 1, not {workers}")
    if not 0 <= val_fraction < 1:
        raise DataError("--val-fraction", f"{val_fraction}: a fraction in [0, 1)")
    if shard_tokens < 1:
        raise DataError("--shard-tokens", f"{shard_tokens}: at least 1")
    if min_frequency < 1:
        raise DataError("--min-frequency", f"{min_frequency}: at least 1")
    if not field:
        raise DataError("--text-field", "empty")


def _settings(
    source: TokenizerSource | None,
    vocab_size: int,
    min_frequency: int,
    eos_token: str | None,
    text_field: str,
    val_fraction: float,
    seed: int,
    shard_tokens: int,
) -> Settings:
    # An explicit --eos-token wins; else the model directory's eos_token; else GPT-2's <|endoftext|>.
    eos = eos_token or (source.eos_token if source else None) or DEFAULT_EOS
    bpe = source is None
    return Settings(
        tokenizer="bpe" if bpe else str(source.file),
        vocab_size=vocab_size if bpe else None,
        min_frequency=min_frequency if bpe else None,
        eos_token=eos,
        text_field=text_field,
        val_fraction=float(val_fraction),
        seed=seed,
        shard_tokens=shard_tokens,
    )


def _count(files: list[Path], settings: Settings, stats: ReadStats, temporary: Path) -> Plan:
    """The first pass: every input is read (so bad records fail before any tokenizer training), documents
    counted and the split drawn. Fewer than two documents cannot give both splits one."""
    draw = random.Random(settings.seed)
    documents = val = 0
    for _ in iter_documents(files, settings.text_field, stats, cache_dir=temporary / "hf-cache"):
        documents += 1
        val += draw.random() < settings.val_fraction
    if documents == 0:
        raise DataError("--input", f"no documents found in {len(files)} file(s) ({len(stats.binary_files)} binary)")
    if documents < 2:
        raise DataError("--input", "only 1 document found: train and validation need one each")
    return Plan(documents, val)


def _documents(files: list[Path], settings: Settings, plan: Plan, temporary: Path) -> Iterator[tuple[str, bool]]:
    """Each document with its split (True: validation), as drawn by ``_count``. A split the draw left empty gets
    the last document, so both have one."""
    draw = random.Random(settings.seed)
    last = plan.documents - 1
    number = -1
    for number, text in enumerate(iter_documents(files, settings.text_field, cache_dir=temporary / "hf-cache")):
        if number > last:
            break
        to_val = draw.random() < settings.val_fraction
        if number == last and plan.val_documents in (0, plan.documents):
            to_val = plan.val_documents == 0
        yield text, to_val
    if number != last:
        found = "more" if number > last else f"{number + 1:,}"
        raise DataError("--input", f"changed while being read: {plan.documents:,} documents counted, then {found}")


def _given_tokenizer(source: TokenizerSource, settings: Settings, temporary: Path) -> str:
    """A given tokenizer copied as ``temporary/tokenizer.json``; its JSON text for the workers. DataError naming
    its file when it is unreadable or the EOS token is not in its vocabulary."""
    loaded = load_tokenizer(source)
    eos_id_of(loaded, settings.eos_token, str(source.file))
    shutil.copyfile(source.file, temporary / TOKENIZER)  # the file as given, byte for byte
    return loaded.to_str()


def _train_tokenizer(files: list[Path], settings: Settings, plan: Plan, temporary: Path, show: bool) -> str:
    """A byte-level BPE trained on the train documents (a pass over the inputs), saved as
    ``temporary/tokenizer.json``; its JSON text for the workers."""
    train_documents = ((text, False) for text, to_val in _documents(files, settings, plan, temporary) if not to_val)
    trained = train_bpe(
        (texts for texts, _ in batches(train_documents)),
        vocab_size=settings.vocab_size,
        eos_token=settings.eos_token,
        min_frequency=settings.min_frequency,
        progress=show,
    )
    json_text = trained.to_str(pretty=True)
    (temporary / TOKENIZER).write_text(json_text, encoding="utf-8")
    return json_text


def _tokenize(
    files: list[Path], settings: Settings, plan: Plan, temporary: Path, json_text: str, workers: int, show: bool
) -> dict[str, SplitIndex]:
    """The last pass: batches encoded by the worker processes, collected in submission order, written as shards."""
    probe = worker_tokenizer(json_text)
    eos_id = eos_id_of(probe, settings.eos_token, TOKENIZER)
    vocab_size = vocab_size_of(probe)
    dtype = dtype_for(vocab_size)
    writers = {split: ShardWriter(temporary, split, dtype, settings.shard_tokens) for split in SPLITS}
    bar = tqdm(total=plan.documents, unit="doc", desc="tokenising", file=sys.stderr, disable=not show)
    started, tokens = time.perf_counter(), 0
    with bar, worker_pool(workers, json_text, eos_id, dtype) as pool:
        pending: deque = deque()

        def collect() -> None:
            nonlocal tokens
            done = 0
            for split, (ids, documents, largest) in zip(SPLITS, pending.popleft().result(), strict=True):
                writers[split].write(ids, documents, largest)
                tokens, done = tokens + ids.size, done + documents
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            bar.set_postfix_str(f"{tokens:,} tokens, {rate:,.0f} tokens/s", refresh=False)
            bar.update(done)

        for texts, splits in batches(_documents(files, settings, plan, temporary), BATCH_DOCUMENTS):
            pending.append(pool.submit(encode_batch, texts, splits))
            # A bounded number of batches in flight: the corpus is never all in memory at once.
            if len(pending) > 2 * workers:
                collect()
        while pending:
            collect()
    return {split: writer.index(vocab_size, eos_id, TOKENIZER) for split, writer in writers.items()}


def _report(summary: dict, quiet: bool) -> dict:
    if not quiet:
        print(summary["message"], flush=True)
    return summary


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as the one ``distrain prepare:`` line the other errors are."""

    def error(self, message: str) -> NoReturn:
        print(f"distrain prepare: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    description = "Tokenise a corpus once into token shards: DATA_DIR/{train,val}.json and their .bin shards."
    parser = _Parser(prog="python -m distrain.data.prepare", description=description)
    add = parser.add_argument
    add(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="files or directories (recursed, sorted, hidden names skipped)",
    )
    add("--out", required=True, metavar="DATA_DIR", help="the dataset directory (created)")
    add("--tokenizer", default="bpe", metavar="bpe|PATH", help="train a BPE, or a tokenizer.json / HF model dir")
    add("--vocab-size", type=int, default=32000, metavar="N", help="bpe: vocabulary, EOS included (default 32000)")
    add("--workers", type=int, default=None, metavar="N", help="tokenising processes (default: the CPUs available)")
    add("--text-field", default="text", metavar="NAME", help="JSONL field / Parquet column of the text (default text)")
    add("--val-fraction", type=float, default=0.005, metavar="F", help="chance a document goes to val (default 0.005)")
    add("--seed", type=int, default=1234, metavar="N", help="seed of the train/val draw (default 1234)")
    add("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N", help="tokens per shard (default 2^28)")
    add("--eos-token", default=None, metavar="TOKEN", help=f"ends each document (default: the model's, {DEFAULT_EOS})")
    add("--min-frequency", type=int, default=2, metavar="N", help="bpe: least count of a merged pair (default 2)")
    add(
        "--overwrite",
        action="store_true",
        help="replace files in DATA_DIR named like prepare's output it did not write",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; its exit status (2: bad input or options, said in one line on stderr)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0) and usage errors (2) end here rather than the interpreter
        return exit_.code if isinstance(exit_.code, int) else 2
    options = {key: value for key, value in vars(args).items() if key not in ("input", "out")}
    try:
        prepare(args.input, args.out, **options)
    except ArtifactError as err:  # DataError included
        print(f"distrain prepare: {err}", file=sys.stderr)
        return 2
    except WorkerDied as err:  # killed, out of memory: the run is lost, the previous dataset kept
        print(f"distrain prepare: a tokenising worker died ({err}); nothing was published", file=sys.stderr)
        return 1
    except OSError as err:  # a full disk, a directory not writable: the system's words, no traceback
        where = f"{err.filename}: " if err.filename else ""
        print(f"distrain prepare: {where}{err.strerror or err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # The workers ignore SIGINT and were terminated by prepare, its temporary directory removed. Indexes are
        # written last, so what is left is the previous dataset, or no index at all: never a torn one.
        print("distrain prepare: interrupted (no index names a partial shard); run the command again", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
