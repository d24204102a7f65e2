"""Daily-use presets: ``experiment=<recipe>`` (conf/experiment/) and ``debug=<mode>`` (conf/debug/).

Every file in either directory is tested by being there: it composes alone and with every other preset, says what
it is and how to run it; a recipe sized for GPUs passes its dry run (memory planned for its ``target``, no GPU
needed), a CPU recipe trains for real under ``debug=fast``. Each debug mode runs and does what it is for: ``fast``
finishes in 5 steps, ``overfit`` drives the training loss to near zero, ``profile`` writes a trace per rank,
``nan`` turns on autograd's anomaly mode (a NaN names the backward op and the forward line that made it).
"""

import json

import numpy as np
import pytest
from helpers import CONF_DIR, REPO, compose_config, nanogpt_char_dataset, run_train, write_token_dataset
from omegaconf import OmegaConf

from distrain.config.overrides import composition_error, quote_group_options
from distrain.config.validate import validate

EXPERIMENTS = sorted(path.stem for path in (CONF_DIR / "experiment").glob("*.yaml"))
DEBUG_MODES = sorted(path.stem for path in (CONF_DIR / "debug").glob("*.yaml"))
# Read from each file, not composed: a broken recipe fails its own tests, not the collection of this module.
GPU_EXPERIMENTS = [
    name
    for name in EXPERIMENTS
    if OmegaConf.select(OmegaConf.load(CONF_DIR / "experiment" / f"{name}.yaml"), "target.device") == "cuda"
]
CPU_EXPERIMENTS = [name for name in EXPERIMENTS if name not in GPU_EXPERIMENTS]


def finished_run(args, run_dir, timeout=240):
    """``train.py <args>`` into ``run_dir``; asserts exit 0 and returns (summary.json, metrics.jsonl records)."""
    done = run_train([*args, f"hydra.run.dir={run_dir}"], cwd=REPO, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), [r for r in records if "loss" in r]


def test_the_presets_are_there():
    assert len(EXPERIMENTS) >= 4 and GPU_EXPERIMENTS and CPU_EXPERIMENTS, EXPERIMENTS
    assert {"fast", "overfit", "profile", "nan"} <= set(DEBUG_MODES), DEBUG_MODES


PRESETS = [*(("experiment", name) for name in EXPERIMENTS), *(("debug", name) for name in DEBUG_MODES)]


