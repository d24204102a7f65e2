"""What ``train.py`` does with a composed config: validate it, prepare the checkpoint directory, start the ranks
(``distrain.trainer.rank.build_and_train`` on each) and report how they ended; or, with ``dry_run=true``, plan memory.

Everything here runs in the launching process, before or after the ranks (under torchrun or a multi-task SLURM job
the launching process is itself one rank, and ``run_ranks`` runs its ``build_and_train`` in place).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.elastic.multiprocessing.api import SignalException

from distrain.artifacts.outputs import check_writable
from distrain.artifacts.run_directory import inspect_run_directory
from distrain.checkpoint.preflight import prepare_checkpoint_dir
from distrain.checkpoint.steps import checkpoint_step
from distrain.config.overrides import added_key_error, composition_error, plain_overrides, quote_group_options
from distrain.config.schema import register_configs
from distrain.config.validate import ConfigError, LaunchPlan, make_paths_absolute, validate
from distrain.errors import RUN_ERROR_FILE, ArtifactError, RunError, run_error_line
from distrain.ft.config import has_replica_groups
from distrain.launch.fork_server import shadowing_package
from distrain.launch.ranks import (
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
from distrain.trainer.preemption import REQUEUE_EXIT_CODE

register_configs()
# conf/hydra/launcher/submitit_slurm.yaml gives the plugin's launcher our defaults and is checked against its schema
# on purpose; Hydra warns about that matching by name on every such run.
warnings.filterwarnings("ignore", message=".*is validated against ConfigStore schema with the same name")
HYDRA_RAISES = "HYDRA_FULL_ERROR"
SUBMITIT_JOB = "SUBMITIT_EXECUTOR"  # set in the jobs submitit starts (to "slurm", or "local")


def prepare_command_line(argv: list[str]) -> None:
    """Before Hydra parses ``argv`` (in place): under torchrun, ranks other than 0 must not create a run directory;
    group options Hydra would read as numbers are quoted (``debug=nan``); a run directory that cannot be written
    exits 2 with one line."""
    if inside_launcher() and launcher_rank() != 0:
        argv += [
            "hydra.output_subdir=null",
            "hydra.run.dir=.",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
    argv[1:] = quote_group_options(argv[1:])
    problem = run_directory_problem(argv[1:])
    if problem:
        print(f"distrain: invalid config: {problem}", file=sys.stderr)
        sys.exit(2)


def compose_and_run(hydra_main: Callable[[], Any], argv: list[str]) -> None:
    """``hydra_main()`` (train.py's ``@hydra.main``), with an override Hydra cannot compose refused in one line
    (exit 2) instead of Hydra's page.

    Composing the overrides once more beforehand would cost every run a second composition (about 0.2 s of
    start-up), so Hydra is asked to raise instead of print (its ``HYDRA_FULL_ERROR``) only while it composes: the
    ``HydraComposed`` callback (conf/config.yaml) ends that as soon as the config exists, before any job runs or is
    submitted, so failures after it are reported Hydra's way and no job inherits the setting. A composition error
    raised meanwhile is explained by ``composition_error``. A user's own ``HYDRA_FULL_ERROR=1`` is left as it is:
    they asked for Hydra's traceback."""
    if os.environ.get(HYDRA_RAISES) == "1":
        hydra_main()
        return
    _hydra_raises.begin()
    try:
        hydra_main()
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as err:
        if not _hydra_raises.active:
            raise
        overrides = plain_overrides(argv[1:])
        problem = composition_error(overrides) if overrides is not None else None
        print(f"distrain: invalid config: {problem or ' '.join(str(err).split())}", file=sys.stderr)
        sys.exit(2)
    finally:
        _hydra_raises.end()


class _HydraRaises:
    """``HYDRA_FULL_ERROR=1`` while Hydra composes, then whatever the user had."""

    def __init__(self) -> None:
        self.active, self.previous = False, None

    def begin(self) -> None:
        self.active, self.previous = True, os.environ.get(HYDRA_RAISES)
        os.environ[HYDRA_RAISES] = "1"

    def end(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.previous is None:
            os.environ.pop(HYDRA_RAISES, None)
        else:
            os.environ[HYDRA_RAISES] = self.previous


_hydra_raises = _HydraRaises()


class HydraComposed(Callback):
    """Hydra has composed the config (a run's or a sweep's): from here on it reports errors its own way."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _hydra_raises.end()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _hydra_raises.end()


def run_directory_problem(argv: list[str]) -> str | None:
    """Hydra creates the run (or sweep) directory before distrain's code runs, with a traceback when it cannot: a
    directory given on the command line is inspected first (the default, ``outputs/`` here, like any other)."""
    for arg in argv:
        key, equals, value = arg.lstrip("+").partition("=")
        if equals and key in ("hydra.run.dir", "hydra.sweep.dir") and value and "${" not in value:
            try:
                check_writable(value, directory=True)
            except ArtifactError as err:
                return f"{key}={value} is not allowed: a writable directory ({err})"
    return None


def run(cfg: DictConfig) -> float | None:
    """Validate, then run ``build_and_train`` on every rank; returns the final validation loss (for sweepers).

    With ``dry_run=true``: validate for ``target`` and print each rank's predicted memory there, in this process;
    exit 0 when every rank fits its device, 1 when one does not, 2 for an invalid config.
    """
    _hydra_raises.end()  # also when Hydra runs without conf/config.yaml's callbacks
    hydra_cfg = HydraConfig.get()
    added = added_key_error(cfg, list(hydra_cfg.overrides.task))
    if added:
        end(f"invalid config: {added}", 2)
    if cfg.dry_run:
        return plan_only(cfg, hydra_cfg.runtime.output_dir)
    if not has_replica_groups(cfg):  # a multi-task SLURM job: this task is one rank (with groups: one node's ranks)
        adopt_slurm_tasks()
    try:
        plan = validate(cfg)
    except ConfigError as err:
        refuse(err)
    if not inside_launcher() and (shadowed := shadowing_package()):  # this launcher forks its ranks
        end(shadowed, 2)
    run_dir = hydra_cfg.runtime.output_dir
    if launcher_rank() == 0:  # other ranks' run directory is "." (prepare_command_line): not theirs to inspect
        try:
            inspect_run_directory(run_dir)
        except ArtifactError as err:
            key = "hydra.sweep.dir" if hydra_cfg.mode == RunMode.MULTIRUN else "hydra.run.dir"
            refuse(ConfigError(key, run_dir, f"a directory whose run files are distrain's: {err}"))
    make_paths_absolute(cfg)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    cfg_dict["distributed"]["device"] = plan.device_type
    checkpoint_dir = cfg.checkpoint.dir or str(Path(run_dir) / "checkpoints")
    if has_replica_groups(cfg):  # whichever group saves (groups other than 0 log into their own subdirectory)
        cfg_dict["checkpoint"]["dir"] = str(Path(checkpoint_dir).resolve())
    run_name = f"{hydra_cfg.job.name}/{Path(run_dir).relative_to(Path(run_dir).parents[1])}"
    with ExitStack() as held:
        try:  # one job per checkpoint directory, and a checkpoint that fits this config, before any rank starts
            finished = prepare_checkpoint_dir(
                cfg,
                directory=Path(checkpoint_dir),
                resume=resume_setting(cfg.checkpoint.resume),
                run_dir=run_dir,
                take_lock=launcher_rank() == 0,
                held=held,
                world_size=plan.world_size,
            )
        except ConfigError as err:
            refuse(err)
        except RunError as err:
            end(str(err), 2)
        if finished:  # e.g. a requeued job that had in fact finished: say so, change nothing
            print(
                f"distrain: the run is complete at step {checkpoint_step(finished)} (trainer.max_steps="
                f"{cfg.trainer.max_steps}, checkpoint {finished}); nothing to train",
                file=sys.stderr,
            )
            return None
        resume = resume_override(cfg, hydra_cfg, run_dir, checkpoint_dir)
        return launch(cfg, plan, (cfg_dict, run_dir, run_name, run_group(hydra_cfg)), resume)


def resume_override(cfg: DictConfig, hydra_cfg: DictConfig, run_dir: str, checkpoint_dir: str) -> str:
    """What continues this run after a graceful stop (besides ``checkpoint.resume=auto``): its run directory, so one
    summary.json and metrics.jsonl cover the whole run; plus ``checkpoint.dir`` when the user put the checkpoints
    elsewhere. In a multirun (submitit's SLURM jobs too) ``hydra.run.dir`` does not apply: the checkpoint directory."""
    checkpoints = f"checkpoint.dir={Path(checkpoint_dir).resolve()}"
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return checkpoints
    same_run = f"hydra.run.dir={Path(run_dir).resolve()}"
    return f"{checkpoints} {same_run}" if cfg.checkpoint.dir else same_run


def plan_only(cfg: DictConfig, output_dir: str) -> None:
    """``dry_run=true``: print and save the memory plan; exit 1 when a rank does not fit, 2 for a bad config."""
    from distrain.planning import dry_run  # the planner's imports (DTensor, pipelining) only when planning

    try:
        report = dry_run.plan(cfg)
    except ConfigError as err:
        refuse(err)
    print(report.describe())
    dry_run.write_report(report, output_dir)
    if not report.fits:  # a non-zero exit keeps `train.py dry_run=true ... && sbatch ...` from submitting
        end(f"dry run: {report.shortfall()}", 1)


def launch(cfg: DictConfig, plan: LaunchPlan, rank_args: tuple[Any, ...], resume: str) -> float | None:
    """Start the ranks and report how they ended; returns the final validation loss."""
    # Imported only now: a refused config never pays for what the ranks run (the fork server imports it itself).
    from distrain.trainer.rank import build_and_train

    for stale in Path(rank_args[1]).glob(RUN_ERROR_FILE.format(rank="*")):
        stale.unlink()
    try:
        if has_replica_groups(cfg):  # replica groups: each its own process set, restarted on its own
            from distrain.ft.launch import run_replica_groups

            results = run_replica_groups(
                build_and_train,
                rank_args,
                cfg.ft,
                nproc_per_node=plan.nproc_per_node,
                start_method=plan.start_method,
            )
        else:
            results = run_ranks(
                build_and_train,
                rank_args,
                nproc_per_node=plan.nproc_per_node,
                max_restarts=cfg.distributed.max_restarts,
                start_method=plan.start_method,
            )
    except RunError as err:  # raised by the one rank this process ran itself
        fail(str(err))
    except ChildFailedError as err:
        fail(failure_line(err, rank_args[1]) or f"training failed\n{err.format_msg()}")
    except SignalException as err:  # the launcher forwarded the signal; ranks checkpointed at a step boundary
        stopped(err.sigval.name, resume, cfg.distributed.max_requeues)
    summary = results.get(0) or next(iter(results.values()), None)  # a SLURM task holds only its own rank
    if summary and summary["stopped_by"]:
        stopped(summary["stopped_by"], resume, cfg.distributed.max_requeues)
    return summary["final_val_loss"] if summary else None


class SubmittedJobError(CompactHydraException):
    """How a job submitted through submitit ends on a refusal or failure: raised, not an exit. submitit then hands
    it to the submitting process, where Hydra prints it as one line (a compact exception) and exits 1. An exit
    writes no result: the submitter would wait for one, forever where SLURM keeps no accounting for it to ask."""


def end(line: str, status: int) -> NoReturn:
    """``distrain: <line>`` on stderr and exit ``status``; in a submitit job, raise ``SubmittedJobError(line)``."""
    if SUBMITIT_JOB in os.environ:
        raise SubmittedJobError(f"distrain: {line}")
    print(f"distrain: {line}", file=sys.stderr)
    sys.exit(status)


def refuse(err: ConfigError) -> NoReturn:
    """A config mistake: one line naming the key, the value and what is allowed; exit 2 before any rank starts."""
    end(f"invalid config: {err}", 2)


def fail(message: str) -> NoReturn:
    """The job failed: ``distrain: <message>`` on stderr, exit 1."""
    end(message, 1)


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


def stopped(signal_name: str, resume: str, max_requeues: int) -> NoReturn:
    """After a graceful stop: in a SLURM job, rank 0 requeues it (up to ``max_requeues`` times); exit 143. The
    first process of the job (the only one under train.py's own launcher) says how to continue (``resume``)."""
    requeued = False
    if in_slurm_job() and launcher_rank() == 0:
        if slurm_restart_count() < max_requeues:
            print(f"distrain: requeueing SLURM job {os.environ['SLURM_JOB_ID']}", file=sys.stderr)
            requeue_slurm_job()
            requeued = True
        else:
            print(f"distrain: not requeued: distributed.max_requeues={max_requeues} reached", file=sys.stderr)
    line = (
        f"stopped by {signal_name} after checkpointing; continue with checkpoint.resume=auto {resume} "
        f"(exit status {REQUEUE_EXIT_CODE}: requeue)"
    )
    if not requeued and SUBMITIT_JOB in os.environ:  # every task: the submitter waits for each one's result
        raise SubmittedJobError(f"distrain: {line}")
    if launcher_rank() == 0:  # under torchrun or SLURM tasks every process gets here: one says it
        print(f"distrain: {line}", file=sys.stderr)
    sys.exit(REQUEUE_EXIT_CODE)  # a requeued job starts again, and its submitter waits for that attempt's result
