"""Comparison plots over the DataFrames of ``distrain.analysis.runs`` and ``distrain.analysis.memory`` (matplotlib;
each returns its Figure; without a display matplotlib draws off-screen)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure


def loss_curves(metrics: pd.DataFrame, value: str = "loss") -> Figure:
    """``value`` (train loss by default; ``val_loss`` works too) against step, one line per run."""
    figure, axes = plt.subplots(figsize=(7, 4))
    for run, records in metrics.dropna(subset=[value]).groupby("run", sort=False):
        axes.plot(records["step"], records[value], label=run, marker="." if value == "val_loss" else None)
    axes.set(xlabel="step", ylabel=value, title=f"{value} by run")
    axes.legend(fontsize="small")
    figure.tight_layout()
    return figure


def bars(runs: pd.DataFrame, value: str, ylabel: str, scale: float = 1.0) -> Figure:
    """One bar per run: ``runs[value] / scale``."""
    figure, axes = plt.subplots(figsize=(7, 4))
    shown = runs.dropna(subset=[value])
    axes.bar(range(len(shown)), shown[value] / scale)
    axes.set_xticks(range(len(shown)), shown["run"], rotation=30, ha="right", fontsize="small")
    axes.set(ylabel=ylabel, title=ylabel)
    figure.tight_layout()
    return figure


def throughput(runs: pd.DataFrame) -> Figure:
    """Mean global tokens per second of each run."""
    return bars(runs, "mean_tokens_per_s", "tokens / s")


def memory_per_rank(runs: pd.DataFrame) -> Figure:
    """Model state (parameters + gradients + optimizer state) per rank and peak memory of the largest rank, MiB."""
    figure, axes = plt.subplots(figsize=(7, 4))
    positions = range(len(runs))
    axes.bar([p - 0.2 for p in positions], runs["model_state_bytes"] / 2**20, width=0.4, label="model state / rank")
    axes.bar([p + 0.2 for p in positions], runs["peak_memory_bytes"] / 2**20, width=0.4, label="peak / rank")
    axes.set_xticks(list(positions), runs["run"], rotation=30, ha="right", fontsize="small")
    axes.set(ylabel="MiB", title="memory per rank")
    axes.set_yscale("log")
    axes.legend(fontsize="small")
    figure.tight_layout()
    return figure


def communication_bytes(runs: pd.DataFrame) -> Figure:
    """Gradient bytes each rank sends per step (runs with a DDP communication hook)."""
    return bars(runs, "mean_grad_bytes_sent", "gradient MiB sent / rank / step", scale=2**20)


def predicted_vs_measured(comparison: pd.DataFrame) -> Figure:
    """Measured against predicted model state per rank (MiB), one point per run, with the line y = x."""
    figure, axes = plt.subplots(figsize=(5, 5))
    for strategy, rows in comparison.groupby("parallelism"):
        axes.scatter(rows["predicted_bytes"] / 2**20, rows["measured_bytes"] / 2**20, label=strategy)
    top = max(comparison["predicted_bytes"].max(), comparison["measured_bytes"].max()) / 2**20 * 1.1
    axes.plot([0, top], [0, top], color="grey", linewidth=0.8)
    axes.set(xlabel="predicted MiB / rank", ylabel="measured MiB / rank", title="model state per rank")
    axes.legend(fontsize="small")
    figure.tight_layout()
    return figure


def memory_plan(plan: pd.DataFrame, budget_bytes: float) -> Figure:
    """Predicted model state per rank by model and strategy (GiB, log scale), with the budget as a line."""
    figure, axes = plt.subplots(figsize=(8, 4))
    table = plan.pivot_table(index="model", columns="strategy", values="bytes_per_rank", sort=False) / 2**30
    table.plot.bar(ax=axes, logy=True, rot=0)
    axes.axhline(budget_bytes / 2**30, color="red", linestyle="--", label="budget")
    axes.set(ylabel="GiB / rank", title=f"model state per rank at {plan['world_size'].iloc[0]} ranks")
    axes.legend(fontsize="small")
    figure.tight_layout()
    return figure
