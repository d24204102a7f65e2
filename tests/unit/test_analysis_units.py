"""distrain.analysis without runs: labels from overrides, run discovery order, the memory plan's arithmetic."""

import json

import pytest

from distrain.analysis import memory
from distrain.analysis.runs import _labels, find_run_dirs


def test_labels_keep_only_the_overrides_that_differ():
    overrides = [["trainer.max_steps=4", "parallelism=ddp"], ["trainer.max_steps=4", "parallelism=fsdp"]]
    assert _labels(overrides) == ["parallelism=ddp", "parallelism=fsdp"]
    assert _labels([["a=1"], ["a=1"]]) == ["(defaults)", "(defaults)"]


def test_run_directories_are_found_in_job_order(tmp_path):
    for job in ("10", "2", "0"):
        (tmp_path / job).mkdir()
        (tmp_path / job / "summary.json").write_text(json.dumps({}))
        (tmp_path / job / "metrics.jsonl").write_text("")
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "metrics.jsonl").write_text("")  # no summary: still running or crashed
    assert [p.name for p in find_run_dirs(tmp_path)] == ["0", "2", "10"]


def test_memory_plan_follows_the_formulas():
    table = memory.plan({"1B": 1_000_000_000}, world_size=8).set_index("strategy")["bytes_per_rank"]
    assert table["ddp"] == 16 * 10**9  # 4 + 4 + 8 bytes per parameter, replicated
    assert table["fsdp"] == 16 * 10**9 / 8  # all sharded
    assert table["zero3"] == 20 * 10**9 / 8  # plus DeepSpeed's fp32 master copy
    # DeepSpeed's stage 1 keeps only its gradient partition, as stage 2 does (measured: memory_by_strategy.py)
    assert table["zero1"] == table["zero2"] == pytest.approx(4 * 10**9 + (4 + 12) * 10**9 / 8)
    fits = memory.fitting(memory.plan({"1B": 10**9}, world_size=8), budget_bytes=4 * 2**30)
    # 16 GB, 6 GB, 6 GB, 2.5 GB, 2 GB against 4.3 GB
    assert fits.loc["1B"].to_dict() == {"ddp": False, "zero1": False, "zero2": False, "zero3": True, "fsdp": True}
