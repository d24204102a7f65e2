"""What the inspections of users' files cost at start-up, measured side by side in one run: the token-dataset
inspector on a 1.4 GB dataset (with and without its shards' checksums), the Hugging Face directory inspector on a
1.24B-parameter Llama (Llama 3.2 1B's shapes) stored as two safetensors shards with an index, and each against the
start-up of the job that pays it (train.py to the end of its first step).

    python benchmarks/inspection.py --out-dir benchmarks/results     # writes 1.4 GB + 5 GB (sparse) under --work-dir

The safetensors files are written header first and then extended to their full size without writing data (sparse
files of zeros): the inspector reads headers only, and loading them reads zeros.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from common import REPO, publish
from data_loader import write_random_dataset

sys.path.insert(0, str(REPO))

LLAMA_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
}
TRAIN = ["parallelism=single", "logger=none", "checkpoint=none", "trainer.max_steps=1", "trainer.eval_every=0"]


def write_sparse_llama(directory: Path, shards: int = 2) -> Path:
    """A 1.24B-parameter LlamaForCausalLM directory: config.json, ``shards`` safetensors files of zeros (sparse)
    and their index, as ``save_pretrained`` lays them out."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (directory / "model.safetensors.index.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**LLAMA_1B)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = [(name, t) for name, t in model.state_dict().items() if name != "lm_head.weight"]  # tied: stored once
    per_shard = math.ceil(len(tensors) / shards)
    weight_map = {}
    for number in range(shards):
        name = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        part = tensors[number * per_shard : (number + 1) * per_shard]
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for tensor_name, tensor in part:
            size = tensor.numel() * 4
            header[tensor_name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[tensor_name] = name
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(directory / name, "wb") as file:
            file.write(len(encoded).to_bytes(8, "little") + encoded)
            file.truncate(8 + len(encoded) + offset)
    index = {"metadata": {"total_size": sum(t.numel() * 4 for _, t in tensors)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    config.save_pretrained(directory)
    return directory


@contextlib.contextmanager
def fresh_cache() -> Iterator[None]:
    """An empty cache of verified shards (``XDG_CACHE_HOME``) for this process and its children: a first start-up."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="inspection_cache_")
    try:
        yield
    finally:
        if before is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = before


def first_verification(inspect: Callable[..., object], dataset: Path) -> None:
    with fresh_cache():
        inspect(dataset, checksums=True)


def timed(function, repeats: int = 5) -> float:
    """Median seconds of ``function()`` over ``repeats`` calls (after one untimed warm-up call)."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


VALIDATE = """
import sys, time
from hydra import compose, initialize_config_dir
from distrain.config.schema import register_configs
from distrain.config.validate import validate
register_configs()
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose("config", overrides=sys.argv[2:])
start = time.perf_counter()
validate(cfg)
print(time.perf_counter() - start)
"""


def validation_seconds(overrides: list[str], *, first: bool) -> float:
    """Wall seconds of the launch's ``validate`` (what runs before any rank starts, its first model build
    included) in a fresh interpreter; ``first``: with an empty cache of verified shards (a first start-up)."""
    with fresh_cache() if first else contextlib.nullcontext():
        args = [sys.executable, "-c", VALIDATE, str(REPO / "conf"), *TRAIN, *overrides]
        done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def start_up(overrides: list[str], run_dir: Path) -> float:
    """Wall seconds of ``train.py`` with ``overrides`` (one step), from launch to exit."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "train.py", *TRAIN, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"train.py failed:\n{done.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-tokens", type=int, default=700_000_000, help="1.4 GB of uint16 ids")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the artifacts go (default: a temp dir)")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    from distrain.artifacts.hf_directory import inspect_hf_directory
    from distrain.artifacts.safetensors_set import inspect_safetensors
    from distrain.artifacts.token_dataset import inspect_token_dataset
    from distrain.data.token_format import read_index, remember_written

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="inspection_"))
    dataset = write_random_dataset(work / "big", args.big_tokens, shards=6)
    llama = write_sparse_llama(work / "llama_1b")
    gigabytes = sum(p.stat().st_size for p in dataset.glob("*.bin")) / 1e9
    parameters = inspect_safetensors(llama).bytes // 4
    rows = {
        "dataset_structure_s": timed(lambda: inspect_token_dataset(dataset, checksums=False)),
        "dataset_checksums_s": timed(lambda: first_verification(inspect_token_dataset, dataset), repeats=2),
        "dataset_checksums_cached_s": timed(lambda: inspect_token_dataset(dataset, checksums=True)),
        "safetensors_headers_s": timed(lambda: inspect_safetensors(llama)),
        "hf_directory_s": timed(lambda: inspect_hf_directory(llama)),
    }
    data_overrides = ["data=tokens", f"data.path={dataset}", "data.micro_batch_size=2"]
    without, first = [], []
    for attempt in range(3):  # alternated: the start-up with no checksums, then a first one with all of them
        without.append(start_up([*data_overrides, "data.verify_checksums=false"], work / f"run_data_{attempt}"))
        with fresh_cache():
            first.append(start_up(data_overrides, work / f"run_data_sums_{attempt}"))
    rows["startup_dataset_s"] = statistics.median(without)
    rows["startup_dataset_checksums_s"] = statistics.median(first)
    plain, checked = [], []
    for _ in range(7):  # alternated; the difference is what a first start-up's checksums add before ranks start
        plain.append(validation_seconds([*data_overrides, "data.verify_checksums=false"], first=False))
        checked.append(validation_seconds(data_overrides, first=True))
    rows["validate_s"], rows["validate_checksums_s"] = statistics.median(plain), statistics.median(checked)
    rows["startup_dataset_cached_s"] = start_up(data_overrides, work / "run_data_cached")  # verified above
    with fresh_cache():  # what prepare does as it finishes: its shards, hashed while written, recorded as verified
        for split in ("train", "val"):
            remember_written(dataset, read_index(dataset, split))
        rows["dataset_after_prepare_s"] = timed(lambda: inspect_token_dataset(dataset, checksums=True))
        rows["startup_dataset_after_prepare_s"] = start_up(data_overrides, work / "run_data_prepared")
    hf_overrides = ["model=hf", f"model.name_or_path={llama}", "data.seq_len=16", "data.micro_batch_size=1"]
    hf_overrides.append("optimizer=sgd")  # no optimizer state: 1.24B fp32 weights and gradients fit 24 GiB
    rows["startup_hf_1b_s"] = start_up(hf_overrides, work / "run_hf")
    report(rows, gigabytes, parameters, args.out_dir)


def report(rows: dict[str, float], gigabytes: float, parameters: int, out_dir: Path | None) -> None:
    def share(part: float, whole: float) -> str:
        return f"{part:.3f} s ({100 * part / whole:.1f}% of {whole:.1f} s)"

    added = max(0.0, rows["validate_checksums_s"] - rows["validate_s"])
    title = "Start-up cost of the inspections (one run, side by side; medians of 5 calls, checksums of 2; warm cache)"
    rows_out = [
        "| inspection | seconds | share of the job's start-up (train.py, 1 step, to exit) |",
        "|---|---|---|",
        f"| token dataset, {gigabytes:.2f} GB, structure only (data.verify_checksums=false) | "
        f"{rows['dataset_structure_s']:.3f} | {share(rows['dataset_structure_s'], rows['startup_dataset_s'])} |",
        f"| token dataset, {gigabytes:.2f} GB, CRC-32 of every shard, first start-up, copied from elsewhere | "
        f"{rows['dataset_checksums_s']:.3f} | {share(rows['dataset_checksums_s'], rows['startup_dataset_checksums_s'])}"
        " on its own |",
        "| the same, what it adds before any rank starts (checked on a thread while the rest of the config is "
        f"validated: validate() {rows['validate_s']:.3f} s without, {rows['validate_checksums_s']:.3f} s with; "
        "medians of 7, alternated) | "
        f"{added:.3f} | {share(added, rows['startup_dataset_checksums_s'])} |",
        f"| token dataset, {gigabytes:.2f} GB, checksums, first start-up after prepare wrote it on this machine | "
        f"{rows['dataset_after_prepare_s']:.3f} | "
        f"{share(rows['dataset_after_prepare_s'], rows['startup_dataset_after_prepare_s'])} |",
        f"| token dataset, {gigabytes:.2f} GB, checksums, later start-ups (shards verified, unchanged) | "
        f"{rows['dataset_checksums_cached_s']:.3f} | "
        f"{share(rows['dataset_checksums_cached_s'], rows['startup_dataset_cached_s'])} |",
        f"| safetensors set, {parameters / 1e9:.2f}B parameters in 2 shards, headers | "
        f"{rows['safetensors_headers_s']:.3f} | {share(rows['safetensors_headers_s'], rows['startup_hf_1b_s'])} |",
        f"| Hugging Face directory, same set (config, meta model, names and shapes) | {rows['hf_directory_s']:.3f} | "
        f"{share(rows['hf_directory_s'], rows['startup_hf_1b_s'])} |",
    ]
    publish(title, rows_out, out_dir, "inspection")


if __name__ == "__main__":
    main()
