"""Check a model under every layout: ``python -m distrain.tools.check_model model=llama_tiny [override ...]``.

Trains the configured model for a few steps (fp32, the same global batch and seed) in one process and then under
each parallel layout, each run a real ``train.py`` with its own ranks, and prints one row per layout: the loss
after the last step, the largest difference from the one-process losses over all steps, and pass (within
``--tolerance``), fail, unsupported (the layout refuses the model before any rank starts, with the reason) or
error (the run failed; its last line). Exit status: 0 when no layout failed or erred, 1 otherwise, 2 for a config
mistake in the overrides.

Every other argument is a Hydra override of ``train.py``'s config, e.g. ``model=moe_tiny model.n_layers=2``, or a
user's own model with its config file in ``conf/model/`` (``model=my_mlp``). The layouts' own keys (parallelism,
stage, precision, batch, steps, checkpoint, logger, run directory) belong to the check and cannot be overridden.
A data-parallel layout splits the same global batch over its ranks, so a layout is exact when its losses equal the
one-process ones to floating-point rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from distrain.config.checks import ConfigError
from distrain.config.overrides import composition_error
from distrain.config.schema import register_configs
from distrain.errors import first_line

REPO = Path(__file__).resolve().parents[2]
# Keys the check sets for every layout; a user override of one would be silently replaced.
OWNED = (
    "parallelism", "stage", "precision", "distributed.nproc_per_node", "data.micro_batch_size",
    "data.global_batch_size", "trainer.grad_accum_steps", "trainer.max_steps", "checkpoint", "logger", "hydra",
)  # fmt: skip
SEQUENCES = 4  # sequences per micro-step, over all data-parallel ranks
ACCUMULATION = 2  # micro-steps per optimizer step


@dataclass(frozen=True)
class CheckedLayout:
    """One row of the check: a parallelism option with its settings, its ranks and its data-parallel degree."""

    name: str
    overrides: tuple[str, ...]
    ranks: int
    data_parallel: int


LAYOUTS = [
    CheckedLayout("single", ("parallelism=single",), 1, 1),
    CheckedLayout("ddp", ("parallelism=ddp",), 2, 2),
    CheckedLayout("fsdp", ("parallelism=fsdp",), 2, 2),
    CheckedLayout("zero1", ("parallelism=zero", "stage=1"), 2, 2),
    CheckedLayout("zero2", ("parallelism=zero", "stage=2"), 2, 2),
    CheckedLayout("zero3", ("parallelism=zero", "stage=3"), 2, 2),
    CheckedLayout("tensor", ("parallelism=tensor",), 2, 1),
    CheckedLayout(
        "tensor_sp_lp",
        ("parallelism=tensor", "parallelism.sequence_parallel=true", "parallelism.loss_parallel=true"),
        2,
        1,
    ),
    CheckedLayout("pipeline", ("parallelism=pipeline", "parallelism.pipeline_microbatches=4"), 2, 1),
    CheckedLayout("hsdp_2x2", ("parallelism=hsdp", "parallelism.dp_replicate=2", "parallelism.dp=2"), 4, 4),
    CheckedLayout("hybrid_dp2_tp2", ("parallelism=hybrid", "parallelism.tp=2"), 4, 2),
    CheckedLayout("cp2", ("parallelism=hybrid", "parallelism.cp=2"), 2, 1),
    CheckedLayout("ep2", ("parallelism=hybrid", "parallelism.ep=2"), 2, 2),
    CheckedLayout(
        "hybrid_tp2_pp2",
        ("parallelism=hybrid", "parallelism.tp=2", "parallelism.pp=2", "parallelism.pipeline_microbatches=4"),
        4,
        1,
    ),
]


@dataclass(frozen=True)
class Row:
    layout: CheckedLayout
    result: str  # reference | pass | fail | unsupported | error
    losses: tuple[float, ...] = ()
    max_difference: float | None = None
    note: str = ""


def owned_key(override: str) -> bool:
    """Whether ``override`` sets a key the check sets itself (``OWNED``, or a key inside one of those groups)."""
    key = override.lstrip("+~").split("=")[0]
    return any(key == owned or key.startswith(f"{owned}.") for owned in OWNED)


def layout_overrides(layout: CheckedLayout, steps: int, user: list[str]) -> list[str]:
    """``train.py`` overrides of one layout's run: the user's, then the check's fixed settings (which win)."""
    return [
        *user,
        *layout.overrides,
        f"distributed.nproc_per_node={layout.ranks}",
        f"data.micro_batch_size={SEQUENCES // layout.data_parallel}",
        f"trainer.grad_accum_steps={ACCUMULATION}",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.eval_batches=1",
        "trainer.progress_bar=false",
        "precision=fp32",
        "checkpoint=none",
        "logger=none",
    ]


def refusal(overrides: list[str]) -> str | None:
    """Why validation refuses this run before any rank starts (None: it would start)."""
    from distrain.config.validate import validate
    from distrain.optim.checks import unapplied_clipping

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        validate(cfg)
        if note := unapplied_clipping(cfg):  # the one-process reference clips: the losses cannot agree
            return note
    except ConfigError as err:
        return str(err)
    except Exception as err:  # an override this layout's config cannot take (e.g. a pipeline key without a pipeline)
        return first_line(err)
    return None


