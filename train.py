"""distrain's one entry point: compose the config, validate it, start the ranks, build the components, train.

python train.py                                   # default: GPT on stdlib source, DDP over 2 CPU ranks
python train.py parallelism=single optimizer=sgd  # any group option, any key, as a Hydra override
torchrun --nproc_per_node 4 train.py ...          # under an outer launcher: one rank per process
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import record

from distrain import dry_run
from distrain.agreement import StepAgreement
from distrain.checkpoint.checkpointer import Checkpointer, checkpoint_step
from distrain.checkpoint.preflight import prepare_checkpoint_dir
from distrain.config import TrainerConfig, register_configs
from distrain.data.sampler import Batch, GlobalBatchSampler, TrainBatches, token_windows, validation_batches
from distrain.dist import DistEnv, configure_logging, init_distributed, is_peer_failure, shutdown_distributed
from distrain.errors import RunError, run_error_line
from distrain.launch import (
    ChildFailedError,
    adopt_slurm_tasks,
    in_slurm_job,
    inside_launcher,
    launcher_rank,
    requeue_slurm_job,
    resume_setting,
    run_ranks,
    slurm_restart_count,
)
from distrain.logger.reporter import RunReporter
from distrain.loop import TrainState, loop_state, restore_loop_state, train
from distrain.models.spec import spec_of
from distrain.monitor.flops import peak_flops_per_device
from distrain.monitor.profiler import StepProfiler
from distrain.monitor.timing import Clock
from distrain.monitor.window import LogWindow
from distrain.overrides import composition_error, plain_overrides, quote_group_options
from distrain.parallelism.base import Strategy, StrategyContext
from distrain.parallelism.compile import apply_compile, compile_report
from distrain.parallelism.memory import predicted_state_for_summary
from distrain.parallelism.recompute import apply_activation_checkpointing
from distrain.preemption import REQUEUE_EXIT_CODE, StopRequest
from distrain.seeding import seed_everything
from distrain.validate import ConfigError, LaunchPlan, absolute_paths, validate

register_configs()
# conf/hydra/launcher/submitit_slurm.yaml gives the plugin's launcher our defaults and is checked against its schema
# on purpose; Hydra warns about that matching by name on every such run.
warnings.filterwarnings("ignore", message=".*is validated against ConfigStore schema with the same name")

PEER_FAILURE_GRACE_S = 5.0
RUN_ERROR_FILE = "run_error_rank{rank}.txt"  # in the run directory: a RunError the rank raised, for the report
log = logging.getLogger("distrain.train")


@dataclass
class RankRun:
    """The components of one rank, built in dependency order and handed to the loop."""

    strategy: Strategy
    data: TrainBatches
    val_batches: list[Batch]
    reporter: RunReporter
    checkpointer: Checkpointer
    settings: TrainerConfig
    window: LogWindow
    model_parameters: int


def build(cfg: DictConfig, env: DistEnv, run_dir: str) -> RankRun:
    """Build model, strategy (which wraps or shards it and builds the optimizer), data, reporting, checkpoints."""
    settings = TrainerConfig(**cfg.trainer)
    seed_everything(settings.seed)
    torch.autograd.set_detect_anomaly(settings.detect_anomaly)
    model = instantiate(cfg.model)
    model_parameters = sum(p.numel() for p in model.parameters())
    flops_per_token = spec_of(model).flops_per_token(model, cfg.data.seq_len)
    # Before any strategy wraps the model: it changes no names, and recomputation then runs inside TP and FSDP.
    apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.activation_checkpointing_every)
    strategy = instantiate(cfg.parallelism)
    if cfg.compile and strategy.compile_unsupported:
        if env.is_main:
            log.warning(
                "compile=true ignored with parallelism=%s, running eagerly: %s",
                strategy.name,
                strategy.compile_unsupported,
            )
    elif cfg.compile:  # compiles lazily at the first forward, inside whatever the strategy wraps around it
        apply_compile(model, cfg.compile_scope, cfg.compile_backend)
    precision = instantiate(cfg.precision)
    strategy.setup(
        model,
        StrategyContext(
            env=env,
            build_optimizer=instantiate(cfg.optimizer),
            build_scheduler=partial(instantiate(cfg.scheduler), total_steps=settings.max_steps),
            precision=precision,
            comm=instantiate(cfg.comm),
            grad_clip_norm=settings.grad_clip_norm,
            on_nonfinite=settings.on_nonfinite,
            micro_batch_size=cfg.data.micro_batch_size,
            grad_accum_steps=settings.grad_accum_steps,
            run_dir=run_dir,
            clock=Clock(env.device),
        ),
    )
    data, val_batches = build_data(cfg, settings, strategy.data_parallel, pin_memory=env.device.type == "cuda")
    reporter = RunReporter(
        run_dir=run_dir,
        trackers={name: instantiate(tracker) for name, tracker in cfg.logger.items()},
        enabled=env.is_main,
        max_steps=settings.max_steps,
        progress_bar=settings.progress_bar,
    )
    return RankRun(
        strategy=strategy,
        data=data,
        val_batches=val_batches,
        reporter=reporter,
        checkpointer=instantiate(cfg.checkpoint)(
            run_dir=run_dir, config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        ),
        settings=settings,
        window=LogWindow(
            device=env.device,
            tokens_per_step=data.sampler.global_batch_size * cfg.data.seq_len,
            samples_per_step=data.sampler.global_batch_size,
            flops_per_token=flops_per_token,
            peak_flops=peak_flops_per_device(env.device, precision.compute_dtype, cfg.monitor.peak_flops),
            straggler_threshold=cfg.monitor.straggler_threshold,
        ),
        model_parameters=model_parameters,
    )


def build_data(
    cfg: DictConfig, settings: TrainerConfig, data_parallel: tuple[int, int], *, pin_memory: bool
) -> tuple[TrainBatches, list[Batch]]:
    """This rank's training batches (its share of each global batch) and validation batches, for its position
    ``(dp_rank, dp_size)`` on the data-parallel axis."""
    corpus = instantiate(cfg.data.corpus)
    dp_rank, dp_size = data_parallel
    train_windows = token_windows(corpus.train, cfg.data.seq_len)
    sampler = GlobalBatchSampler(
        num_samples=len(train_windows),
        limit_batches=settings.overfit_batches,
        micro_batch_size=cfg.data.micro_batch_size,
        grad_accum_steps=settings.grad_accum_steps,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=settings.seed,
    )
    val_batches = validation_batches(
        token_windows(corpus.val, cfg.data.seq_len),
        micro_batch_size=cfg.data.micro_batch_size,
        num_batches=settings.eval_batches,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    train = TrainBatches(train_windows, sampler, prefetch=cfg.data.get("prefetch", False), pin_memory=pin_memory)
    return train, val_batches


@record
def build_and_train(cfg_dict: dict[str, Any], run_dir: str, run_name: str, run_group: str | None) -> dict[str, Any]:
    """One rank's work: join the process group, build every component, train, report."""
    cfg = OmegaConf.create(cfg_dict)
    env = init_distributed(**{k: cfg.distributed[k] for k in ("device", "backend", "timeout_s", "threads_per_rank")})
    completed, run = False, None
    try:
        shared = [run_dir, run_name, run_group]
        dist.broadcast_object_list(shared, src=0)  # under torchrun only rank 0 composed the real run directory
        run_dir, run_name, run_group = shared
        configure_logging(env.rank, Path(run_dir) / "train.log")
        run = build(cfg, env, run_dir)
        if env.is_main:
            log.info(run.data.sampler.describe(cfg.data.seq_len))
        state = TrainState()
        run.checkpointer.resume = resume_setting(run.checkpointer.resume)
        resume_from = run.checkpointer.resume_path()
        if resume_from is not None:
            loaded = Checkpointer.load(resume_from, run.strategy, loop_state(state, run.data))
            restore_loop_state(loaded, state, run.data)
            log.info("resumed from %s at step %d", resume_from, state.step)
        run.reporter.start(
            run_name=run_name,
            run_group=run_group,
            config=cfg_dict,
            initial_step=state.step,
            resumed_from=str(resume_from) if resume_from else None,
        )
        stop = StopRequest().install()
        agreement = StepAgreement(
            stop=stop, timeout_s=cfg.distributed.timeout_s, failure_timeout_s=run.checkpointer.emergency_timeout_s
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
                val_batches=run.val_batches,
                state=state,
                settings=run.settings,
                reporter=run.reporter,
                checkpointer=run.checkpointer,
                agreement=agreement,
                window=run.window,
                profiler=profiler,
                device=env.device,
            )
        stop.uninstall()
        summary |= {
            "world_size": env.world_size,
            "parallelism": run.strategy.name,
            "precision": cfg.precision.name,
            "model_parameters": run.model_parameters,
            **run.data.sampler.batch_settings(),
            "predicted_model_state_bytes": predicted_state_for_summary(
                cfg, run.strategy, env.world_size, run.model_parameters
            ),
        }
        if cfg.compile and not run.strategy.compile_unsupported:
            report = compile_report()
            summary["compile"] = report.as_dict()
            (log.warning if report.graph_breaks else log.info)(report.describe())
        nodes = [None] * env.world_size
        dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        summary["nodes"] = sorted(set(nodes))
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
        shutdown_distributed(graceful=completed)
        # Interpreter teardown would otherwise spend seconds per rank collecting torch's objects one by one.
        gc.freeze()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Validate, then run ``build_and_train`` on every rank; returns the final validation loss (for sweepers).

    With ``dry_run=true``: validate for ``target`` and print each rank's predicted memory there, in this process;
    exit 0 when every rank fits its device, 1 when one does not, 2 for an invalid config.
    """
    hydra_cfg = HydraConfig.get()
    if cfg.dry_run:
        try:
            report = dry_run.plan(cfg)
        except ConfigError as err:
            refuse(err)
        print(report.describe())
        dry_run.write_report(report, hydra_cfg.runtime.output_dir)
        if not report.fits:  # a non-zero exit keeps `train.py dry_run=true ... && sbatch ...` from submitting
            print(f"distrain: dry run: {report.shortfall()}", file=sys.stderr)
            sys.exit(1)
        return None
    adopt_slurm_tasks()  # a multi-task SLURM job: this task is one rank
    try:
        plan = validate(cfg)
    except ConfigError as err:
        refuse(err)
    run_dir = hydra_cfg.runtime.output_dir
    absolute_paths(cfg)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    cfg_dict["distributed"]["device"] = plan.device_type
    checkpoint_dir = cfg.checkpoint.dir or str(Path(run_dir) / "checkpoints")
    run_name = f"{hydra_cfg.job.name}/{Path(run_dir).relative_to(Path(run_dir).parents[1])}"
    resume = resume_setting(cfg.checkpoint.resume)
    with ExitStack() as held:
        try:  # one job per checkpoint directory, and a checkpoint that fits this config, before any rank starts
            finished = prepare_checkpoint_dir(
                cfg,
                directory=Path(checkpoint_dir),
                resume=resume,
                run_dir=run_dir,
                take_lock=launcher_rank() == 0,
                held=held,
                world_size=plan.world_size,
            )
        except ConfigError as err:
            refuse(err)
        except RunError as err:
            print(f"distrain: {err}", file=sys.stderr)
            sys.exit(2)
        if finished:  # e.g. a requeued job that had in fact finished: say so, change nothing
            print(
                f"distrain: the run is complete at step {checkpoint_step(finished)} (trainer.max_steps="
                f"{cfg.trainer.max_steps}, checkpoint {finished}); nothing to train",
                file=sys.stderr,
            )
            return None
        return launch(cfg, plan, (cfg_dict, run_dir, run_name, run_group(hydra_cfg)), checkpoint_dir)


def launch(cfg: DictConfig, plan: LaunchPlan, rank_args: tuple[Any, ...], checkpoint_dir: str) -> float | None:
    """Start the ranks and report how they ended; returns the final validation loss."""
    for stale in Path(rank_args[1]).glob(RUN_ERROR_FILE.format(rank="*")):
        stale.unlink()
    try:
        results = run_ranks(
            build_and_train,
            rank_args,
            nproc_per_node=plan.nproc_per_node,
            max_restarts=cfg.distributed.max_restarts,
            # CPU ranks fork from this process and skip re-importing torch; CUDA must not be forked.
            start_method="fork" if plan.device_type == "cpu" else "spawn",
        )
    except RunError as err:  # raised by the one rank this process ran itself
        fail(str(err))
    except ChildFailedError as err:
        fail(failure_line(err, rank_args[1]) or f"training failed\n{err.format_msg()}")
    except SignalException as err:  # the launcher forwarded the signal; ranks checkpointed at a step boundary
        stopped(err.sigval.name, checkpoint_dir, cfg.distributed.max_requeues)
    summary = results.get(0) or next(iter(results.values()), None)  # a SLURM task holds only its own rank
    if summary and summary["stopped_by"]:
        stopped(summary["stopped_by"], checkpoint_dir, cfg.distributed.max_requeues)
    return summary["final_val_loss"] if summary else None


def refuse(err: ConfigError) -> NoReturn:
    """A config mistake: one line naming the key, the value and what is allowed; exit 2 before any rank starts."""
    print(f"distrain: invalid config: {err}", file=sys.stderr)
    sys.exit(2)


def fail(message: str) -> NoReturn:
    """The job failed: ``distrain: <message>`` on stderr, exit 1."""
    print(f"distrain: {message}", file=sys.stderr)
    sys.exit(1)


def failure_line(err: ChildFailedError, run_dir: str) -> str | None:
    """The one line of a ``RunError`` some rank raised (a known cause: no traceback needed), if any."""
    for _, failure in sorted(err.failures.items(), key=lambda item: item[1].timestamp):
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
        line = run_error_line(message)
        if line:
            return line
    recorded = sorted(Path(run_dir).glob(RUN_ERROR_FILE.format(rank="*")))
    return recorded[0].read_text() if recorded else None


def run_group(hydra_cfg: DictConfig) -> str | None:
    """What groups this run with others in a tracker: its multirun sweep, else its SLURM job, else nothing."""
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return f"{hydra_cfg.job.name}/{hydra_cfg.sweep.dir}"
    slurm_job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    return f"slurm-{slurm_job}" if slurm_job else None


def stopped(signal_name: str, checkpoint_dir: str, max_requeues: int) -> None:
    """After a graceful stop: in a SLURM job, rank 0 requeues it (up to ``max_requeues`` times); exit 143."""
    if in_slurm_job() and launcher_rank() == 0:
        if slurm_restart_count() < max_requeues:
            print(f"distrain: requeueing SLURM job {os.environ['SLURM_JOB_ID']}", file=sys.stderr)
            requeue_slurm_job()
        else:
            print(f"distrain: not requeued: distributed.max_requeues={max_requeues} reached", file=sys.stderr)
    print(
        f"distrain: stopped by {signal_name} after checkpointing; continue with checkpoint.resume=auto "
        f"checkpoint.dir={checkpoint_dir} (exit status {REQUEUE_EXIT_CODE}: requeue)",
        file=sys.stderr,
    )
    sys.exit(REQUEUE_EXIT_CODE)


if __name__ == "__main__":
    if inside_launcher() and launcher_rank() != 0:
        # Under torchrun every process runs Hydra; only rank 0 may create the run directory.
        sys.argv += [
            "hydra.output_subdir=null",
            "hydra.run.dir=.",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
    sys.argv[1:] = quote_group_options(sys.argv[1:])  # debug=nan names conf/debug/nan.yaml, not a float
    overrides = plain_overrides(sys.argv[1:])
    problem = composition_error(overrides) if overrides is not None and not inside_launcher() else None
    if problem:
        print(f"distrain: invalid config: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        main()
    finally:
        gc.freeze()  # skip the seconds-long collection of torch's objects at interpreter exit
