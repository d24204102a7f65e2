"""Fault tolerance through train.py: SIGKILL and exact resume, elastic restarts, a kill while saving, emergency
checkpoints, asynchronous saves, resharding 2 <-> 4 ranks, and export of sharded checkpoints to one file."""

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import FAST, REPO, run_train
from hydra.utils import instantiate
from omegaconf import OmegaConf

from distrain.data.sampler import TokenWindows, validation_batches
from distrain.models.spec import next_token_loss

STEPS = 10
CHECKPOINTED = [*FAST, f"trainer.max_steps={STEPS}", "checkpoint=default", "checkpoint.keep_last=0"]
STRATEGIES = {"ddp": ["parallelism=ddp"], "fsdp": ["parallelism=fsdp"], "zero3": ["parallelism=zero", "stage=3"]}


def losses_by_step(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), "metrics.jsonl must hold one record per step"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def checkpoints(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per strategy, the losses of a run that nothing interrupts (computed once per module)."""
    cache = {}

    def losses(strategy):
        if strategy not in cache:
            root = tmp_path_factory.mktemp(f"reference_{strategy}")
            result = run_train([*CHECKPOINTED, *STRATEGIES[strategy], "hydra.run.dir=run"], root)
            assert result.returncode == 0, result.stderr
            cache[strategy] = losses_by_step(root / "run")
            assert sorted(cache[strategy]) == list(range(1, STEPS + 1))
        return cache[strategy]

    return losses


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])  # fsdp: test_rank_kill kills it at random moments
def test_sigkill_then_resume_continues_bit_for_bit(tmp_path, uninterrupted, strategy):
    """Rank 1 is SIGKILLed after step 7; resuming (resume=auto, same run directory) from the step-6 checkpoint
    logs exactly the uninterrupted run's loss at every step, and metrics.jsonl keeps one record per step."""
    args = [*CHECKPOINTED, *STRATEGIES[strategy], "checkpoint.every_n_steps=3", "hydra.run.dir=run"]
    killed = run_train(args, tmp_path, env={"DISTRAIN_INJECT_FAULT": "kill:1:7"})
    assert killed.returncode == 1, killed.stderr
    assert "SIGKILL" in killed.stderr or "Signal 9" in killed.stderr
    assert checkpoints(tmp_path / "run") == ["step_00000003", "step_00000006"]
    saved_config = OmegaConf.load(tmp_path / "run" / "checkpoints" / "step_00000006" / "config.yaml")
    assert saved_config.checkpoint.every_n_steps == 3 and saved_config.trainer.max_steps == STEPS
    resumed = run_train([*args, "checkpoint.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "step_00000006" in resumed.stderr
    assert losses_by_step(tmp_path / "run") == uninterrupted(strategy)
    if strategy == "zero3":
        config = json.loads((tmp_path / "run" / "deepspeed_config.json").read_text())
        assert config["zero_optimization"]["stage"] == 3
        assert config["train_batch_size"] == 8 and config["gradient_clipping"] == 1.0
        assert (tmp_path / "run" / "checkpoints" / "step_00000006" / "deepspeed").is_dir()  # DeepSpeed's own format


def test_max_restarts_recovers_from_sigkill(tmp_path, uninterrupted):
    """With distributed.max_restarts=1 the agent restarts both ranks after rank 1 is killed; they resume from the
    newest checkpoint and the job finishes with the uninterrupted run's losses."""
    args = [*CHECKPOINTED, "checkpoint.every_n_steps=3", "distributed.max_restarts=1", "hydra.run.dir=run"]
    result = run_train(args, tmp_path, env={"DISTRAIN_INJECT_FAULT": "kill:1:5"}, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "step_00000003" in result.stderr and "resumed from" in result.stderr
    assert losses_by_step(tmp_path / "run") == uninterrupted("ddp")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == STEPS


def test_kill_while_saving_leaves_the_previous_checkpoint_usable(tmp_path, uninterrupted):
    args = [*CHECKPOINTED, "checkpoint.every_n_steps=3", "hydra.run.dir=run"]
    killed = run_train(args, tmp_path, env={"DISTRAIN_INJECT_FAULT": "kill:1:6:save"})
    assert killed.returncode == 1, killed.stderr
    assert checkpoints(tmp_path / "run") == ["step_00000003", "step_00000006.tmp"]
    assert not (tmp_path / "run" / "checkpoints" / "step_00000006.tmp" / "manifest.json").exists()
    resumed = run_train([*args, "checkpoint.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "step_00000003" in resumed.stderr
    assert losses_by_step(tmp_path / "run") == uninterrupted("ddp")


def test_exception_in_one_rank_writes_an_agreed_emergency_checkpoint(tmp_path, uninterrupted):
    """Rank 1 raises after step 5 (periodic saves every 4): the ranks agree their state is consistent, save
    step 5, and the job fails naming rank 1. Resuming from that checkpoint continues exactly."""
    args = [*CHECKPOINTED, "checkpoint.every_n_steps=4", "hydra.run.dir=run"]
    failed = run_train(args, tmp_path, env={"DISTRAIN_INJECT_FAULT": "raise:1:5"})
    assert failed.returncode == 1
    assert "injected fault on rank 1 after step 5" in failed.stderr and "rank      : 1" in failed.stderr
    assert "emergency checkpoint after a failure on rank 1" in failed.stderr
    assert checkpoints(tmp_path / "run") == ["step_00000004", "step_00000005"]
    resumed = run_train([*args, "checkpoint.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000005" in resumed.stderr
    assert losses_by_step(tmp_path / "run") == uninterrupted("ddp")


def test_no_emergency_checkpoint_from_a_half_applied_update(tmp_path):
    """Rank 1 raises while applying step 5's update: no agreement on a consistent state, no step-5 checkpoint."""
    args = [*CHECKPOINTED, "checkpoint.every_n_steps=4", "checkpoint.emergency_timeout_s=5", "hydra.run.dir=run"]
    failed = run_train(args, tmp_path, env={"DISTRAIN_INJECT_FAULT": "raise:1:5:update"})
    assert failed.returncode == 1
    assert "while applying the update of step 5" in failed.stderr
    assert "no emergency checkpoint" in failed.stderr
    assert checkpoints(tmp_path / "run") == ["step_00000004"]


def test_async_checkpoints_resume_exactly(tmp_path, uninterrupted):
    """Periodic saves written in the background still become complete checkpoints and resume bit for bit."""
    args = [*CHECKPOINTED, "checkpoint.every_n_steps=2", "checkpoint.async_save=true", "hydra.run.dir=run"]
    result = run_train(args, tmp_path)
    assert result.returncode == 0, result.stderr
    assert checkpoints(tmp_path / "run") == [f"step_{s:08d}" for s in (2, 4, 6, 8, 10)]
    resumed = run_train(
        [
            *CHECKPOINTED,
            "hydra.run.dir=again",
            f"checkpoint.resume={tmp_path / 'run' / 'checkpoints' / 'step_00000004'}",
        ],
        tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert losses_by_step(tmp_path / "run") == uninterrupted("ddp")
    after = losses_by_step(tmp_path / "again")
    assert after == {step: loss for step, loss in uninterrupted("ddp").items() if step > 4}


# Same global batch (8 sequences) on 2 and on 4 ranks, so the resumed run trains on the same samples.
LAYOUT = {
    2: ["distributed.nproc_per_node=2", "data.micro_batch_size=4"],
    4: ["distributed.nproc_per_node=4", "data.micro_batch_size=2"],
}


# One direction per strategy: both directions of both take twice as long and test the same resharding.
@pytest.mark.parametrize("strategy,saved_on,resumed_on", [("ddp", 2, 4), ("fsdp", 4, 2)])
def test_resume_on_a_different_number_of_ranks(tmp_path, strategy, saved_on, resumed_on):
    common = [*CHECKPOINTED, *STRATEGIES[strategy], "trainer.max_steps=8", "checkpoint.every_n_steps=4"]
    first = run_train([*common, *LAYOUT[saved_on], "hydra.run.dir=first"], tmp_path)
    assert first.returncode == 0, first.stderr
    checkpoint = tmp_path / "first" / "checkpoints" / "step_00000004"
    second = run_train(
        [*common, *LAYOUT[resumed_on], "hydra.run.dir=second", f"checkpoint.resume={checkpoint}"], tmp_path
    )
    assert second.returncode == 0, second.stderr
    before, after = losses_by_step(tmp_path / "first"), losses_by_step(tmp_path / "second")
    assert sorted(after) == [5, 6, 7, 8]
    # Same parameters, optimizer state, schedule and samples; only the reduction order differs.
    assert all(math.isclose(after[s], before[s], rel_tol=1e-4) for s in after), (before, after)
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["world_size"] == resumed_on


def validation_loss(run_dir, state_dict):
    """The token-mean validation loss of ``state_dict`` in one process, on the run's validation batches."""
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    model = instantiate(cfg.model)
    model.load_state_dict(state_dict, strict=True)
    windows = TokenWindows(instantiate(cfg.data.corpus).val, cfg.data.seq_len)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for rank in range(2):
            kwargs = dict(micro_batch_size=cfg.data.micro_batch_size, num_batches=cfg.trainer.eval_batches)
            for batch in validation_batches(windows, dp_rank=rank, dp_size=2, **kwargs):
                total += next_token_loss(model(batch.inputs), batch.targets).item()
                tokens += batch.num_tokens
    return total / tokens


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_export_consolidates_a_sharded_checkpoint(tmp_path, strategy):
    """The exported file loads into a plain model (strict) whose validation loss is the one the run measured."""
    result = run_train([*CHECKPOINTED, *STRATEGIES[strategy], "trainer.max_steps=4", "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "model.pt"
    export = subprocess.run(
        [sys.executable, "-m", "distrain.checkpoint.export", str(tmp_path / "run/checkpoints/step_00000004"), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 0, export.stderr
    measured = json.loads((tmp_path / "run" / "summary.json").read_text())["final_val_loss"]
    assert math.isclose(validation_loss(tmp_path / "run", torch.load(out)), measured, rel_tol=1e-5)


PEAK_RSS = """
import resource, sys
from pathlib import Path
from distrain.checkpoint.export import export_checkpoint
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
counts = export_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, counts["bytes"])
"""


def test_export_holds_one_copy_of_the_model(tmp_path):
    """A 12.6M-parameter FSDP checkpoint (AdamW state: 3x the model on disk): exporting it raises the process's
    peak memory by less than 1.5x the model, where reading the whole checkpoint would take 3x."""
    big = ["model.d_model=512", "model.n_layers=4", "trainer.max_steps=1", "trainer.eval_batches=1"]
    result = run_train([*CHECKPOINTED, "parallelism=fsdp", *big, "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 0, result.stderr
    out = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(tmp_path / "run/checkpoints/step_00000001"), str(tmp_path / "m.pt")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    growth, model_bytes = map(int, out.stdout.split())
    assert model_bytes > 40e6
    assert growth < 1.5 * model_bytes, (growth, model_bytes)
