"""The train loop: plain functions over a small, checkpointable ``TrainState``.

Collectives per step: the strategy's, then one small all-reduce on a CPU group where ranks agree on signals,
failures and pending asynchronous saves (``distrain.agreement``). Every ``log_every`` steps one all-reduce averages
the window's loss across ranks; every ``eval_every`` steps one all-reduce sums the validation loss.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from distrain.agreement import AgreementTimeout, PeerFailedError, StepAgreement, Verdict
from distrain.checkpoint.checkpointer import Checkpointer, rng_state, set_rng_state
from distrain.config import TrainerConfig
from distrain.data.sampler import Batch, TrainBatches
from distrain.dist import is_collective_timeout, is_peer_failure
from distrain.errors import CheckpointSpaceError
from distrain.faults import maybe_inject_delay, maybe_inject_fault
from distrain.logger.reporter import RunReporter
from distrain.monitor.profiler import StepProfiler
from distrain.monitor.system import peak_memory_bytes
from distrain.monitor.window import LogWindow
from distrain.parallelism.base import Strategy

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


@torch.no_grad()
def evaluate(strategy: Strategy, batches: list[Batch], device: torch.device) -> float:
    """Token-mean validation loss over every rank's batches (one all-reduce of two numbers on ``device``: NCCL
    reduces only device tensors)."""
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        loss_sum, tokens = strategy.eval_loss(batch)
        totals += torch.tensor([loss_sum.item(), tokens], dtype=torch.float64)
    totals = totals.to(device)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


@dataclass(frozen=True)
class _Boundary:
    """Where training stood before a step: what a failed step rolls back to before an emergency checkpoint."""

    step: int
    tokens_seen: int
    data: dict[str, Any]
    rng: dict[str, Any]


def _emergency_checkpoint(
    *, verdict: Verdict, checkpointer: Checkpointer, strategy: Strategy, extra: dict[str, Any]
) -> None:
    """Save after a failure only if every rank is at the same completed step with no half-applied update."""
    if not verdict.consistent:
        log.error(
            "no emergency checkpoint: ranks are not at one consistent step (a failure mid-update or mid-step) "
            "or the disk is full"
        )
    elif verdict.step == 0 or checkpointer.last_saved_step == verdict.step:
        log.error("no emergency checkpoint needed: step %d is already saved or nothing was trained", verdict.step)
    else:
        path = checkpointer.save(verdict.step, strategy, extra)
        log.error("emergency checkpoint after a failure on rank %s: %s", verdict.failed_rank, path)


def train(
    *,
    strategy: Strategy,
    data: TrainBatches,
    val_batches: list[Batch],
    state: TrainState,
    settings: TrainerConfig,
    reporter: RunReporter,
    checkpointer: Checkpointer,
    agreement: StepAgreement,
    window: LogWindow,
    profiler: StepProfiler,
    device: torch.device,
) -> dict[str, Any]:
    """Run optimizer steps until ``settings.max_steps``.

    At the end of every step all ranks agree (``agreement``) on whether to stop for a signal (save, then return)
    and whether some rank failed. After a failure, an emergency checkpoint is written when every rank is at the
    same completed step with no half-applied update, then the failure is raised (``PeerFailedError`` on the
    healthy ranks). Returns the summary (rank 0's is written to summary.json).
    """
    started, started_at = time.perf_counter(), time.time()
    window.restart()
    tokens_per_step = window.tokens_per_step
    skipped_steps = 0
    logged_losses: list[float] = []
    val_loss = float("nan")
    while state.step < settings.max_steps:
        boundary = _Boundary(state.step, state.tokens_seen, data.state_dict(), rng_state())
        failure: Exception | None = None
        try:
            marks = {"step_start": window.clock.mark()}
            micro_batches = data.next_step()
            marks["data_ready"] = window.clock.mark()
            maybe_inject_delay(dist.get_rank())
            result = strategy.train_step(micro_batches)
            skipped_steps += result.skipped
            if result.skipped:
                log.warning("step %d: non-finite gradient norm, update skipped", state.step + 1)
            state.step += 1
            state.tokens_seen += tokens_per_step
            window.add(result.loss, result.grad_norm, marks | result.marks)
            profiler.step()
            final = state.step == settings.max_steps
            record: dict[str, Any] = {"step": state.step}
            if state.step % settings.log_every == 0 or final:
                record |= window.close() | {
                    "lr": strategy.current_lr(),
                    "tokens_seen": state.tokens_seen,
                }
                if not logged_losses:
                    record["model_state_bytes"] = strategy.model_state_bytes().total
                logged_losses.append(record["loss"])
            paused = time.perf_counter()
            if (settings.eval_every > 0 and state.step % settings.eval_every == 0) or final:
                val_loss = record["val_loss"] = evaluate(strategy, val_batches, device)
            if checkpointer.due(state.step, final=final):
                checkpointer.save(state.step, strategy, loop_state(state, data), blocking=final)
            window.exclude(time.perf_counter() - paused)  # evaluation and checkpoints stay out of throughput
            if len(record) > 1:
                reporter.log(record)
            else:
                reporter.advance(state.step)
            maybe_inject_fault(dist.get_rank(), state.step)
        except Exception as err:  # noqa: BLE001 - any failure goes through the agreement below, then is re-raised
            failure = err
            log.error("step %d failed on this rank: %r", boundary.step + 1, err)
        # No emergency checkpoint from a half-applied update, nor onto a disk that just proved full.
        consistent = failure is None or not (strategy.updating or isinstance(failure, CheckpointSpaceError))
        if failure is not None and state.step == boundary.step:  # the step never completed: undo its data and RNG
            data.load_state_dict(boundary.data)
            set_rng_state(boundary.rng)
        if failure is not None and is_peer_failure(failure):
            log.error("no emergency checkpoint: another rank is gone")
            raise failure
        try:
            verdict = agreement.agree(
                step=state.step,
                failed=failure is not None,
                consistent=consistent,
                async_save_written=checkpointer.async_save_written(),
                failed_waiting=failure is not None and is_collective_timeout(failure),
            )
        except AgreementTimeout as timeout:  # raised on failed ranks only
            log.error("no emergency checkpoint: %s", timeout)
            raise failure from timeout
        if verdict.failed_rank is not None:
            if checkpointer.emergency:
                _emergency_checkpoint(
                    verdict=verdict,
                    checkpointer=checkpointer,
                    strategy=strategy,
                    extra=loop_state(state, data),
                )
            if failure is not None:
                raise failure
            raise PeerFailedError(f"rank {verdict.failed_rank} failed after step {verdict.step}")
        if verdict.async_save_written:
            checkpointer.wait_and_finalize()
        if verdict.stop:
            if window.steps:
                reporter.log({"step": state.step, **window.close(), "lr": strategy.current_lr()})
            if checkpointer.last_saved_step != state.step:
                checkpointer.save(state.step, strategy, loop_state(state, data))
            log.warning(
                "stopping at step %d on %s; checkpoint saved in %s",
                state.step,
                agreement.stop.signal_name,
                checkpointer.dir,
            )
            break
    checkpointer.wait_and_finalize()
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (peak_memory_bytes(device), strategy.model_state_bytes().as_dict()))
    return {
        "steps": state.step,
        "stopped_by": agreement.stop.signal_name if agreement.stop is not None else None,
        "skipped_steps": skipped_steps,
        "first_logged_loss": logged_losses[0] if logged_losses else None,
        "final_train_loss": logged_losses[-1] if logged_losses else None,
        "final_val_loss": val_loss,
        "tokens_seen": state.tokens_seen,
        "wall_time_s": time.perf_counter() - started,
        "loop_started_at": started_at,  # Unix time: start-up ends here (benchmarks/peers.py)
        "peak_memory_bytes_per_rank": [peak for peak, _ in per_rank],
        "model_state_bytes": per_rank[0][1],
        "model_state_bytes_per_rank": [state_bytes["total"] for _, state_bytes in per_rank],
    }
