"""The train loop: plain functions over a small, checkpointable ``TrainState``.

Collectives per step: the strategy's, then one small all-reduce on a CPU group where ranks agree on signals,
failures and pending asynchronous saves (``distrain.trainer.agreement``). Every ``log_every`` steps one all-reduce
averages
the window's loss across ranks; every ``eval_every`` steps one all-reduce sums the validation loss.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distrain.checkpoint.checkpointer import Checkpointer, rng_snapshot, set_rng_state
from distrain.config.schema import TrainerConfig
from distrain.data.packing import count_step_tokens
from distrain.data.sampler import TrainBatches
from distrain.data.validation import ValidationSets
from distrain.errors import ArtifactError, CheckpointSpaceError
from distrain.launch.process_group import is_collective_timeout, is_peer_failure
from distrain.monitor.profiler import StepProfiler
from distrain.monitor.system import peak_memory_bytes
from distrain.monitor.window import LogWindow
from distrain.parallelism.base import Strategy
from distrain.trackers.reporter import RunReporter
from distrain.trainer.agreement import AgreementTimeout, PeerFailedError, StepAgreement, Verdict
from distrain.trainer.faults import maybe_inject_delay, maybe_inject_fault

if TYPE_CHECKING:
    from distrain.ft.replicas import ReplicaGroups

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


def loop_state(state: TrainState, data: TrainBatches, replica_groups: ReplicaGroups | None = None) -> dict[str, Any]:
    """The loop's part of a checkpoint (the strategy saves model, optimizer, scheduler and scaler); with replica
    groups also the quorum's step (``ft``)."""
    saved = {"train": state.state_dict(), "data": data.state_dict()}
    if replica_groups is not None:
        saved["ft"] = replica_groups.state_dict()
    return saved


def restore_loop_state(
    loaded: dict[str, Any], state: TrainState, data: TrainBatches, replica_groups: ReplicaGroups | None = None
) -> None:
    state.load_state_dict(loaded["train"])
    data.load_state_dict(loaded["data"])
    if replica_groups is not None and "ft" in loaded:
        replica_groups.load_state_dict(loaded["ft"])


@torch.no_grad()
def evaluate_sets(strategy: Strategy, validation: ValidationSets, device: torch.device) -> dict[str, float]:
    """Each set's token-mean loss over every rank's batches, and ``val_loss`` (``ValidationSets.scores``). One
    all-reduce of a (sets, 2) float64 tensor of loss sums and token counts, on ``device``: NCCL reduces only device
    tensors."""
    totals = torch.zeros(len(validation.batches), 2, dtype=torch.float64)
    for row, batches in enumerate(validation.batches.values()):
        for batch in batches:
            loss_sum, tokens = strategy.eval_loss(batch)
            totals[row] += torch.tensor([loss_sum.item(), tokens], dtype=torch.float64)
    totals = totals.to(device)
    dist.all_reduce(totals)
    return validation.scores((totals[:, 0] / totals[:, 1]).tolist())


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


class UnreadStepError(RuntimeError):
    """A known data failure (``ArtifactError``) reading a step's batches, before the step's first collective. Its
    peers are then inside that step's collectives, waiting for this rank, and cannot reach the step boundary where
    ranks agree on an emergency checkpoint: this rank ends the job at once (the peers see it leave). With prefetch,
    a later step's read is found at the boundary before it (``TrainBatches.failed_read``), where ranks do agree."""


@dataclass
class _Loop:
    """What one run's steps work with: its components, and the totals the summary reports."""

    strategy: Strategy
    data: TrainBatches
    validation: ValidationSets
    state: TrainState
    settings: TrainerConfig
    reporter: RunReporter
    checkpointer: Checkpointer
    agreement: StepAgreement
    window: LogWindow
    profiler: StepProfiler
    device: torch.device
    replica_groups: ReplicaGroups | None = None
    skipped_steps: int = 0
    dropped_steps: int = 0  # ft=torchft: steps the quorum did not commit (a group failed during them), run again
    logged_losses: list[float] = field(default_factory=list)
    val_scores: dict[str, float] = field(default_factory=dict)  # the last validation's, per source of a mixture

    @property
    def val_loss(self) -> float | None:
        """The last validation loss; None until the first validation (a run stopped before it has none)."""
        return self.val_scores.get("val_loss")


