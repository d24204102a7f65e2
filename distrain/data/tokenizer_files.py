"""The tokenizer of ``python -m distrain.data.prepare``: a byte-level BPE trained on the train documents, or an
existing Hugging Face ``tokenizers`` file (``tokenizer.json``, alone or in a model directory).

Runs in prepare's main process (training uses the Rust library's threads); the tokenising workers
(:func:`worker_pool`) rebuild the tokenizer from its JSON text (:func:`start_worker`) and encode with
:func:`encode_batch`.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import os
import signal
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from distrain.artifacts.char_vocab import is_char_vocab
from distrain.artifacts.tokenizer import inspect_tokenizer
from distrain.data.token_format import DataError, sha256_of
from distrain.errors import ArtifactError

DEFAULT_EOS = "<|endoftext|>"
BYTE_ALPHABET = 256  # a byte-level BPE starts from one token per byte


@dataclass(frozen=True)
class TokenizerSource:
    """An existing tokenizer: the file it came from, its SHA-256, and the EOS token its model directory names."""

    file: Path
    sha256: str
    eos_token: str | None


def resolve_tokenizer_path(path: str | Path) -> TokenizerSource:
    """``path`` (a ``tokenizer.json`` or a local Hugging Face model directory holding one), inspected
    (``distrain.artifacts.tokenizer``), as a source; the EOS token of a directory's ``tokenizer_config.json`` when
    it names one. DataError naming the file and ``--tokenizer`` otherwise."""
    if is_char_vocab(path):
        raise DataError(
            str(path),
            "a nanoGPT meta.pkl is read beside its own train.bin/val.bin, not to prepare with "
            "(--tokenizer: a tokenizer.json or a Hugging Face model directory)",
        )
    try:
        file = inspect_tokenizer(path).file.resolve()
        digest = sha256_of(file)
    except ArtifactError as err:
        raise DataError(err.where, f"{err.problem} (--tokenizer)") from None
    except OSError as err:
        raise DataError(str(path), f"unreadable ({err.strerror or err}) (--tokenizer)") from None
    directory = Path(path).expanduser()
    eos = _config_eos(directory / "tokenizer_config.json") if directory.is_dir() else None
    return TokenizerSource(file, digest, eos)


def _config_eos(config: Path) -> str | None:
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError) as err:
        raise DataError(str(config), f"an unreadable tokenizer config ({type(err).__name__}: {err})") from None
    # transformers writes either the token itself or an AddedToken-like {"content": ...} object.
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def load_tokenizer(source: TokenizerSource) -> Tokenizer:
    """The tokenizer in ``source.file`` (inspected when the source was resolved); DataError naming the file when
    ``tokenizers`` cannot read it (it changed since)."""
    try:
        return inspect_tokenizer(source.file).tokenizer
    except ArtifactError as err:
        raise DataError(err.where, err.problem) from None


def check_bpe_vocab_size(vocab_size: int) -> None:
    """DataError unless a byte-level BPE of ``vocab_size`` tokens holds every byte and the EOS token."""
    if vocab_size < BYTE_ALPHABET + 1:
        raise DataError("--vocab-size", f"{vocab_size} is below {BYTE_ALPHABET + 1} (256 bytes + the EOS token)")


def train_bpe(
    batches: Iterable[list[str]], *, vocab_size: int, eos_token: str, min_frequency: int, progress: bool
) -> Tokenizer:
    """A byte-level BPE (ByteLevel pre-tokenizer and decoder, so ``decode(encode(text)) == text``) trained on the
    texts of ``batches``, with ``eos_token`` as its one special token (id 0)."""
    check_bpe_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: it would add a space to every document, and decoding would not give the text back.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token],
        # Every byte in the vocabulary, seen in the corpus or not, so that any later text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer.train_from_iterator(batches, trainer)
    return tokenizer


def eos_id_of(tokenizer: Tokenizer, eos_token: str, where: str) -> int:
    """The id of ``eos_token``; DataError (naming ``where``, the tokenizer's file) when it is not in the vocabulary."""
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise DataError(where, f"the EOS token {eos_token!r} is not in its vocabulary (--eos-token)")
    return eos_id


def vocab_size_of(tokenizer: Tokenizer) -> int:
    """``get_vocab_size()``, or the largest id + 1 when a tokenizer's ids have gaps above its size (which would
    otherwise index past an embedding sized by the vocabulary, or overflow uint16)."""
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    return max(tokenizer.get_vocab_size(with_added_tokens=True), largest + 1)


def worker_tokenizer(json_text: str) -> Tokenizer:
    """The tokenizer a worker encodes with: the given one, except that special tokens written in a document
    (``<|endoftext|>`` in a text about tokenizers) are encoded as the text they are, so that the EOS id marks
    document ends only."""
    tokenizer = Tokenizer.from_str(json_text)
    tokenizer.encode_special_tokens = True
    return tokenizer


class WorkerDied(RuntimeError):
    """A tokenising worker process ended without handing back its batch (killed, out of memory); how it ended."""


@contextmanager
def worker_pool(workers: int, json_text: str, eos_id: int, dtype: str) -> Iterator[ProcessPoolExecutor]:
    """``workers`` tokenising processes. A worker that dies fails its batch at once (WorkerDied) instead of leaving
    the main process waiting; on any error or Ctrl-C the workers are terminated here (they ignore SIGINT, so that
    the main process alone decides what a Ctrl-C does) and the pool is shut down before the exception goes on."""
    # Spawned, not forked: the parent has used the tokenizers library's threads (training), which fork breaks.
    pool = ProcessPoolExecutor(workers, _WorkerContext(), initializer=start_worker, initargs=(json_text, eos_id, dtype))
    try:
        yield pool
    except BaseException as err:
        # Python 3.11 has no public way to stop running workers (3.14's terminate_workers): _processes it is, plus
        # a worker whose start a Ctrl-C interrupted (delivered as start() unblocks SIGINT, before the pool recorded
        # it). Left alive, that one would wait for work forever, and interpreter exit waits for it.
        processes = list((pool._processes or {}).values())
        processes += [child for child in multiprocessing.active_children() if isinstance(child, _WorkerProcess)]
        processes = list({id(process): process for process in processes}.values())
        for process in processes:
            process.terminate()
        # With every worker gone the pool's manager thread finds them dead and ends: this wait is short.
        pool.shutdown(wait=True, cancel_futures=True)
        for process in processes:  # the pool joins those it recorded; this also reaps the one it did not
            process.join(timeout=10)
        if isinstance(err, BrokenProcessPool):
            raise WorkerDied(_how_workers_ended(processes)) from None
        raise
    pool.shutdown(wait=True)


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned worker born with SIGINT blocked (a signal mask survives fork and exec) until :func:`start_worker`
    ignores it, so that a Ctrl-C while the worker starts up is no KeyboardInterrupt traceback in it. In the parent
    SIGINT is blocked only while the child is forked: a Ctrl-C then stays pending and is delivered right after."""

    def start(self) -> None:
        if not hasattr(signal, "pthread_sigmask"):  # Windows: no process-group SIGINT to guard against
            return super().start()
        resource_tracker.ensure_running()  # before blocking: starting the tracker unblocks SIGINT
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _WorkerContext(multiprocessing.context.SpawnContext):
    Process = _WorkerProcess


def _how_workers_ended(processes: list) -> str:
    codes = [process.exitcode for process in processes if process.exitcode is not None]
    # The pool terminates (SIGTERM) the others once one has died: the one that did not end that way is the news.
    code = next((code for code in codes if code != -signal.SIGTERM), codes[0] if codes else None)
    if code is None:
        return "it ended abruptly"
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (", perhaps by the out-of-memory killer" if -code == signal.SIGKILL else "")
    return f"exit status {code}"


_WORKER: dict = {}


def start_worker(json_text: str, eos_id: int, dtype: str) -> None:
    """Runs once in each worker process: SIGINT ignored (a Ctrl-C reaches every process of the terminal's group;
    the main process stops the workers itself), one thread each (``--workers`` is the parallelism), the tokenizer
    built."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # discards a SIGINT left pending while it was blocked
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=worker_tokenizer(json_text), eos_id=eos_id, dtype=np.dtype(dtype))


def encode_batch(texts: list[str], to_val: list[bool]) -> list[tuple[np.ndarray, int, int]]:
    """Runs in a worker: per split (train, val) the batch's ids, each document followed by the EOS id, with the
    number of documents and the largest id."""
    encodings = _WORKER["tokenizer"].encode_batch_fast(texts, add_special_tokens=False)
    eos_id = _WORKER["eos_id"]
    results = []
    for want_val in (False, True):
        ids: list[int] = []
        documents = 0
        for encoding, is_val in zip(encodings, to_val, strict=True):
            if is_val == want_val:
                ids.extend(encoding.ids)
                ids.append(eos_id)
                documents += 1
        array = np.array(ids, dtype=np.int64)
        largest = int(array.max()) if array.size else 0
        results.append((array.astype(_WORKER["dtype"]), documents, largest))
    return results
