"""Context parallelism: activation memory per rank, and step time, against the number of ranks a sequence is split
over (cp), on real gloo CPU ranks with one thread each.

For each cp, ``cp`` ranks build the same fp32 Llama and the same ``batch x seq_len`` token ids; each rank feeds its
load-balanced share (``shard_sequence``, ``seq_len / cp`` tokens) to the model with a ``ContextParallel`` set on
every attention (cp=1: the plain model, no context, no collective). Measured on each rank:

- activation memory: the bytes autograd saves for backward during one forward and next-token loss on the local
  tokens (``saved_activation_bytes``: parameters excluded, each saved tensor counted once with the tensor it is a
  view of), the memory a training step holds at its peak;
- forward + backward time, the median of ``--repeats`` timed steps after one warm-up, each also shown as a ratio to
  cp=1 of the same invocation (absolute times on a shared 2-core machine are noisy): the rank's CPU time
  (``process_time``, the busiest rank's: the work a rank does, collectives included, little affected by other
  processes) and the group's wall time between barriers (what a step takes here, other load included).

Beside the measurement, the two terms that do not shrink with cp are computed from the shapes. Attention runs
``scaled_dot_product_attention`` on the whole sequence's keys and values (all-gathered at cp > 1), which saves them
repeated to the query heads: ``layers x 2 x batch x n_heads x seq_len x head_dim x 4`` bytes at every cp. At cp > 1
the causal mask over global positions is an explicit (seq_len / cp) x seq_len tensor, which SDPA saves as an fp32
additive mask: ``layers x (seq_len / cp) x seq_len x 4`` bytes. What is left (projections, MLP, norms, logits,
queries, attention outputs) scales as 1 / cp. The summed loss, all-reduced over the ranks, is printed as a check
that every cp computes the same thing.

Each rank runs one thread, so cp ranks use cp cores: on a 2-core machine cp=4 oversubscribes them, and any other
load on the machine slows the cp > 1 groups' wall time more than cp=1's; their wall ratios are not speed-ups.

    python benchmarks/context_parallel.py                              # seq 2048, cp 1 2 4
    python benchmarks/context_parallel.py --seq-len 4096 --cp 1 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from common import publish

from distrain.launch.process_group import init_distributed, shutdown_distributed
from distrain.launch.ranks import run_ranks
from distrain.models.llama.model import Llama
from distrain.models.llama.spec import enable_context_parallel
from distrain.models.spec import next_token_loss
from distrain.parallelism.context import ContextParallel, shard_sequence
from distrain.parallelism.recompute import saved_activation_bytes

MIB = 2**20


def build_model(args: argparse.Namespace) -> Llama:
    torch.manual_seed(0)  # the same weights on every rank
    return Llama(
        vocab_size=args.vocab,
        max_seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_hidden=args.ffn_hidden,
    )


def rank_main(args: argparse.Namespace, cp: int) -> dict[str, Any]:
    """One rank of a cp-rank group: activation bytes, median step wall and CPU times, and the loss summed over
    the group."""
    env = init_distributed(device="cpu", backend="gloo", timeout_s=300, threads_per_rank=1)
    try:
        model = build_model(args)
        if cp > 1:
            enable_context_parallel(model, ContextParallel(None, cp, env.rank))
        ids = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
        tokens, targets = shard_sequence(ids[:, :-1], cp, env.rank), shard_sequence(ids[:, 1:], cp, env.rank)
        total_tokens = args.batch * args.seq_len

        def loss_of(logits: torch.Tensor) -> torch.Tensor:
            # The mean over the whole batch: the ranks' terms add up to the single-process loss.
            return next_token_loss(logits, targets) / total_tokens

        activation = saved_activation_bytes(model, tokens, loss=loss_of)
        wall_times, cpu_times, loss = [], [], torch.zeros(())
        for step in range(args.repeats + 1):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = loss_of(model(tokens))
            loss.backward()
            cpu_time = time.process_time() - cpu_start
            dist.barrier()
            if step:  # the first step warms up
                wall_times.append(time.perf_counter() - start)
                cpu_times.append(cpu_time)
            model.zero_grad(set_to_none=True)
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        return {
            "local_tokens": tokens.shape[1],
            "activation": activation,
            "wall_time": statistics.median(wall_times),
            "cpu_time": statistics.median(cpu_times),
            "loss": summed.item(),
        }
    finally:
        shutdown_distributed()


def fixed_terms(args: argparse.Namespace, cp: int) -> tuple[int, int]:
    """Bytes of the saved whole-sequence keys and values (repeated to the query heads, as SDPA saves them) and of
    the saved fp32 mask (cp > 1 only), over all layers."""
    head_dim, fp32 = args.d_model // args.heads, 4
    kv = args.layers * 2 * args.batch * args.heads * args.seq_len * head_dim * fp32
    mask = args.layers * (args.seq_len // cp) * args.seq_len * fp32 if cp > 1 else 0
    return kv, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes (1 first)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn-hidden", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed forward + backward steps per cp (median)")
    args = parser.parse_args()
    if args.cp[0] != 1:
        parser.error("--cp must start with 1: it is the baseline of the ratios")
    for cp in args.cp:
        if args.seq_len % (2 * cp):
            parser.error(f"--seq-len {args.seq_len} must be divisible by 2 * cp = {2 * cp}")

    rows = [
        "| cp | local tokens / rank | activation MiB / rank | vs cp=1 | whole-seq K/V MiB | mask MiB | rest MiB"
        " | rest vs cp=1 | CPU s / rank | vs cp=1 | wall s | vs cp=1 | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base: dict[str, float] = {}
    for cp in args.cp:
        ranks = run_ranks(rank_main, (args, cp), nproc_per_node=cp, start_method="forkserver")
        activation = max(r["activation"] for r in ranks.values())  # the largest rank's (equal under load balance)
        cpu_time = max(r["cpu_time"] for r in ranks.values())  # the busiest rank's
        wall_time = ranks[0]["wall_time"]  # between barriers: the group's step
        kv, mask = fixed_terms(args, cp)
        rest = activation - kv - mask
        if cp == 1:
            base = {"activation": activation, "rest": rest, "cpu": cpu_time, "wall": wall_time}
        rows.append(
            f"| {cp} | {ranks[0]['local_tokens']} | {activation / MIB:.1f} | {activation / base['activation']:.2f}x"
            f" | {kv / MIB:.1f} | {mask / MIB:.1f} | {rest / MIB:.1f} | {rest / base['rest']:.2f}x"
            f" | {cpu_time:.3f} | {cpu_time / base['cpu']:.2f}x | {wall_time:.3f} | {wall_time / base['wall']:.2f}x"
            f" | {ranks[0]['loss']:.6f} |"
        )
        print(rows[-1], flush=True)
    head_dim = args.d_model // args.heads
    title = (
        f"Llama fp32, {args.layers} layers x {args.d_model} ({args.heads} heads, {args.kv_heads} kv heads, head_dim"
        f" {head_dim}), batch {args.batch} x {args.seq_len} tokens, gloo CPU ranks with 1 thread each,"
        f" median of {args.repeats} steps"
    )
    publish(title, rows, None, "context_parallel")


if __name__ == "__main__":
    main()
