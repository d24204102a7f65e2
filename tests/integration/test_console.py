"""What a default run prints: one short line of the main numbers per logged step, a small summary table naming the
run directory, no line over 200 characters (the full summary stays in summary.json)."""

from __future__ import annotations

import json

import pytest
from helpers import run_train

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

MAX_LINE = 200


def test_a_default_run_prints_short_lines_and_a_summary_table(tmp_path):
    env = {"WANDB_MODE": None, "WANDB_API_KEY": None, "HOME": str(tmp_path)}  # the default logger, offline
    result = run_train(["trainer.max_steps=20", "hydra.run.dir=run"], tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    longest = max(lines, key=len)
    assert len(longest) <= MAX_LINE, longest

    step_lines = [line for line in lines if " | loss " in line]
    assert [line.split("step ")[1].split(" |")[0] for line in step_lines] == ["10/20", "20/20"]
    for field in ("lr ", "grad ", " tok/s", "mfu ", "mem ", "eta "):
        assert all(field in line for line in step_lines), field
    assert "val " in step_lines[-1]

    run_dir = (tmp_path / "run").resolve()
    summary = json.loads((run_dir / "summary.json").read_text())
    table = lines[lines.index(next(line for line in lines if "run summary" in line)) :]
    rows = {row.split("  ")[1].strip(): row.split("  ", 2)[2].strip() for row in table[1:] if row.startswith("  ")}
    assert rows["run directory"] == str(run_dir)
    assert rows["val loss"] == f"{summary['final_val_loss']:.4g}"
    assert rows["steps"] == "20"
    assert "metrics" in summary and "model_state_bytes" in summary  # everything else is in the file
