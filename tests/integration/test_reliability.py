"""Reliability through train.py: every strategy at world size 1, a finished run resumed, checkpoint directory
locks, a full disk during a save, a rank that stops responding."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import FAST, REPO, run_train

from distrain.checkpoint.steps import checkpoint_problem, step_directories

ONE_RANK = [*FAST, "distributed.nproc_per_node=1", "trainer.max_steps=4", "hydra.run.dir=run"]
# Every strategy and communication option that can run on one rank; all compute the same fp32 math there.
WORLD_SIZE_ONE = {
    "single": ["parallelism=single"],
    "ddp": ["parallelism=ddp"],
    "fsdp": ["parallelism=fsdp"],
    "zero1": ["parallelism=zero", "stage=1"],
    "zero3": ["parallelism=zero", "stage=3"],
    "tensor": ["parallelism=tensor"],
    "pipeline": ["parallelism=pipeline"],
    "interleaved": ["parallelism=pipeline", "parallelism.schedule=interleaved"],
    "hybrid": ["parallelism=hybrid"],
    "ddp_powersgd": ["parallelism=ddp", "comm=powersgd"],
    "ddp_bf16": ["parallelism=ddp", "comm=bf16"],
    "ddp_hierarchical": ["parallelism=ddp", "comm=hierarchical"],
    "ddp_topk": ["parallelism=ddp", "comm=topk"],  # top-k changes the update even on one rank
}


def strict_json(path):
    """The file parsed as standard JSON: NaN, Infinity and -Infinity are refused."""

    def refuse(constant):
        raise ValueError(f"{path} holds {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def single_process_val_loss(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    result = run_train([*ONE_RANK, "parallelism=single"], root)
    assert result.returncode == 0, result.stderr
    return strict_json(root / "run" / "summary.json")["final_val_loss"]


@pytest.mark.parametrize("name", sorted(WORLD_SIZE_ONE))
def test_every_strategy_finishes_on_one_rank_with_a_valid_summary(tmp_path, single_process_val_loss, name):
    """World size 1 (what a one-GPU machine gets by default): the run ends with exit 0 and a summary.json and
    metrics.jsonl that are standard JSON; the dense strategies reach the single process's validation loss."""
    result = run_train([*ONE_RANK, *WORLD_SIZE_ONE[name], "checkpoint=default", "checkpoint.every_n_steps=2"], tmp_path)
    assert result.returncode == 0, result.stderr
    summary = strict_json(tmp_path / "run" / "summary.json")
    assert summary["steps"] == 4 and summary["world_size"] == 1
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda constant: pytest.fail(f"metrics.jsonl holds {constant}"))
    assert all(stats["count"] >= 1 for stats in summary["metrics"].values())
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    if name != "ddp_topk":
        assert summary["final_val_loss"] == pytest.approx(single_process_val_loss, abs=1e-5)


# ------------------------------------------------------------------------------------ checkpoints on disk

