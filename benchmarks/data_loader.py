"""The token-shard data path measured side by side in one run: peak memory of a rank's reader on a 10 MB and a
1.4 GB dataset, the reader's tokens/s against what training the default model consumes, and prepare's throughput
with 1 and 2 workers.

    python benchmarks/data_loader.py --out-dir benchmarks/results          # writes 1.4 GB under --work-dir
    python benchmarks/data_loader.py --big-tokens 50000000                  # a quicker look
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import REPO, publish, train

sys.path.insert(0, str(REPO))

# A rank's reader, alone in a fresh process: rank 0 of 2 data-parallel ranks, the default batch (8 x 128), the
# next step prefetched. Prints the growth of peak RSS while reading and the reader's tokens per second.
READER = """
import json, resource, sys, time
from distrain.data.sampler import GlobalBatchSampler, TrainBatches, token_windows
from distrain.data.tokens import token_corpus
path, steps = sys.argv[1], int(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
windows = token_windows(token_corpus(path).train, 128)
sampler = GlobalBatchSampler(num_samples=len(windows), micro_batch_size=8, grad_accum_steps=1, dp_rank=0, dp_size=2,
                             seed=0)
reader = TrainBatches(windows, sampler, prefetch=True)
reader.next_step()
start = time.perf_counter()
tokens = 0
for _ in range(steps):
    tokens += sum(batch.num_tokens for batch in reader.next_step())
seconds = time.perf_counter() - start
reader.close()
growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(json.dumps({"rss_growth": growth, "tokens_per_s": tokens / seconds, "windows": len(windows)}))
"""


def write_random_dataset(directory: Path, tokens: int, shards: int, chunk: int = 1 << 25) -> Path:
    """Random byte-valued ids (vocabulary 256, uint16) in ``shards`` train shards plus a small validation split,
    written in chunks so this process never holds the dataset."""
    from distrain.data.token_format import Shard, SplitIndex, crc32_of, read_index, sha256_of, write_index

    earlier = read_index(directory, "train") if (directory / "val.json").is_file() else None
    if earlier and earlier.tokens == tokens // shards * shards and earlier.shards[0].crc32:
        return directory  # written by an earlier run into the same --work-dir
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    layout = {"train": [tokens // shards] * shards, "val": [max(10_000, tokens // 200)]}
    for split, sizes in layout.items():
        written = []
        for number, size in enumerate(sizes):
            path = directory / f"{split}-{number:05d}.bin"
            with open(path, "wb") as file:
                for start in range(0, size, chunk):
                    rng.integers(0, 256, min(chunk, size - start), dtype=np.uint16).tofile(file)
            written.append(Shard(path.name, size, sha256_of(path), crc32_of(path)))  # as prepare writes them
        index = SplitIndex(split, "uint16", 256, None, None, None, sum(sizes), 255, tuple(written))
        write_index(directory, index)
    return directory


def read_alone(path: Path, steps: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", READER, str(path), str(steps)], cwd=REPO, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def prepare_throughput(work: Path, workers: int) -> dict[str, float]:
    """``python -m distrain.data.prepare`` on the standard library's .py files (BPE, vocabulary 8192)."""
    from distrain.data.corpus import stdlib_source_files

    out = work / f"prepared_{workers}"
    shutil.rmtree(out, ignore_errors=True)  # a finished output would make prepare a no-op
    files = [str(path) for path in stdlib_source_files()]  # not site-packages, which the stdlib directory holds
    command = [sys.executable, "-m", "distrain.data.prepare", "--out", str(out), "--input", *files]
    command += ["--vocab-size", "8192", "--workers", str(workers)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"prepare failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "prepare.json").read_text())["summary"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small-tokens", type=int, default=5_000_000, help="10 MB of uint16 ids")
    parser.add_argument("--big-tokens", type=int, default=700_000_000, help="1.4 GB of uint16 ids")
    parser.add_argument("--steps", type=int, default=2000, help="steps the reader is timed over")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the datasets go (default: a temp dir)")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="distrain_data_bench_"))
    small = write_random_dataset(work / "small", args.small_tokens, shards=2)
    big = write_random_dataset(work / "big", args.big_tokens, shards=4)
    reads = {"small": read_alone(small, args.steps), "big": read_alone(big, args.steps)}
    shutil.rmtree(work / "train_run", ignore_errors=True)  # a re-run into the same --work-dir starts afresh
    run = train(["data=tokens", f"data.path={small}", "logger=none", "trainer.max_steps=40"], work / "train_run")
    consumed_per_rank = run["metrics"]["tokens_per_s"]["mean"] / run["world_size"]
    prepared = {workers: prepare_throughput(work, workers) for workers in (1, 2)}

    mib = 2**20
    rows = ["| measurement | value |", "|---|---|"]
    for name, tokens in (("small", args.small_tokens), ("big", args.big_tokens)):
        growth_mib = reads[name]["rss_growth"] / mib
        rows.append(f"| reader peak RSS growth, {tokens * 2 / 1e9:.2f} GB dataset | {growth_mib:.1f} MiB |")
    growth = (reads["big"]["rss_growth"] - reads["small"]["rss_growth"]) / mib
    rows.append(f"| growth from the small to the big dataset (must be < 200 MiB) | {growth:.1f} MiB |")
    reader_rate = min(read["tokens_per_s"] for read in reads.values())
    rows.append(f"| reader alone, one rank (slower of the two datasets) | {reader_rate:,.0f} tokens/s |")
    rows.append(f"| training the default model consumes, per rank (ddp) | {consumed_per_rank:,.0f} tokens/s |")
    rows.append(f"| reader / consumption (must be >= 20) | {reader_rate / consumed_per_rank:.0f}x |")
    for workers, summary in prepared.items():
        rate = summary["tokens_per_second"]  # the tokenising pass (after BPE training, which is one process)
        rows.append(
            f"| prepare, {workers} worker(s): {summary['tokens']:,} tokens, whole run {summary['seconds']:.1f} s "
            f"| tokenising {rate:,.0f} tokens/s ({rate / workers:,.0f} per worker) |"
        )
    publish("Token-shard data path (one run, side by side)", rows, args.out_dir, "data_loader")


if __name__ == "__main__":
    main()
