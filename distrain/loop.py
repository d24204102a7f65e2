"""The train loop: plain functions over a small, checkpointable ``TrainState``.

Collectives per step are only those the strategy runs. Every ``log_every`` steps one all-reduce averages the
window's loss across ranks; every ``eval_every`` steps one all-reduce sums the validation loss.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.config import TrainerConfig
from distrain.data.sampler import Batch, TrainBatches
from distrain.faults import maybe_inject_fault
from distrain.logger.reporter import RunReporter, peak_memory_bytes
from distrain.parallelism.base import Strategy
from distrain.preemption import StopRequest

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Counters that, with the strategy's and the data's state, define where training stands."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # global training tokens consumed

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


def loop_state(state: TrainState, data: TrainBatches) -> dict[str, Any]:
    """The loop's part of a checkpoint (the strategy saves model, optimizer, scheduler and scaler)."""
    return {"train": state.state_dict(), "data": data.state_dict()}


def restore_loop_state(loaded: dict[str, Any], state: TrainState, data: TrainBatches) -> None:
    state.load_state_dict(loaded["train"])
    data.load_state_dict(loaded["data"])


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) then divide by world size; gloo has no AVG op."""
    values = values.clone()
    dist.all_reduce(values)
    return values / dist.get_world_size()


@torch.no_grad()
def evaluate(strategy: Strategy, batches: list[Batch]) -> float:
    """Token-mean validation loss over every rank's batches (one all-reduce)."""
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        loss_sum, tokens = strategy.eval_loss(batch)
        totals += torch.tensor([loss_sum.item(), tokens], dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def train(
    *,
    strategy: Strategy,
    data: TrainBatches,
    val_batches: list[Batch],
    state: TrainState,
    settings: TrainerConfig,
    reporter: RunReporter,
    checkpointer: Checkpointer,
    tokens_per_step: int,
    device: torch.device,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    """Run optimizer steps until ``settings.max_steps``, or until ranks agree to stop after a signal (``stop``),
    which saves a checkpoint first. Returns the summary (rank 0's is written to summary.json)."""
    started = window_start = time.perf_counter()
    window = torch.zeros(2, device=device)  # summed loss and grad norm since the last log
    window_steps = skipped_steps = 0
    logged_losses: list[float] = []
    val_loss = float("nan")
    while state.step < settings.max_steps:
        result = strategy.train_step(data.next_step())
        if result.skipped:
            skipped_steps += 1
            log.warning("step %d: non-finite gradient norm, update skipped", state.step + 1)
        state.step += 1
        state.tokens_seen += tokens_per_step
        maybe_inject_fault(dist.get_rank(), state.step)
        window += torch.stack([result.loss, result.grad_norm])
        window_steps += 1
        stopping = stop is not None and stop.agreed(device)
        final = state.step == settings.max_steps or stopping
        record: dict[str, Any] = {"step": state.step}
        if state.step % settings.log_every == 0 or final:
            loss, grad_norm = mean_over_ranks(window / window_steps).tolist()
            elapsed = time.perf_counter() - window_start
            record |= {
                "loss": loss,
                "lr": strategy.current_lr(),
                "grad_norm": grad_norm,
                "step_time_s": elapsed / window_steps,
                "tokens_per_s": tokens_per_step * window_steps / elapsed,
                "tokens_seen": state.tokens_seen,
            }
            if not logged_losses:
                record["model_state_bytes"] = strategy.model_state_bytes().total
            logged_losses.append(loss)
            window.zero_()
            window_steps = 0
            window_start = time.perf_counter()
        paused = time.perf_counter()
        if (settings.eval_every > 0 and state.step % settings.eval_every == 0) or final:
            val_loss = record["val_loss"] = evaluate(strategy, val_batches)
        if checkpointer.due(state.step, final=final) or stopping:
            checkpointer.save(state.step, strategy, loop_state(state, data))
        window_start += time.perf_counter() - paused  # evaluation and checkpoints stay out of throughput
        if len(record) > 1:
            reporter.log(record)
        if stopping:
            log.warning(
                "stopping at step %d on %s; checkpoint saved in %s", state.step, stop.signal_name, checkpointer.dir
            )
            break
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (peak_memory_bytes(device), strategy.model_state_bytes().as_dict()))
    return {
        "steps": state.step,
        "stopped_by": stop.signal_name if stop is not None else None,
        "skipped_steps": skipped_steps,
        "first_logged_loss": logged_losses[0] if logged_losses else None,
        "final_train_loss": logged_losses[-1] if logged_losses else None,
        "final_val_loss": val_loss,
        "tokens_seen": state.tokens_seen,
        "wall_time_s": time.perf_counter() - started,
        "peak_memory_bytes_per_rank": [peak for peak, _ in per_rank],
        "model_state_bytes": per_rank[0][1],
        "model_state_bytes_per_rank": [state_bytes["total"] for _, state_bytes in per_rank],
    }