CHECKPOINTED = [*ONE_RANK, "checkpoint=default", "checkpoint.every_n_steps=2", "checkpoint.keep_last=0"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 4-step one-rank run with checkpoints at steps 2 and 4, and its losses."""
    root = tmp_path_factory.mktemp("finished")
    result = run_train(CHECKPOINTED, root)
    assert result.returncode == 0, result.stderr
    return root / "run"


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def copy_run(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def rewrite_manifest(checkpoint):
    """Make the manifest match the files again, as someone who altered them on purpose would."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


class RunsCode:
    """Unpickling this creates the file ``marker``: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def corrupt(checkpoint, how, marker):
    if how == "shard_bytes_changed":
        shard = next(checkpoint.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        return "__0_0.distcp does not match its checksum"
    if how == "file_truncated":
        rng = checkpoint / "rng_rank0.pt"
        rng.write_bytes(rng.read_bytes()[:100])
        return "rng_rank0.pt has 100 bytes"
    if how == "manifest_missing":
        (checkpoint / "manifest.json").unlink()
        return "no manifest.json"
    torch.save({"torch": RunsCode(marker)}, checkpoint / "rng_rank0.pt")  # how == "pickled_code"
    rewrite_manifest(checkpoint)
    return "holds Python objects that are not data"


@pytest.mark.parametrize("how", ["shard_bytes_changed", "file_truncated", "manifest_missing", "pickled_code"])
def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, finished_run, how):
    """resume=auto names the checkpoint it skips and why, resumes from the one before, and trains the same losses;
    a checkpoint holding a pickle that would run code is refused without running it."""
    run_dir = copy_run(finished_run, tmp_path)
    marker = tmp_path / "code_ran"
    reason = corrupt(run_dir / "checkpoints" / "step_00000004", how, marker)
    result = run_train([*CHECKPOINTED, "checkpoint.resume=auto"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"skipping checkpoint {run_dir / 'checkpoints' / 'step_00000004'}: " in result.stderr
    assert reason in result.stderr
    assert "resumed from" in result.stderr and "step_00000002 at step 2" in result.stderr
    assert losses(run_dir) == losses(finished_run)
    assert not marker.exists()


def test_a_checkpoint_holding_code_is_refused_in_one_line(tmp_path, finished_run):
    """checkpoint.resume=<path> of a checkpoint whose RNG file is a code-running pickle (manifest rewritten to
    match): one line naming the file, exit 2 before any rank starts, and the code never runs."""
    run_dir = copy_run(finished_run, tmp_path)
    marker = tmp_path / "code_ran"
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    corrupt(checkpoint, "pickled_code", marker)
    result = run_train([*CHECKPOINTED, f"checkpoint.resume={checkpoint}", "hydra.run.dir=other"], tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("distrain:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert f"{checkpoint / 'rng_rank0.pt'} holds Python objects that are not data" in lines[0]
    assert "its pickle calls io.open" in lines[0]
    assert not marker.exists()


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, finished_run):
    run_dir = copy_run(finished_run, tmp_path)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    result = run_train([*CHECKPOINTED, "checkpoint.resume=auto"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "distrain: the run is complete at step 4 (trainer.max_steps=4" in result.stderr
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    assert after == before


# ------------------------------------------------------------------------------------ one job per directory


def distrain_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("distrain:")]


def test_a_second_job_on_the_same_checkpoint_dir_is_refused_until_the_first_is_gone(tmp_path):
    """While job A runs, job B with the same checkpoint.dir is refused in one line naming A's host, pid and run
    directory (exit 2). Once A is killed (launcher and ranks, SIGKILL: its lock stays behind), A's restart takes the
    stale lock over with a warning and continues from A's newest checkpoint."""
    shared = tmp_path / "shared_checkpoints"
    first = [*CHECKPOINTED, "trainer.max_steps=100000", f"checkpoint.dir={shared}", "hydra.run.dir=first"]
    job_a = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *first],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (shared / ".lock").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        holder = json.loads((shared / ".lock").read_text())
        assert holder["pid"] == job_a.pid
        second = [*CHECKPOINTED, f"checkpoint.dir={shared}", "hydra.run.dir=second"]
        refused = run_train(second, tmp_path)
        assert refused.returncode == 2
        (line,) = distrain_lines(refused.stderr)
        assert f"checkpoint.dir={shared} is in use by another job" in line
        assert f"pid {job_a.pid}" in line and str(tmp_path / "first") in line and holder["host"] in line
        assert not (tmp_path / "second" / "metrics.jsonl").exists()
        while not step_directories(shared) and time.monotonic() < deadline + 60:
            time.sleep(0.2)  # A has saved a checkpoint that its restart can continue
    finally:
        os.killpg(job_a.pid, signal.SIGKILL)
        job_a.wait()
    assert (shared / ".lock").exists()
    # A restart of job A (as a requeue would be): it continues A's newest checkpoint for two more steps.
    newest = max(int(p.name.split("_")[1]) for p in step_directories(shared))
    restart = [*first, "hydra.run.dir=restart", "checkpoint.resume=auto", f"trainer.max_steps={newest + 2}"]
    took_over = run_train(restart, tmp_path)
    assert took_over.returncode == 0, took_over.stderr
    assert f"taking over the lock of {shared}: process {job_a.pid}" in took_over.stdout + took_over.stderr
    assert f"step_{newest:08d} at step {newest}" in took_over.stderr
    assert (shared / f"step_{newest + 2:08d}").is_dir()
    assert not (shared / ".lock").exists()  # released at the end


# ------------------------------------------------------------------------------------ a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of a chosen size (tmpfs); resized with ``resize(kib)``."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()

    def mount(kib, remount=False):
        options = f"{'remount,' if remount else ''}size={kib}k"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True)
        if done.returncode:
            pytest.skip(f"this machine cannot mount a tmpfs to fill: {done.stderr.decode().strip()}")

    yield mount_point, mount
    subprocess.run(["umount", str(mount_point)], capture_output=True)


