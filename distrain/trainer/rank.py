"""One rank's work: join the process group, build every component, resume, train, report.

``build_and_train`` is what the launcher (``distrain.launch.ranks.run_ranks``) starts in every rank process; it lives in
the package, not in ``train.py``, so spawned ranks import it by name.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.errors import RUN_ERROR_FILE, RunError
from distrain.ft.replicas import group_run_dir, replica_group
from distrain.launch.process_group import (
    DistEnv,
    configure_logging,
    init_distributed,
    is_peer_failure,
    shutdown_distributed,
)
from distrain.launch.ranks import resume_setting
from distrain.monitor.profiler import StepProfiler
from distrain.parallelism.compile import compile_report
from distrain.parallelism.describe import layout_description
from distrain.parallelism.layout import layout_of
from distrain.planning.memory import predicted_state_for_summary
from distrain.trainer.agreement import StepAgreement
from distrain.trainer.build import RankRun, build
from distrain.trainer.loop import TrainState, loop_state, restore_loop_state, train
from distrain.trainer.preemption import StopRequest

PEER_FAILURE_GRACE_S = 5.0
log = logging.getLogger("distrain.train")


@record
def build_and_train(cfg_dict: dict[str, Any], run_dir: str, run_name: str, run_group: str | None) -> dict[str, Any]:
    """One rank's work; returns the run's summary. Collective throughout (every rank runs it)."""
    cfg = OmegaConf.create(cfg_dict)
    env = init_distributed(**{k: cfg.distributed[k] for k in ("device", "backend", "timeout_s", "threads_per_rank")})
    completed, run, replica_groups = False, None, None
    try:
        shared = [run_dir, run_name, run_group]
        dist.broadcast_object_list(shared, src=0)  # under torchrun only rank 0 composed the real run directory
        run_dir, run_name, run_group = shared
        run_dir = group_run_dir(run_dir)  # ft=torchft: each replica group's own log and metrics
        configure_logging(env.rank, Path(run_dir) / "train.log", replica_group())
        run = build(cfg, env, run_dir)
        if env.is_main:
            log.info(run.data.sampler.describe(cfg.data.seq_len))
        state = TrainState()
        replica_groups = run.replica_groups
        if replica_groups is not None:
            connect_replica_groups(run, state)
        resumed_from = resume(run, state)
        if replica_groups is not None:
            replica_groups.join()  # a group that (re)starts while others train takes their state here
            if replica_groups.healed_at is not None and env.is_main:
                log.warning("replica group %d joined at step %d with a peer's state", replica_groups.group, state.step)
        run.reporter.start(
            run_name=run_name, run_group=run_group, config=cfg_dict, initial_step=state.step, resumed_from=resumed_from
        )
        # Model, optimizer and everything built live until the end: full collections during training skip them
        # (each walked every object torch and the build made, 80 ms and more; shutdown_distributed unfreezes).
        # The young generations' garbage (the build's and resume's cycles) is collected first, not frozen with them.
        gc.collect(1)
        gc.freeze()
        summary = train_run(cfg, env, run, state, run_dir)
        run.reporter.finish(summary)
        run.data.close()  # the prefetching reader's thread
        run = None  # release DDP's reducer, which holds the process group, before leaving the group
        completed = True
        return summary
    except RunError as err:
        # The launcher may report another rank first (one this rank ended); the launching process reads this file.
        (Path(run_dir) / RUN_ERROR_FILE.format(rank=env.rank)).write_text(str(err))
        raise
    except Exception as err:
        if is_peer_failure(err):
            # Let the rank that really failed be reported first: the launcher names the earliest failure.
            time.sleep(PEER_FAILURE_GRACE_S)
        raise
    finally:
        if not completed and run is not None:
            run.reporter.fail()  # the bar closed and each tracker's run marked failed before the error is shown
        if replica_groups is not None:
            replica_groups.shutdown()
        shutdown_distributed(graceful=completed)
        # Interpreter teardown would otherwise spend seconds per rank collecting torch's objects one by one.
        gc.freeze()


def resume(run: RankRun, state: TrainState) -> str | None:
    """Load the checkpoint ``checkpoint.resume`` names, if any, into the run and ``state``; returns its path.
    Collective: the checkpoint load (DCP reads each rank's shards, the strategy may all-gather)."""
    run.checkpointer.resume = resume_setting(run.checkpointer.resume)
    resume_from = run.checkpointer.resume_path()
    if resume_from is None:
        return None
    from distrain.checkpoint.data_only import holds_replica_state  # imports DCP: only when resuming

    # The quorum's step is restored where the checkpoint holds it (one written with ft=torchft), else it is the
    # loop's step: the groups' Managers count committed steps from there.
    groups = run.replica_groups if run.replica_groups is not None and holds_replica_state(resume_from) else None
    loaded = Checkpointer.load(resume_from, run.strategy, loop_state(state, run.data, groups))
    restore_loop_state(loaded, state, run.data, groups)
    if run.replica_groups is not None and groups is None:
        run.replica_groups.load_state_dict({"step": state.step, "batches_committed": 0})
    log.info("resumed from %s at step %d", resume_from, state.step)
    return str(resume_from)


def connect_replica_groups(run: RankRun, state: TrainState) -> None:
    """ft=torchft: this rank's Manager, with what a healing group copies from this one and how it takes it."""

    def save() -> dict[str, Any]:
        return {"strategy": run.strategy.replica_state(), "loop": loop_state(state, run.data)}

    def load(healed: dict[str, Any]) -> None:
        run.strategy.load_replica_state(healed["strategy"])
        restore_loop_state(healed["loop"], state, run.data)

    run.replica_groups.connect(save, load)


def train_run(cfg: DictConfig, env: DistEnv, run: RankRun, state: TrainState, run_dir: str) -> dict[str, Any]:
    """The training loop under the stop-signal handler and the profiler; returns the summary. Collective
    throughout: every step's gradient exchange and agreement, evaluation, checkpoints
    (``distrain.trainer.loop.train``)."""
    stop = StopRequest().install()
    agreement = StepAgreement(
        # Under replica groups a signal stops every group at one step: the agreement reads what the groups agreed.
        stop=stop if run.replica_groups is None else run.replica_groups.agreed_stop(stop),
        timeout_s=cfg.distributed.timeout_s,
        failure_timeout_s=run.checkpointer.emergency_timeout_s,
    )
    profiler = StepProfiler(
        enabled=cfg.profile,
        run_dir=run_dir,
        rank=env.rank,
        start_step=state.step + cfg.monitor.profile_start_step,
        num_steps=cfg.monitor.profile_steps,
    )
    with profiler:
        summary = train(
            strategy=run.strategy,
            data=run.data,
            validation=run.validation,
            state=state,
            settings=run.settings,
            reporter=run.reporter,
            checkpointer=run.checkpointer,
            agreement=agreement,
            window=run.window,
            profiler=profiler,
            device=env.device,
            replica_groups=run.replica_groups,
        )
    stop.uninstall()
    return summary | run_facts(cfg, env, run)


def run_facts(cfg: DictConfig, env: DistEnv, run: RankRun) -> dict[str, Any]:
    """What ``summary.json`` states beside the loop's results: layout, batch, predicted memory, compile report and
    nodes. Collective: one all_gather_object of the host names."""
    layout = layout_of(cfg.parallelism, env.world_size, env.local_world_size)  # as the strategy resolved it
    facts = {
        "world_size": env.world_size,
        "parallelism": run.strategy.name,
        "layout": layout_description(cfg.parallelism, layout),
        "comm": cfg.comm.name,
        "replica_groups": run.replica_groups.count if run.replica_groups is not None else 1,
        "optimizer": cfg.optimizer._target_.rsplit(".", 1)[-1],
        "precision": cfg.precision.name,
        "model_parameters": run.model_parameters,
        **run.data.sampler.batch_settings(),
        "predicted_model_state_bytes": predicted_state_for_summary(cfg, layout, run.model_parameters),
    }
    if cfg.compile and not run.strategy.compile_unsupported:
        report = compile_report()
        facts["compile"] = report.as_dict()
        (log.warning if report.graph_breaks else log.info)(report.describe())
    nodes = [None] * env.world_size
    dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    facts["nodes"] = sorted(set(nodes))
    return facts