def run_layout(layout: CheckedLayout, steps: int, user: list[str], workdir: Path, timeout_s: float) -> Row:
    """Validate, then train one layout with ``train.py``; its per-step losses from the run's metrics.jsonl."""
    overrides = layout_overrides(layout, steps, user)
    refused = refusal(overrides)
    if refused:
        return Row(layout, "unsupported", note=refused)
    if torch.cuda.is_available() and layout.ranks > torch.cuda.device_count():
        return Row(layout, "unsupported", note=f"needs {layout.ranks} GPUs, {torch.cuda.device_count()} visible")
    run_dir = workdir / layout.name
    command = [sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    # A session of its own: on a timeout the ranks the launcher started are killed with it.
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                               start_new_session=True)  # fmt: skip
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return Row(layout, "error", note=f"no result within {timeout_s:.0f} s (--timeout)")
    metrics = run_dir / "metrics.jsonl"
    if process.returncode != 0 or not metrics.exists():
        return Row(layout, "error", note=last_error_line(stderr) or f"exit status {process.returncode}")
    return Row(layout, "ran", losses=logged_losses(metrics))


def last_error_line(stderr: str) -> str | None:
    """The line of a failed run's stderr that says what failed: distrain's own one-line report, else the last line
    that is not Hydra's hint about full stack traces."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
    reports = [line for line in lines if line.startswith("distrain:")]
    return (reports or lines or [None])[-1]


def logged_losses(metrics: Path) -> tuple[float, ...]:
    """The per-step training losses of a run's metrics.jsonl (lines that are not whole records are skipped)."""
    losses = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("loss"), int | float):
            losses.append(float(record["loss"]))
    return tuple(losses)


def compared(row: Row, reference: Row, tolerance: float) -> Row:
    """``row`` judged against the one-process losses: pass when every step's loss is within ``tolerance``."""
    if row.result != "ran":
        return row
    if row.layout is reference.layout:
        return Row(row.layout, "reference", row.losses, 0.0)
    if len(row.losses) != len(reference.losses):
        return Row(
            row.layout, "fail", row.losses, None, f"{len(row.losses)} steps logged, expected {len(reference.losses)}"
        )
    worst = max(abs(a - b) for a, b in zip(row.losses, reference.losses, strict=True))
    return Row(row.layout, "pass" if worst <= tolerance else "fail", row.losses, worst)


def table(rows: list[Row], steps: int) -> str:
    lines = [f"{'layout':<16} {'ranks':>5} {f'loss@{steps}':>10} {'max |diff|':>11}  result"]
    for row in rows:
        loss = f"{row.losses[-1]:.5f}" if row.losses else "-"
        diff = "-" if row.max_difference is None else f"{row.max_difference:.2e}"
        note = f": {row.note}" if row.note else ""
        lines.append(f"{row.layout.name:<16} {row.layout.ranks:>5} {loss:>10} {diff:>11}  {row.result}{note}")
    return "\n".join(lines)


def argument_problem(args: argparse.Namespace, chosen: list[str], user: list[str]) -> str | None:
    """One line naming the first argument the check cannot take (None: all are fine)."""
    known = [layout.name for layout in LAYOUTS]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        return f"--layouts {','.join(unknown) or repr(args.layouts)} is not allowed: names among {', '.join(known)}"
    for flag, value, ok, allowed in (
        ("--steps", args.steps, args.steps >= 1, "an integer >= 1"),
        ("--tolerance", args.tolerance, args.tolerance >= 0, "a number >= 0"),
        ("--timeout", args.timeout, args.timeout > 0, "seconds > 0"),
    ):
        if not ok:
            return f"{flag} {value} is not allowed: {allowed}"
    owned = [override for override in user if owned_key(override)]
    if owned:
        return f"{owned[0]} is not allowed: the check sets {', '.join(OWNED)} itself"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distrain.tools.check_model", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per layout (default 6)")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest allowed |loss difference|")
    parser.add_argument("--layouts", default=",".join(layout.name for layout in LAYOUTS), help="comma-separated")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per layout")
    args, user = parser.parse_known_args(argv)
    chosen = [name.strip() for name in args.layouts.split(",") if name.strip()]
    problem = argument_problem(args, chosen, user)
    if problem:
        print(f"distrain: check_model: {problem}", file=sys.stderr)
        return 2
    problem = composition_error(user)
    if problem:
        print(f"distrain: invalid config: {problem}", file=sys.stderr)
        return 2
    known = {layout.name: layout for layout in LAYOUTS}
    layouts = [known["single"], *(known[name] for name in chosen if name != "single")]
    with tempfile.TemporaryDirectory(prefix="check_model_") as workdir:
        rows: list[Row] = []
        for layout in layouts:
            if sys.stderr.isatty():  # progress for a person watching; piped stderr keeps only the verdict lines
                print(f"checking {layout.name} ...", file=sys.stderr, flush=True)
            rows.append(run_layout(layout, args.steps, user, Path(workdir), args.timeout))
            if rows[0].result != "ran":  # nothing to compare with: stop before the other layouts
                return reference_failed(rows[0])
    rows = [compared(row, rows[0], args.tolerance) for row in rows]
    print(table(rows, args.steps))
    failed = [row.layout.name for row in rows if row.result in ("fail", "error")]
    if failed:
        print(f"distrain: check_model: {', '.join(failed)} did not match one process", file=sys.stderr)
    return 1 if failed else 0


def reference_failed(reference: Row) -> int:
    """The one-process run was refused (a config mistake: exit 2) or failed (exit 1); says why in one line."""
    if reference.result == "unsupported":
        print(f"distrain: invalid config: {reference.note}", file=sys.stderr)
        return 2
    print(f"distrain: check_model: the one-process run failed: {reference.note}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    # As under train.py (whose directory Python puts first on sys.path), a model module next to train.py imports.
    sys.path.insert(0, str(REPO))
    sys.exit(main())