def train(
    *,
    strategy: Strategy,
    data: TrainBatches,
    validation: ValidationSets,
    state: TrainState,
    settings: TrainerConfig,
    reporter: RunReporter,
    checkpointer: Checkpointer,
    agreement: StepAgreement,
    window: LogWindow,
    profiler: StepProfiler,
    device: torch.device,
    replica_groups: ReplicaGroups | None = None,
) -> dict[str, Any]:
    """Run optimizer steps until ``settings.max_steps``.

    At the end of every step all ranks agree (``agreement``) on whether to stop for a signal (save, then return)
    and whether some rank failed. After a failure, an emergency checkpoint is written when every rank is at the
    same completed step with no half-applied update, then the failure is raised (``PeerFailedError`` on the
    healthy ranks). Returns the summary (rank 0's is written to summary.json).
    """
    started, started_at = time.perf_counter(), time.time()
    loop = _Loop(
        strategy=strategy, data=data, validation=validation, state=state, settings=settings, reporter=reporter,
        checkpointer=checkpointer, agreement=agreement, window=window, profiler=profiler, device=device,
        replica_groups=replica_groups,
    )  # fmt: skip
    window.restart()
    while state.step < settings.max_steps:
        boundary = _Boundary(state.step, state.tokens_seen, data.state_dict(), rng_snapshot())
        failure: Exception | None = None
        try:
            _step(loop)
        except Exception as err:  # noqa: BLE001 - any failure goes through the agreement below, then is re-raised
            failure = err
            log.error("step %d failed on this rank: %r", boundary.step + 1, err)
        if _settle(loop, boundary, failure):
            break
    checkpointer.wait_and_finalize()
    return _summary(loop, started, started_at)


def _step(loop: _Loop) -> None:
    """One optimizer step, then what falls due after it: logging, evaluation, a checkpoint."""
    state, settings, window, strategy = loop.state, loop.settings, loop.window, loop.strategy
    marks = {"step_start": window.clock.mark()}
    if loop.replica_groups is not None:  # the step's quorum; a group behind takes a peer's state (and step) here
        loop.replica_groups.begin_step(state.step + 1)
        position = loop.data.state_dict()
    try:
        micro_batches = loop.data.next_step()
    except ArtifactError as err:  # read before any of the step's collectives: see _settle
        raise UnreadStepError(str(err)) from err
    marks["data_ready"] = window.clock.mark()
    micro_batches = count_step_tokens(micro_batches, loop.device)  # document masking: one all-reduce
    maybe_inject_delay(dist.get_rank())
    result = strategy.train_step(micro_batches)
    if not result.committed:  # a replica group failed during the step: run it again with the groups still alive
        loop.data.load_state_dict(position)
        loop.dropped_steps += 1
        log.warning(
            "step %d not committed by the replica groups' quorum (%s); running it again with the groups alive",
            state.step + 1,
            loop.replica_groups.last_failure or "a group failed",
        )
        return
    loop.skipped_steps += result.skipped
    if result.skipped:
        log.warning("step %d: non-finite gradient norm, update skipped", state.step + 1)
    state.step += 1
    state.tokens_seen += window.tokens_per_step
    window.add(result.loss, result.grad_norm, marks | result.marks)
    loop.profiler.step()
    final = state.step == settings.max_steps
    record: dict[str, Any] = {"step": state.step}
    if state.step % settings.log_every == 0 or final:
        record |= window.close() | {"lr": strategy.current_lr(), "tokens_seen": state.tokens_seen}
        record |= loop.data.fractions()  # a mixture's realised shares, over the run so far
        if not loop.logged_losses:
            record["model_state_bytes"] = strategy.model_state_bytes().total
        loop.logged_losses.append(record["loss"])
    paused = time.perf_counter()
    if settings.evaluates_after(state.step):
        loop.val_scores = evaluate_sets(strategy, loop.validation, loop.device)
        record |= loop.val_scores
    if len(record) > 1:
        loop.reporter.log(record)
    else:
        loop.reporter.advance(state.step)
    # After the step's record: a job killed between the two resumes from the checkpoint before, and rewinds and
    # re-logs this step; killed the other way round, it would resume after a step whose record was never written.
    if loop.checkpointer.due(state.step, final=final) and _saves(loop):
        loop.checkpointer.save(state.step, strategy, _loop_state(loop), blocking=final)
    window.exclude(time.perf_counter() - paused)  # evaluation and checkpoints stay out of throughput
    maybe_inject_fault(dist.get_rank(), state.step)


