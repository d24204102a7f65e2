"""Sample text from a checkpoint, decoded with the tokenizer the run's data was made with.

    python -m distrain.tools.generate outputs/.../checkpoints/step_00000200 --prompt "def main(" --max-new-tokens 200

CHECKPOINT may also be a run directory (or its ``checkpoints/``): its newest complete checkpoint is used. Runs in
one process on the CPU (or ``--device cuda``), without a process group: the checkpoint's model is rebuilt
from its own ``config.yaml`` and its consolidated weights loaded (any strategy's format, as ``export`` reads them).
The tokenizer is, in order: ``--tokenizer`` (a ``tokenizer.json``, a Hugging Face model directory, nanoGPT's
character-level ``meta.pkl``, or ``bytes``), the one beside the run's dataset (``data=tokens``; a nanoGPT dataset's
``meta.pkl``), the one in the Hugging Face directory the model came from
(``model=hf`` or ``model.init_from``), or bytes when the data was byte-level (the default corpus).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from distrain.artifacts.char_vocab import CharVocab
from distrain.artifacts.checkpoint import Checkpoint, inspect_checkpoint
from distrain.artifacts.hf_directory import read_config
from distrain.artifacts.tokenizer import inspect_tokenizer
from distrain.checkpoint.export import consolidated_model_state
from distrain.config.schema import register_configs
from distrain.data.tokens import dataset_path


class ByteTokenizer:
    """Token id = byte value (the built-in corpora's vocabulary of 256); undecodable bytes are replaced."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face ``tokenizers`` file (``tokenizer.json``), decoding special tokens as text is not wanted."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def read_tokenizer(path: Path, max_vocab: int | None) -> FileTokenizer | CharVocab:
    """The tokenizer at ``path`` (inspected: ``ArtifactError`` names what is wrong), producing ids < ``max_vocab``."""
    found = inspect_tokenizer(path, max_vocab=max_vocab, used_by="this checkpoint's model").tokenizer
    return found if isinstance(found, CharVocab) else FileTokenizer(found)


def find_tokenizer(cfg: DictConfig, override: str | None) -> ByteTokenizer | FileTokenizer | CharVocab:
    """The tokenizer to decode the run's ids with (see the module docstring); ValueError when there is none."""
    if override == "bytes":
        if cfg.model.get("vocab_size") and cfg.model.vocab_size > 256:
            raise ValueError(f"--tokenizer bytes decodes ids 0..255; this model has {cfg.model.vocab_size}")
        return ByteTokenizer()
    candidates: list[Path] = []
    if override:
        candidates.append(Path(override))
    elif dataset_path(cfg.data):
        from distrain.data.tokens import tokenizer_path

        beside_data = tokenizer_path(dataset_path(cfg.data))
        candidates += [beside_data] if beside_data else []
    source = cfg.model.get("name_or_path") or cfg.model.get("init_from")
    if source and not override:
        candidates.append(Path(source))
    vocab = model_vocab(cfg)
    if override:
        return read_tokenizer(Path(override), vocab)  # its inspector names what is wrong with it
    for candidate in candidates:
        file = candidate / "tokenizer.json" if candidate.is_dir() else candidate
        if file.is_file():
            return read_tokenizer(file, vocab)
    if not dataset_path(cfg.data) and cfg.model.get("vocab_size") == 256:
        return ByteTokenizer()
    raise ValueError("the run's data has no tokenizer beside it; give one with --tokenizer PATH (or bytes)")


def model_vocab(cfg: DictConfig) -> int | None:
    """The ids the run's model has embeddings for: ``model.vocab_size``, else its Hugging Face config.json's."""
    if isinstance(cfg.model.get("vocab_size"), int):
        return cfg.model.vocab_size
    source = cfg.model.get("name_or_path")
    return read_config(Path(source)).vocab_size if source else None


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    max_new_tokens: int,
    context: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    decodable: int | None = None,
) -> list[int]:
    """``max_new_tokens`` ids after ``prompt``, each drawn from the model's next-token distribution (temperature,
    then the ``top_k`` most likely; temperature 0: the most likely), the input cropped to the last ``context``.
    ``decodable``: only ids below it are drawn (a model whose vocabulary is padded beyond its tokenizer's)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -context:])[:, -1, :decodable].float().cpu()
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                threshold = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            next_id = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        ids = torch.cat([ids, next_id.to(device)], dim=1)
    return ids[0, len(prompt) :].tolist()


def load_model(checkpoint: Path | Checkpoint, device: str) -> tuple[torch.nn.Module, DictConfig]:
    """The checkpoint's model with its weights, in eval mode on ``device``, and the run's resolved config."""
    found = checkpoint if isinstance(checkpoint, Checkpoint) else inspect_checkpoint(checkpoint, tool="generate")
    cfg = found.config
    model_cfg = cfg.model.copy()
    if "init_from" in model_cfg:
        model_cfg.init_from = None  # the checkpoint holds the weights
    model = instantiate(model_cfg)
    model.load_state_dict(consolidated_model_state(found.path))
    return model.to(device).eval(), cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distrain.tools.generate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "checkpoint", type=Path, help="a step_* checkpoint directory, or a run directory (its newest checkpoint)"
    )
    parser.add_argument("--prompt", default="", help="text to continue (default: nothing)")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely token")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer.json, a Hugging Face model directory, nanoGPT's meta.pkl, or bytes (id = byte)",
    )
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    register_configs()
    try:
        if args.max_new_tokens < 1 or not 0 <= args.temperature < math.inf or args.top_k < 0:
            raise ValueError("--max-new-tokens must be >= 1, --temperature a finite number >= 0, --top-k >= 0")
        check_device(args.device)
        found = inspect_checkpoint(args.checkpoint, tool="generate")
        tokenizer = find_tokenizer(found.config, args.tokenizer)  # before the model: a bad one fails at once
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's loader prints: stdout holds only the text
            model, cfg = load_model(found, args.device)
        text = _generate(model, cfg, tokenizer, args)
    except (ValueError, FileNotFoundError) as err:  # ArtifactError included
        print(f"distrain generate: {err}", file=sys.stderr)
        return 2
    print(args.prompt + text)
    return 0


def check_device(name: str) -> None:
    """ValueError for a device torch does not know, or a CUDA device on a machine without one."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is visible here; use cpu")


def _generate(model: torch.nn.Module, cfg: DictConfig, tokenizer: Any, args: argparse.Namespace) -> str:
    prompt = tokenizer.encode(args.prompt) if args.prompt else [_start_id(cfg, tokenizer)]
    new_ids = sample(
        model,
        prompt,
        max_new_tokens=args.max_new_tokens,
        context=int(cfg.data.seq_len),
        temperature=args.temperature,
        top_k=args.top_k or None,
        generator=torch.Generator().manual_seed(args.seed),
        decodable=tokenizer.vocab_size if isinstance(tokenizer, CharVocab) else None,
    )
    return tokenizer.decode(new_ids)


def _start_id(cfg: DictConfig, tokenizer: Any) -> int:
    """Without a prompt, generation starts after an end of document (a prepared dataset's EOS), else a newline."""
    if dataset_path(cfg.data):
        from distrain.data.token_format import read_index
        from distrain.data.tokens import dataset_directory

        eos = read_index(dataset_directory(dataset_path(cfg.data)), "train").eos_id
        if eos is not None:
            return eos
    if isinstance(tokenizer, CharVocab):  # a newline where the vocabulary has one, else its first character
        return tokenizer.itos.index("\n") if "\n" in tokenizer.itos else 0
    return ord("\n")


if __name__ == "__main__":
    sys.exit(main())
