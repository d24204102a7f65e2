"""Document masking's cost and effect: ``model=llama_tiny`` trained on the same prepared corpus with and without
``data.document_masking``, side by side in one run of this script (same seed, steps and batches).

The corpus is the standard library's ``asyncio`` and ``email`` packages cut into documents at top-level ``def`` and
``class`` lines (a few hundred tokens each), so every window packs several documents, as short web documents do in
pretraining. Reports each run's median step time and throughput (the ratio is masking's cost: the mask is built in
every attention, and SDPA runs its general masked kernel instead of the causal one) and its final validation loss.
The two validation losses measure different things: the masked run's counts no target across a document boundary
and gives each token only its own document as context.

    python benchmarks/document_masking.py
    python benchmarks/document_masking.py --steps 300 --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sysconfig
import tempfile
from pathlib import Path

from common import metrics, publish, train

from distrain.data.prepare import prepare


def write_documents(out: Path) -> int:
    """JSON Lines of the packages' source cut at top-level definitions; returns the number of documents."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for package in ("asyncio", "email"):
        for path in sorted((root / package).glob("*.py")):
            pieces = re.split(r"\n(?=def |class )", path.read_text(errors="replace"))
            documents += [piece for piece in pieces if piece.strip()]
    out.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    return len(documents)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        count = write_documents(work / "documents.jsonl")
        summary = prepare([work / "documents.jsonl"], work / "data", vocab_size=2048, val_fraction=0.05, quiet=True)
        common = ["model=llama_tiny", f"model.max_seq_len={args.seq_len}", "data=tokens", f"data.path={work / 'data'}",
                  f"data.seq_len={args.seq_len}", "data.micro_batch_size=8", f"trainer.max_steps={args.steps}",
                  f"trainer.eval_every={args.steps}", "trainer.log_every=10", "checkpoint=none",
                  "logger=none"]  # fmt: skip
        runs = {}
        for name, masking in (("without masking", "false"), ("with masking", "true")):
            run_dir = work / name.replace(" ", "_")
            final = train([*common, f"data.document_masking={masking}"], run_dir)
            records = [r for r in metrics(run_dir) if "step_time_s" in r][1:]  # the first window holds start-up
            runs[name] = {
                "step_time_s": statistics.median(r["step_time_s"] for r in records),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
                "val_loss": final["final_val_loss"],
                "loss": records[-1]["loss"],
            }
    base = runs["without masking"]["step_time_s"]
    rows = [
        f"{count} documents, {summary['tokens']:,} tokens (vocabulary 2048), windows of {args.seq_len} tokens "
        f"(about {summary['tokens'] / count:.0f} tokens per document); {args.steps} steps of 8 sequences per rank, "
        "train.py's default layout (DDP over 2 gloo ranks on CPU).",
        "",
        "| run | median step time (s) | vs without | tokens/s | train loss (last window) | final val_loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        rows.append(
            f"| {name} | {run['step_time_s']:.4f} | {run['step_time_s'] / base:.3f}x | {run['tokens_per_s']:,.0f} "
            f"| {run['loss']:.4f} | {run['val_loss']:.4f} |"
        )
    publish("# Document masking: cost and validation loss (llama_tiny)", rows, args.out_dir, "document_masking")


if __name__ == "__main__":
    main()
