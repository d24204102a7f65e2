"""torch.compile side by side: step time of eager, compiled blocks and the compiled whole model on one process
(CPU here; CUDA when a GPU is present), the first step's compile time, and how far the losses drift from eager.

The three models start from the same weights and see the same batches; each round times one AdamW step of every
variant in turn, so machine noise hits them alike.

    python benchmarks/compile.py                                    # 6 blocks x 256, 8 x 256 tokens
    python benchmarks/compile.py --backend inductor --out-dir benchmarks/results
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import one_process_gpt_parser, publish

from distrain.models.gpt import GPT
from distrain.parallelism.compile import apply_compile, compile_report


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    parser = one_process_gpt_parser(__doc__)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--out-dir", type=Path, default=None, help="write compile.md and .png here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    base = GPT(vocab_size=256, max_seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    batches = torch.randint(0, 256, (args.steps + 1, args.batch, args.seq_len + 1), device=device)
    variants = {}
    for name, scope in (("eager", None), ("compile blocks", "blocks"), ("compile model", "model")):
        model = copy.deepcopy(base).to(device)
        if scope is not None:
            apply_compile(model, scope, args.backend)
        variants[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    first_step = {}
    losses = {name: [] for name in variants}
    times = {name: [] for name in variants}
    for step, tokens in enumerate(batches):
        for name, (model, optimizer) in variants.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            losses[name].append(train_step(model, optimizer, tokens))
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if step == 0:  # the compiled variants compile here
                first_step[name] = elapsed
            else:
                times[name].append(elapsed)
    step_time = {name: statistics.median(values) for name, values in times.items()}
    rows = [
        "| variant | step (s) | vs eager | first step (s) | max loss diff vs eager |",
        "|---|---|---|---|---|",
    ]
    for name in variants:
        drift = max(abs(a - b) for a, b in zip(losses[name], losses["eager"], strict=True))
        rows.append(
            f"| {name} | {step_time[name]:.3f} | {step_time[name] / step_time['eager']:.2f}x "
            f"| {first_step[name]:.1f} | {drift:.1e} |"
        )
    report = compile_report()
    title = (
        f"GPT {args.layers} blocks x {args.d_model}, {args.batch} x {args.seq_len} tokens, {device.type}, "
        f"backend {args.backend}, AdamW step, median of {args.steps} steps after the first; {report.describe()}"
    )
    publish(title, rows, args.out_dir, "compile", bars=(step_time, "seconds per training step"))


if __name__ == "__main__":
    main()