def test_a_disk_that_fills_during_a_save_loses_nothing(tmp_path, small_disk, finished_run):
    """A first save that does not fit: one line (directory, bytes written, bytes free), no partial .tmp left.
    Room for one checkpoint only: the step-2 checkpoint is written, the step-4 save is refused before writing (its
    size is known); after the disk is enlarged, resume=auto continues from step 2 with the same losses."""
    disk, mount = small_disk
    args = [*CHECKPOINTED, f"checkpoint.dir={disk / 'checkpoints'}"]
    mount(1000)
    during = run_train(args, tmp_path)
    assert during.returncode == 1
    (line,) = distrain_lines(during.stderr)
    assert f"checkpoint directory {disk / 'checkpoints'} ran out of space while saving a checkpoint" in line
    assert "Traceback" not in during.stderr
    assert list((disk / "checkpoints").iterdir()) == []

    mount(3000, remount=True)
    before = run_train(args, tmp_path)
    assert before.returncode == 1
    (line,) = distrain_lines(before.stderr)
    needed = sum(p.stat().st_size for p in (disk / "checkpoints" / "step_00000002").iterdir())
    assert f"has too little free space for a checkpoint: it needs {needed:,} bytes" in line
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["step_00000002"]

    mount(8000, remount=True)
    resumed = run_train([*args, "checkpoint.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000002 at step 2" in resumed.stderr
    assert losses(tmp_path / "run") == losses(finished_run)


# ------------------------------------------------------------------------------------ a rank that stops responding

TIMEOUT_S = 10


@pytest.mark.parametrize("fault", ["stop:1:3", "spin:1:3", "stop:0:3", "stop:1:3:update"])
def test_a_rank_that_stops_responding_ends_the_job_in_time_and_is_named(tmp_path, fault):
    """SIGSTOP (or an endless loop) in one rank after step 3 (or in the middle of step 3's update): the job exits
    1 within distributed.timeout_s plus a margin (start-up, the failed ranks' agreement wait), with one line naming
    the rank, and the step-2 checkpoint intact. No hang."""
    args = [
        *FAST,
        "trainer.max_steps=50",
        "hydra.run.dir=run",
        f"distributed.timeout_s={TIMEOUT_S}",
        "checkpoint=default",
        "checkpoint.every_n_steps=2",
        "checkpoint.emergency_timeout_s=5",
    ]
    started = time.monotonic()
    result = run_train(args, tmp_path, env={"DISTRAIN_INJECT_FAULT": fault}, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    # Start-up, three steps, the timeout, the failed ranks' agreement wait (5 s) and exit: generous for a loaded
    # machine, far below the launcher's own 30 s SIGTERM grace plus the timeout that a hang would add.
    assert elapsed < TIMEOUT_S + 45, f"took {elapsed:.0f} s"
    (line,) = distrain_lines(result.stderr)
    stopped_rank = fault.split(":")[1]
    assert f"rank {stopped_rank} (pid " in line and "stopped responding" in line and f"timeout_s={TIMEOUT_S}" in line
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in step_directories(checkpoints)] == ["step_00000002"]
    assert checkpoint_problem(checkpoints / "step_00000002") is None


@pytest.mark.parametrize(
    "change,needle",
    [
        (["model.d_model=32"], "model.d_model=32 is not allowed: 64 as in the checkpoint"),
        (["optimizer=sgd"], "optimizer='sgd' is not allowed: adamw as in the checkpoint"),
        (["parallelism=zero"], "parallelism='zero' is not allowed: a strategy that reads DCP's format"),
        (["parallelism=pipeline"], "parallelism='pipeline' is not allowed: parallelism=ddp without a pipeline as in"),
        (["checkpoint.resume=never"], "checkpoint.resume='never' is not allowed: auto, or another checkpoint.dir"),
    ],
)
def test_a_checkpoint_this_config_cannot_use_is_refused_in_one_line(tmp_path, finished_run, change, needle):
    """Resuming with another model, optimizer or checkpoint format, or a fresh run into a directory holding an
    earlier run's checkpoints (pruning would delete its saves): one line, exit 2, nothing changed."""
    run_dir = copy_run(finished_run, tmp_path)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    result = run_train([*CHECKPOINTED, "trainer.max_steps=6", "checkpoint.resume=auto", *change], tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = distrain_lines(result.stderr)
    assert needle in line and "Traceback" not in result.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