def _settle(loop: _Loop, boundary: _Boundary, failure: Exception | None) -> bool:
    """The end-of-step agreement: raise this rank's failure or a peer's (after an emergency checkpoint when every
    rank is consistent), finalize an asynchronous save, and return True when a stop signal ends the run here."""
    state, strategy, checkpointer = loop.state, loop.strategy, loop.checkpointer
    if failure is None and (failure := loop.data.failed_read()) is not None:
        log.error("the read of step %d failed on this rank: %s", state.step + 1, failure)
    # No emergency checkpoint from a half-applied update, nor onto a disk that just proved full.
    consistent = failure is None or not (strategy.updating or isinstance(failure, CheckpointSpaceError))
    if failure is not None and state.step == boundary.step:  # the step never completed: undo its data and RNG
        loop.data.load_state_dict(boundary.data)
        set_rng_state(boundary.rng)
    if failure is not None and is_peer_failure(failure):
        log.error("no emergency checkpoint: another rank is gone")
        raise failure
    if isinstance(failure, UnreadStepError):  # its peers wait in the step's collectives: none can reach a boundary
        log.error("no emergency checkpoint: this rank could not read its batches of step %d", state.step + 1)
        raise failure.__cause__
    try:
        verdict = loop.agreement.agree(
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
        if checkpointer.emergency and _saves(loop):
            extra = _loop_state(loop)
            _emergency_checkpoint(verdict=verdict, checkpointer=checkpointer, strategy=strategy, extra=extra)
        if failure is not None:
            raise failure
        raise PeerFailedError(f"rank {verdict.failed_rank} failed after step {verdict.step}")
    if verdict.async_save_written:
        checkpointer.wait_and_finalize()
    if not verdict.stop:
        return False
    if loop.window.steps:
        record = {"step": state.step, **loop.window.close(), "lr": strategy.current_lr(), **loop.data.fractions()}
        loop.logged_losses.append(record["loss"])  # the summary's final train loss is this window's
        loop.reporter.log(record)
    saves = _saves(loop)
    if checkpointer.last_saved_step != state.step and saves:
        checkpointer.save(state.step, strategy, _loop_state(loop))
    if loop.reporter.enabled:  # one line for the run: every rank stopped at this step and saved its part
        where = f"checkpoint saved in {checkpointer.dir}" if saves else "the quorum's first replica group saves"
        log.warning("stopping at step %d on %s; %s", state.step, loop.agreement.stop.signal_name, where)
    return True


def _saves(loop: _Loop) -> bool:
    """Whether this rank's group writes checkpoints: always, but with replica groups only the quorum's first."""
    return loop.replica_groups is None or loop.replica_groups.saves_checkpoints()


def _loop_state(loop: _Loop) -> dict[str, Any]:
    return loop_state(loop.state, loop.data, loop.replica_groups)


def _summary(loop: _Loop, started: float, started_at: float) -> dict[str, Any]:
    """The run's summary on every rank. Collective: one all_gather of each rank's peak memory and model state."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (peak_memory_bytes(loop.device), loop.strategy.model_state_bytes().as_dict()))
    stop = loop.agreement.stop
    return {
        "steps": loop.state.step,
        "stopped_by": stop.signal_name if stop is not None else None,
        "skipped_steps": loop.skipped_steps,
        "dropped_steps": loop.dropped_steps,
        "first_logged_loss": loop.logged_losses[0] if loop.logged_losses else None,
        "final_train_loss": loop.logged_losses[-1] if loop.logged_losses else None,
        "final_val_loss": loop.val_loss,
        **{key: value for key, value in loop.val_scores.items() if key != "val_loss"},  # a mixture's sources
        **loop.data.fractions(),
        "tokens_seen": loop.state.tokens_seen,
        "wall_time_s": time.perf_counter() - started,
        "loop_started_at": started_at,  # Unix time: start-up ends here (benchmarks/peers.py)
        "peak_memory_bytes_per_rank": [peak for peak, _ in per_rank],
        "model_state_bytes": per_rank[0][1],
        "model_state_bytes_per_rank": [state_bytes["total"] for _, state_bytes in per_rank],
    }