@pytest.mark.parametrize("group, name", PRESETS)
def test_every_preset_composes_with_every_other_and_says_how_to_run_it(group, name):
    text = (CONF_DIR / group / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n"), "a preset sets keys of every group: package _global_"
    assert "python train.py" in text and f"{group}={name}" in text, "its header shows the command that runs it"
    if group == "experiment":
        assert "Sized for:" in text, "a recipe's header names the machines it is sized for"
    cfg = compose_config([f"{group}={name}"])
    assert cfg.model is not None and cfg.trainer.max_steps >= 1
    others = DEBUG_MODES if group == "experiment" else EXPERIMENTS
    for other in others:  # experiment=X debug=Y: the debug mode wins where both set a key
        combined = compose_config([f"{group}={name}", f"{'debug' if group == 'experiment' else 'experiment'}={other}"])
        debug = compose_config([f"debug={name if group == 'debug' else other}"])
        assert combined.trainer.max_steps == debug.trainer.max_steps


@pytest.mark.parametrize("mode", DEBUG_MODES)
def test_every_debug_mode_validates_on_the_default_model(mode):
    cfg = compose_config([f"debug={mode}"])
    plan = validate(cfg)
    assert plan.world_size == 2 and cfg.trainer.max_steps <= 100


def test_the_debug_modes_set_what_they_are_for():
    fast = compose_config(["debug=fast"])
    assert fast.trainer.max_steps <= 10 and fast.trainer.log_every == 1 and fast.checkpoint.every_n_steps == 0
    assert compose_config(["debug=overfit"]).trainer.overfit_batches == 1
    profile = compose_config(["debug=profile"])
    assert profile.profile and profile.trainer.max_steps >= profile.monitor.profile_start_step
    anomaly = compose_config(["debug=nan"])  # quoted as train.py quotes it: Hydra reads a bare nan as a float
    assert anomaly.trainer.detect_anomaly and anomaly.trainer.on_nonfinite == "stop"


def test_a_misspelt_preset_is_refused_in_one_line_naming_the_presets():
    problem = composition_error(["debug=fsat"])
    assert problem == f"debug='fsat' is not allowed: one of {', '.join(DEBUG_MODES)}", problem
    problem = composition_error(quote_group_options(["debug=1.5"]))  # a number is a name too, not a traceback
    assert problem == f"debug='1.5' is not allowed: one of {', '.join(DEBUG_MODES)}", problem
    problem = composition_error(["experiment=llama3"])
    assert problem == f"experiment='llama3' is not allowed: one of {', '.join(EXPERIMENTS)}", problem


@pytest.mark.parametrize("name", GPU_EXPERIMENTS)
def test_a_gpu_recipe_fits_its_target_in_a_dry_run(name, tmp_path):
    cfg = compose_config([f"experiment={name}"])
    args = [f"experiment={name}", "dry_run=true"]
    if "path" in cfg.data.keys():  # data=tokens: a dataset just big enough for one global batch of the target
        world = cfg.target.nodes * (cfg.target.ranks_per_node or cfg.distributed.nproc_per_node or 8)
        sequences = cfg.data.global_batch_size or cfg.data.micro_batch_size * cfg.trainer.grad_accum_steps * world
        ids = np.random.default_rng(0).integers(0, 256, sequences * cfg.data.seq_len + 1)
        data = write_token_dataset(tmp_path / "data", {"train": [ids], "val": [ids[: cfg.data.seq_len + 1]]})
        args.append(f"data.path={data}")
    done = run_train([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "dry_run.json").read_text())
    assert report["fits"] and report["target"]["device"] == "cuda", report
    print(name, max(row["total"] for row in report["ranks"]) / 2**30, "GiB per rank predicted")


@pytest.mark.parametrize("name", CPU_EXPERIMENTS)
def test_a_cpu_recipe_trains_for_real_under_debug_fast(name, tmp_path):
    cfg = compose_config([f"experiment={name}"])
    extra = ["comm.start_iter=2"] if cfg.comm.name == "powersgd" else []  # compress within debug=fast's 5 steps
    if "path" in cfg.data.keys():  # data=tokens: nanoGPT's character-level output, as the recipe reads it
        extra.append(f"data.path={nanogpt_char_dataset(tmp_path / 'data', (REPO / 'README.md').read_text())}")
    summary, records = finished_run([f"experiment={name}", "debug=fast", *extra], tmp_path)
    assert summary["steps"] == 5 and len(records) == 5 and summary["parallelism"] == cfg.parallelism.name
    if cfg.comm.name == "powersgd":
        assert records[0]["grad_compression_ratio"] == 1.0 and records[-1]["grad_compression_ratio"] > 2, records
    assert not (tmp_path / "checkpoints").exists()


def test_debug_fast_runs_five_steps_without_checkpoints(tmp_path):
    summary, records = finished_run(["debug=fast"], tmp_path)
    assert summary["steps"] == 5 and [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert summary["global_batch_size"] == 4 and summary["final_val_loss"] is not None
    assert not (tmp_path / "checkpoints").exists()


def test_debug_overfit_drives_the_training_loss_to_near_zero(tmp_path):
    # Measured: 4.977 (mean of steps 1-5) -> 0.0036 at step 80 (gpt_tiny, ddp, 2 CPU ranks, ~4 s of training).
    summary, records = finished_run(["debug=overfit"], tmp_path)
    first, last = summary["first_logged_loss"], summary["final_train_loss"]
    assert summary["steps"] == 80 and summary["global_batch_size"] == 4
    assert first > 4 and last < 0.05 and last < 0.01 * first, [r["loss"] for r in records]


def test_debug_profile_writes_a_trace_per_rank(tmp_path):
    finished_run(["debug=profile"], tmp_path)
    traces = sorted((tmp_path / "profile").glob("trace_rank*.json"))
    assert [t.name for t in traces] == ["trace_rank0.json", "trace_rank1.json"]
    trace = json.loads(traces[0].read_text())
    steps = {event["name"] for event in trace["traceEvents"] if event.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == compose_config(["debug=profile"]).monitor.profile_steps, steps


def test_debug_nan_names_the_op_and_the_forward_line_that_made_a_nan(tmp_path):
    # lr=1e30 blows the weights up after step 1, so step 2's forward overflows and its backward makes a NaN.
    args = ["debug=nan", "optimizer.lr=1e30", "trainer.max_steps=3", "checkpoint=none"]
    done = run_train([*args, f"hydra.run.dir={tmp_path}"], cwd=REPO, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    # Only anomaly mode checks each backward op's output for NaNs and records the forward call's traceback.
    assert "returned nan values" in done.stderr, done.stderr[-3000:]
    assert "Traceback of forward call that caused the error" in output, output[-3000:]
    assert "step 2 failed" in output, output[-3000:]


def test_group_options_hydra_would_read_as_numbers_are_quoted_in_every_override_form():
    quoted = quote_group_options(
        ["debug=nan", "debug=nan,fast", "+debug=nan", "logger=[wandb,1]", "model@x=1.5", "trainer.seed=1", "debug=fast"]
    )
    assert quoted == [
        "debug='nan'", "debug='nan',fast", "+debug='nan'", "logger=[wandb,'1']", "model@x='1.5'", "trainer.seed=1",
        "debug=fast",
    ]  # fmt: skip
    assert compose_config(["debug=nan"]).trainer.detect_anomaly
    problem = composition_error(quote_group_options(["logger=[wandb,1]"]))
    assert problem == "logger='1' is not allowed: one of jsonl, mlflow, none, tensorboard, wandb", problem
