"""data=mix's sampler on a large source beside small ones: its memory stays flat over a long run, and the realised
proportions match the weights.

Builds a mixture of one 1.4 GB source (700M uint16 ids in one shard: a sparse file, since the sampler never reads
tokens and the windows read here are zeros) and two small ones, then draws ``--steps`` global batches of
``--global-batch`` sequences, reading every 100th step's windows as the ranks would. Reports the process's resident
memory (RSS) after building the mixture and along the run, the time per step the sampler takes, and each source's
realised share against its weight.

    python benchmarks/mixture_sampler.py
    python benchmarks/mixture_sampler.py --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import psutil

from distrain.data.mixture import mixture_corpus
from distrain.data.token_format import Shard, SplitIndex, write_index

WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}
TOKENS = {"web": 700_000_000, "code": 2_000_000, "math": 300_000}  # web: 1.4 GB of uint16 ids


def write_source(directory: Path, tokens: int) -> None:
    """A dataset whose train shard is a sparse file of ``tokens`` ids (checksums are not verified here)."""
    directory.mkdir(parents=True)
    for split, count in (("train", tokens), ("val", 100_000)):
        shard = directory / f"{split}-00000.bin"
        with open(shard, "wb") as handle:
            handle.truncate(count * 2)
        write_index(
            directory,
            SplitIndex(split, "uint16", 50_304, None, None, None, count, 0, (Shard(shard.name, count, "0" * 64),)),
        )


def resident_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for name, tokens in TOKENS.items():
            write_source(Path(root) / name, tokens)
        before = resident_mb()
        corpus = mixture_corpus({name: {"path": f"{root}/{name}", "weight": w} for name, w in WEIGHTS.items()})
        windows = corpus.train.windows(args.seq_len)
        sampler = windows.sampler(micro_batch_size=args.global_batch, grad_accum_steps=1, dp_rank=0, dp_size=1, seed=0)
        sampler.next_step()
        built = resident_mb()
        memory, started = [], time.perf_counter()
        for step in range(2, args.steps + 1):
            (indices,) = sampler.next_step()
            if step % 100 == 0:
                windows.batch(indices)
                memory.append((step, resident_mb()))
        per_step_ms = (time.perf_counter() - started) / (args.steps - 1) * 1e3
        fractions = sampler.fractions(sampler.state_dict())
    lines = [
        f"# data=mix sampler: {args.steps} steps of {args.global_batch} sequences of {args.seq_len} tokens",
        "",
        f"Sources: {', '.join(f'{n} {TOKENS[n] * 2 / 1e9:.3g} GB ({windows.counts[n]:,} windows)' for n in TOKENS)}.",
        "",
        "| | resident memory (MB) |",
        "|---|---|",
        f"| before the mixture | {before:.0f} |",
        f"| mixture built, first step drawn | {built:.0f} |",
        *(f"| after step {step} | {mb:.0f} |" for step, mb in memory[:: max(1, len(memory) // 6)]),
        f"| after step {memory[-1][0]} | {memory[-1][1]:.0f} |",
        "",
        f"Sampler time per step: {per_step_ms:.2f} ms (one process, {args.global_batch} sequences).",
        "",
        "| source | weight | realised share |",
        "|---|---|---|",
        *(f"| {n} | {w:.2f} | {fractions[f'data/{n}/fraction']:.6f} |" for n, w in WEIGHTS.items()),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "mixture_sampler.md").write_text(report)


if __name__ == "__main__":
    main()
