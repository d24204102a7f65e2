"""The analysis library and the notebooks against a real small sweep: 4 runs of train.py (ddp and fsdp, two model
widths) with W&B offline runs. The notebooks are executed (nbclient) and must produce their plots."""

import os

import nbformat
import pytest
from helpers import FAST, REPO, run_train
from nbclient import NotebookClient

from distrain.analysis import memory, plots
from distrain.analysis.runs import load_runs, load_wandb_runs

STEPS = 4


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis")
    args = ["-m", *FAST, f"trainer.max_steps={STEPS}", "trainer.eval_every=2", "logger=wandb"]
    args += ["parallelism=ddp,fsdp", "model.d_model=32,64", "hydra.sweep.dir=sweep"]
    result = run_train(args, root, env={"WANDB_MODE": "offline"}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "sweep"


def test_runs_load_with_their_swept_overrides_as_labels(sweep):
    runs, metrics = load_runs(sweep)
    assert sorted(runs["run"]) == sorted(
        f"model.d_model={d} parallelism={p}" for p in ("ddp", "fsdp") for d in (32, 64)
    )
    assert set(runs["parallelism"]) == {"ddp", "fsdp"} and set(runs["world_size"]) == {2}
    for _, run in runs.iterrows():
        logged = metrics[metrics["run"] == run["run"]]
        assert list(logged.dropna(subset=["loss"])["step"]) == list(range(1, STEPS + 1))
        assert logged.dropna(subset=["val_loss"])["val_loss"].iloc[-1] == pytest.approx(run["final_val_loss"])
        assert run["model_state_bytes"] > 0 and run["mean_tokens_per_s"] > 0
    wider = runs.set_index("run")["model_parameters"]
    assert wider["model.d_model=64 parallelism=ddp"] > wider["model.d_model=32 parallelism=ddp"]


def test_wandb_offline_runs_load_the_same_losses(sweep):
    runs, _ = load_runs(sweep)
    wandb_runs, wandb_metrics = load_wandb_runs(sweep)
    assert len(wandb_runs) == 4
    logged = sorted(round(x, 6) for x in wandb_metrics.dropna(subset=["loss"])["loss"])
    local = sorted(round(x, 6) for x in load_runs(sweep)[1].dropna(subset=["loss"])["loss"])
    assert logged == local


def test_plots_draw_one_series_per_run(sweep):
    runs, metrics = load_runs(sweep)
    assert len(plots.loss_curves(metrics).axes[0].get_lines()) == 4
    assert len(plots.throughput(runs).axes[0].patches) == 4
    assert len(plots.communication_bytes(runs).axes[0].patches) == 2  # only ddp has a communication hook


def test_memory_prediction_against_measurement_and_budget(sweep):
    runs, _ = load_runs(sweep)
    comparison = memory.predicted_vs_measured(runs)
    # DDP's formula is exact for fp32 AdamW (4 + 4 + 8 bytes per parameter); FSDP's within its padding.
    ddp = comparison[comparison["parallelism"] == "ddp"]["measured_over_predicted"]
    fsdp = comparison[comparison["parallelism"] == "fsdp"]["measured_over_predicted"]
    assert ddp.tolist() == pytest.approx([1.0, 1.0], rel=1e-3)
    assert fsdp.between(0.9, 1.2).all()
    fits = memory.fitting(memory.plan({"7B": 7_000_000_000}, world_size=8), budget_bytes=80 * 2**30)
    assert not fits.loc["7B", "ddp"] and fits.loc["7B", "zero3"] and fits.loc["7B", "fsdp"]  # 112 GB vs 14 GB


@pytest.mark.parametrize("notebook,plots_drawn", [("run_comparison.ipynb", 6), ("memory_planning.ipynb", 2)])
def test_notebook_runs_against_the_sweep(sweep, notebook, plots_drawn, monkeypatch):
    stored = nbformat.read(REPO / "notebooks" / notebook, as_version=4)
    assert all(not cell.get("outputs") for cell in stored.cells if cell.cell_type == "code")  # kept without outputs
    monkeypatch.setenv("DISTRAIN_RUNS", str(sweep))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    NotebookClient(stored, timeout=300, kernel_name="python3", resources={"metadata": {"path": os.getcwd()}}).execute()
    images = [o for cell in stored.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == plots_drawn
