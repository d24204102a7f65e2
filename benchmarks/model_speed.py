"""distrain's GPT against nanoGPT's model at the same shape: forward and backward of one training step, no framework.

Both models are built with the same shape (nanoGPT's shakespeare-char CPU recipe by default: 4 layers x 128, 4
heads, context 64, batch 12, no biases, head tied to the token embedding, dropout 0), in one process with every
core, and timed alternately (a round of each, ``--rounds`` times) so that load on the machine falls on both alike.
A step is: logits, cross-entropy, backward, zeroing the gradients (the optimizer is the same ``torch.optim.AdamW``
for both and left out). nanoGPT's ``model.py`` is imported from a checkout (``--nanogpt DIR``); nothing of it is
in this repository.

    git clone https://github.com/karpathy/nanoGPT
    python benchmarks/model_speed.py --nanogpt nanoGPT --out-dir benchmarks/results
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import one_process_gpt_parser, publish
from peer_nanogpt import nanogpt_module

from distrain.models.gpt import GPT


def nanogpt_model(checkout: Path, shape: dict[str, int]) -> torch.nn.Module:
    """nanoGPT's ``GPT`` from ``checkout/model.py`` with ``shape``, biases off, dropout 0 (its tied head built in)."""
    module = nanogpt_module(checkout)
    config = module.GPTConfig(
        block_size=shape["seq_len"], vocab_size=shape["vocab"], n_layer=shape["layers"], n_head=shape["heads"],
        n_embd=shape["d_model"], dropout=0.0, bias=False,
    )  # fmt: skip
    return module.GPT(config)


def distrain_model(shape: dict[str, int]) -> torch.nn.Module:
    return GPT(
        vocab_size=shape["vocab"], max_seq_len=shape["seq_len"], d_model=shape["d_model"], n_layers=shape["layers"],
        n_heads=shape["heads"], bias=False, tie_embeddings=True,
    )  # fmt: skip


def step(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, nanogpt: bool) -> None:
    if nanogpt:  # nanoGPT's forward computes the loss itself when given targets
        _, loss = model(tokens, targets)
    else:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def timed(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], steps: int, nanogpt: bool) -> float:
    """Mean seconds per step over ``steps`` steps."""
    started = time.perf_counter()
    for _ in range(steps):
        step(model, *batch, nanogpt)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = one_process_gpt_parser(__doc__)
    parser.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (its model.py)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=65)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=None)
    # nanoGPT's shakespeare-char CPU recipe; --steps is per round
    parser.set_defaults(layers=4, d_model=128, seq_len=64, batch=12, steps=50)
    args = parser.parse_args()
    if not (args.nanogpt / "model.py").is_file():
        parser.error(f"--nanogpt {args.nanogpt} is not allowed: a nanoGPT checkout (no model.py there)")
    shape = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq_len": args.seq_len}
    shape["vocab"] = args.vocab
    torch.manual_seed(0)
    models = {"nanoGPT": nanogpt_model(args.nanogpt, shape), "distrain": distrain_model(shape)}
    sizes = {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    batch = (tokens, torch.roll(tokens, -1, dims=1))
    times: dict[str, list[float]] = {name: [] for name in models}
    for name, model in models.items():  # warm-up: allocator, first-call costs
        timed(model, batch, 5, name == "nanoGPT")
    for _ in range(args.rounds):
        for name, model in models.items():
            times[name].append(timed(model, batch, args.steps, name == "nanoGPT"))
    median = {name: statistics.median(values) for name, values in times.items()}
    rows = ["| model | parameters | step (ms, median of rounds) | vs nanoGPT |", "|---|---|---|---|"]
    for name, seconds in median.items():
        ratio = seconds / median["nanoGPT"]
        rows.append(f"| {name} | {sizes[name]:,} | {seconds * 1e3:.2f} | {ratio:.3f}x |")
    title = (
        f"GPT forward + backward, {args.layers} x {args.d_model}, {args.heads} heads, context {args.seq_len}, batch "
        f"{args.batch}, no biases, tied head; {torch.get_num_threads()} threads, {args.rounds} alternating rounds of "
        f"{args.steps} steps; load average {os.getloadavg()[0]:.2f} at the end"
    )
    publish(title, rows, args.out_dir, "model_speed")


if __name__ == "__main__":
    main()
