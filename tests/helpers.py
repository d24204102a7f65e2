"""Shared test helpers: compose configs like train.py does, run code on real gloo ranks, run train.py."""

from __future__ import annotations

import atexit
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from warm import WarmPython

from distrain.config.overrides import quote_group_options
from distrain.config.schema import register_configs
from distrain.launch.process_group import DistEnv, init_distributed, shutdown_distributed
from distrain.launch.ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

# Small, fast settings shared by most tests: 200 kB of corpus, 2-layer model.
FAST = [
    "data.corpus.max_bytes=200000",
    "model.n_layers=2",
    "model.d_model=64",
    "model.max_seq_len=32",
    "data.micro_batch_size=4",
    "trainer.log_every=1",
    "checkpoint=none",
    "logger=none",
]


def documentation() -> str:
    """The README and every page under docs/, as one text (the code blocks the tests run live in them)."""
    return "\n".join(path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def run_readme_bash_block(
    first_line: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    """Run, as written, the one bash block of the README or docs/ starting with ``first_line``, from ``cwd`` (a
    scratch directory, not the checkout): only ``python`` becomes this interpreter and ``train.py`` its path in the
    repository."""
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", documentation(), flags=re.S) if b.startswith(first_line)]
    assert len(blocks) == 1, f"README and docs/ must hold one bash block starting with {first_line!r}"
    block = blocks[0].replace("python train.py", f"python {REPO / 'train.py'}").replace("python ", f"{sys.executable} ")
    paths = {"PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + block],
        cwd=cwd, env={**os.environ, **paths, **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def write_token_dataset(
    directory: Path, splits: dict[str, list[np.ndarray]], vocab_size: int = 256, eos_id: int | None = None
) -> Path:
    """A dataset in distrain's token format from ``{split: [shard ids, ...]}`` (uint16), indexes written last;
    ``eos_id``: the id its documents end with (None: it has no documents)."""
    from distrain.data.token_format import Shard, SplitIndex, sha256_of, write_index

    directory.mkdir(parents=True, exist_ok=True)
    for split, shards in splits.items():
        written = []
        for number, ids in enumerate(shards):
            path = directory / f"{split}-{number:05d}.bin"
            np.asarray(ids, dtype=np.uint16).tofile(path)
            written.append(Shard(path.name, len(ids), sha256_of(path)))
        tokens = sum(len(ids) for ids in shards)
        largest = max(int(np.max(ids)) for ids in shards if len(ids))
        write_index(
            directory, SplitIndex(split, "uint16", vocab_size, eos_id, None, None, tokens, largest, tuple(written))
        )
    return directory


def save_tiny_tokenizer(path: Path, vocab_size: int = 256) -> None:
    """A byte-level BPE tokenizer trained on two sentences, saved with ``save_pretrained`` (tokenizer.json, ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["hello world " * 10, "distributed training"], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(path)


def save_tiny_hf_llama(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny random ``LlamaForCausalLM`` saved in ``path`` with ``save_pretrained`` (config.json, safetensors) in
    ``dtype``, with a tokenizer beside it, as a published model directory has."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    LlamaForCausalLM(config).to(dtype).save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


def compose_config(overrides: list[str]) -> DictConfig:
    """The config train.py would see for these command-line overrides."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=quote_group_options(overrides))  # as train.py: debug=nan


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def on_ranks(fn: Any, nprocs: int, *args: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` real gloo ranks (processes forked from a fork server unless nprocs == 1).

    ``fn`` and ``args`` are pickled, and the ranks see the environment this process had at its first call."""
    return run_ranks(fn, args, nproc_per_node=nprocs, start_method="forkserver")


def rank_processes(launcher_pid: int) -> list[psutil.Process]:
    """The rank processes a ``train.py`` launcher started: its children, or on CPU the children of its fork server
    (the launcher's other helper, multiprocessing's resource tracker, is not a rank)."""
    ranks = []
    for child in psutil.Process(launcher_pid).children():
        command = " ".join(child.cmdline())
        if "multiprocessing.forkserver" in command:
            ranks += child.children()
        elif "multiprocessing.resource_tracker" not in command:
            ranks.append(child)
    return ranks


def join(cfg: DictConfig) -> DistEnv:
    return init_distributed(device="cpu", backend="gloo", timeout_s=120, threads_per_rank=1)


def leave() -> None:
    shutdown_distributed()


def cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters of the unwrapped model, detached on CPU."""
    inner = getattr(module, "module", module)
    return {name: tensor.detach().cpu().clone() for name, tensor in inner.state_dict().items()}


def run_train(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python train.py <args>`` in a subprocess, from ``cwd``; ``env`` adds variables (None removes one).

    On ``timeout`` the whole process group is killed (launcher, fork server and ranks), so a hung run leaves no
    ranks behind to slow the tests after it, and ``subprocess.TimeoutExpired`` is raised. Without ``env`` the run
    is a child of the session's warm interpreter (``tests/warm.py``: the same process, its imports already done), as
    it is with variables only read when used (``READ_WHEN_USED``); with others, a cold ``python`` (they may be read
    as modules are imported)."""
    command = [sys.executable, str(REPO / "train.py"), *args]
    environment = {key: value for key, value in {**os.environ, **(env or {})}.items() if value is not None}
    if set(env or {}) <= READ_WHEN_USED:
        code, stdout, stderr = warm_python().run(command[1:], cwd=cwd, env=environment, timeout=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, code, stdout, stderr)
    return run_in_own_group(command, cwd=cwd, env=environment, timeout=timeout)


# Variables distrain reads when it uses them, never as a module is imported (distrain.trainer.faults).
READ_WHEN_USED = {"DISTRAIN_INJECT_FAULT", "DISTRAIN_INJECT_DELAY"}


_warm: list[WarmPython] = []


def warm_python() -> WarmPython:
    """The session's warm interpreter (started on first use, with this process's environment then)."""
    if not _warm:
        _warm.append(WarmPython(["torch", "hydra", "distrain.launch.entry", "distrain.trainer.rank"], dict(os.environ)))
        atexit.register(_warm[0].close)
    return _warm[0]


def run_in_own_group(command: list[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` in a new session, killed as a group on timeout."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **popen
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from None
        except BaseException:  # pytest-timeout, Ctrl-C: the run has a session of its own and would live on
            os.killpg(process.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def train_steps(cfg_dicts: list[dict[str, Any]], steps: int, checkpoint_at: int | None = None) -> list[dict[str, Any]]:
    """On every rank: build each config like train.py does and take ``steps`` optimizer steps.

    With ``checkpoint_at``, a checkpoint is saved after that step, the run continues to ``steps``, then a fresh
    build resumes from the checkpoint and repeats the remaining steps (``resumed_losses``).
    """
    import tempfile

    from distrain.checkpoint.checkpointer import Checkpointer
    from distrain.parallelism.compile import compile_report
    from distrain.trainer.build import build
    from distrain.trainer.loop import TrainState, loop_state, restore_loop_state

    env = join(None)
    results = []
    try:
        for cfg_dict in cfg_dicts:
            cfg = OmegaConf.create(cfg_dict)
            if cfg.compile:  # what dynamo compiles for this config alone
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
            run_dir = tempfile.mkdtemp() if env.rank == 0 else ""
            shared = [run_dir]
            torch.distributed.broadcast_object_list(shared)
            run = build(cfg, env, run_dir=shared[0])
            state, losses, saved = TrainState(), [], None
            for step in range(1, steps + 1):
                losses.append(run.strategy.train_step(run.data.next_step()).loss.item())
                state.step = step
                if step == checkpoint_at:
                    saved = run.checkpointer.save(step, run.strategy, loop_state(state, run.data))
            result = {"losses": losses, "memory": run.strategy.model_state_bytes().as_dict()}
            if cfg.compile:
                result["compile"] = compile_report().as_dict()
            del run
            if saved is not None:
                resumed, state = build(cfg, env, run_dir=shared[0]), TrainState()
                restore_loop_state(
                    Checkpointer.load(saved, resumed.strategy, loop_state(state, resumed.data)), state, resumed.data
                )
                result["resumed_from_step"] = state.step
                result["resumed_losses"] = [
                    resumed.strategy.train_step(resumed.data.next_step()).loss.item() for _ in range(steps - state.step)
                ]
                del resumed
            results.append(result)
    finally:
        leave()
    return results


def nanogpt_char_dataset(directory: Path, text: str) -> Path:
    """What nanoGPT's shakespeare_char/prepare.py writes: uint16 character ids in train.bin/val.bin, meta.pkl."""
    directory.mkdir()
    chars = sorted(set(text))
    stoi, itos = {c: i for i, c in enumerate(chars)}, dict(enumerate(chars))
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    ids[: len(ids) * 9 // 10].tofile(directory / "train.bin")
    ids[len(ids) * 9 // 10 :].tofile(directory / "val.bin")
    with open(directory / "meta.pkl", "wb") as file:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, file)
    return directory
