"""Activation checkpointing side by side: activation memory kept for backward and step time, without it, selective
(every 2nd block) and full, on one process (CPU here; the CUDA allocator's peak when a GPU is present).

    python benchmarks/activation_checkpointing.py                     # gpt_small-like, 8 x 256 tokens
    python benchmarks/activation_checkpointing.py --layers 12 --d-model 512 --out-dir benchmarks/results
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
from common import one_process_gpt_parser, publish

from distrain.models.gpt import GPT
from distrain.parallelism.recompute import apply_activation_checkpointing, saved_activation_bytes


def main() -> None:
    parser = one_process_gpt_parser(__doc__)
    parser.add_argument("--out-dir", type=Path, default=None, help="write activation_checkpointing.md and .png here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    base = GPT(vocab_size=256, max_seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    tokens = torch.randint(0, 256, (args.batch, args.seq_len), device=device)
    rows = ["| mode | activation memory (MiB) | vs none | step (s) | vs none |", "|---|---|---|---|---|"]
    results = {}
    for mode in ("none", "selective", "full"):
        model = copy.deepcopy(base).to(device)
        apply_activation_checkpointing(model, mode, every=2)
        kept = saved_activation_bytes(model, tokens)
        times = []
        for _ in range(args.steps + 2):
            start = time.perf_counter()
            model(tokens).float().logsumexp(-1).mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results[mode] = (kept, statistics.mean(times[2:]))
        none_kept, none_time = results["none"]
        rows.append(
            f"| {mode} | {kept / 2**20:.1f} | {kept / none_kept:.2f}x | {results[mode][1]:.3f}"
            f" | {results[mode][1] / none_time:.2f}x |"
        )
        print(rows[-1], flush=True)
    title = (
        f"GPT {args.layers} blocks x {args.d_model}, {args.batch} x {args.seq_len} tokens, {device.type}, "
        f"forward + backward, {args.steps} steps"
    )
    memory = {mode: kept / 2**20 for mode, (kept, _) in results.items()}
    publish(title, rows, args.out_dir, "activation_checkpointing", bars=(memory, "activation MiB kept for backward"))


if __name__ == "__main__":
    main()
