"""Memory planning: per-rank model-state bytes predicted for each strategy (``distrain.planning.memory``), set
against what runs measured, and which strategies fit a memory budget."""

from __future__ import annotations

import pandas as pd

from distrain.planning.memory import predicted_model_state_bytes

# (strategy as in summary.json, stage) rows of a plan; torch-native strategies train fp32 parameters directly.
STRATEGIES = {
    "ddp": ("ddp", None),
    "zero1": ("zero", 1),
    "zero2": ("zero", 2),
    "zero3": ("zero", 3),
    "fsdp": ("fsdp", 3),
}


def plan(
    model_parameters: dict[str, int], world_size: int, optimizer_bytes: int = 8, low_precision: bool = False
) -> pd.DataFrame:
    """Predicted model state per rank for every model (name -> parameter count) and strategy at ``world_size``
    ranks. ``optimizer_bytes``: optimizer state per parameter (AdamW 8, SGD with momentum 4); ``low_precision``:
    DeepSpeed's 2-byte parameters and gradients (bf16/fp16)."""
    rows = []
    for model, parameters in model_parameters.items():
        for name, (strategy, stage) in STRATEGIES.items():
            predicted = predicted_model_state_bytes(
                strategy=strategy,
                stage=stage,
                num_params=parameters,
                world_size=world_size,
                optimizer_bytes=optimizer_bytes,
                low_precision=low_precision and strategy == "zero",
                master_copy=strategy == "zero",
            )
            row = {"model": model, "parameters": parameters, "strategy": name, "world_size": world_size}
            rows.append(row | {"bytes_per_rank": predicted})
    return pd.DataFrame(rows)


def fitting(plan_table: pd.DataFrame, budget_bytes: float) -> pd.DataFrame:
    """Model x strategy table of whether the predicted model state fits ``budget_bytes`` per rank (activations and
    buffers come on top: leave them headroom)."""
    fits = plan_table.assign(fits=plan_table["bytes_per_rank"] <= budget_bytes)
    return fits.pivot(index="model", columns="strategy", values="fits").loc[plan_table["model"].unique()]


def predicted_vs_measured(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run (``distrain.analysis.runs.load_runs``): the summary's predicted and measured model state per rank
    and their ratio."""
    table = runs[["run", "parallelism", "world_size", "model_parameters"]].copy()
    table["predicted_bytes"] = runs["predicted_model_state_bytes"]
    table["measured_bytes"] = runs["model_state_bytes"]
    table["measured_over_predicted"] = table["measured_bytes"] / table["predicted_bytes"]
    return table
