"""SIGKILL of one rank process at a random moment (not at a step boundary the code chose), then
``checkpoint.resume=auto``: the job finishes with the losses of a run nothing interrupted, bit for bit, for ddp,
fsdp, zero and pipeline; a soak test repeats kill and resume several times in one run.

The moments are drawn from a seeded generator (``DISTRAIN_KILL_SEED``, default 0) and printed, so a failure
can be replayed. A slow rank (``DISTRAIN_INJECT_DELAY``, a sleep per step that changes no number) stretches the
run so that a kill lands while it trains, saves or evaluates.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from helpers import FAST, REPO, rank_processes, run_train

STEPS = 24
ARGS = [
    *FAST,
    f"trainer.max_steps={STEPS}",
    "trainer.eval_every=8",
    "checkpoint=default",
    "checkpoint.every_n_steps=4",
    "checkpoint.keep_last=2",
    "hydra.run.dir=run",
]
STRATEGIES = {
    "ddp": ["parallelism=ddp"],
    "fsdp": ["parallelism=fsdp"],
    "zero2": ["parallelism=zero", "stage=2"],
    "pipeline": ["parallelism=pipeline", "parallelism.pipeline_microbatches=2"],
}
SLOW_RANK = {"DISTRAIN_INJECT_DELAY": "0:0.15"}
SEED = int(os.environ.get("DISTRAIN_KILL_SEED", "0"))


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len({r["step"] for r in records}) == len(records), "one record per step"
    return {r["step"]: (r["loss"], r.get("val_loss")) for r in records}


def kill_one_rank_at_random(args, cwd, rng):
    """Start train.py; once training has logged a step, wait a random time, SIGKILL one random rank process.
    Returns (exit status, the step the run had logged when the rank was killed)."""
    metrics = cwd / "run" / "metrics.jsonl"
    written_before = metrics.stat().st_mtime_ns if metrics.exists() else 0
    saved = [int(p.name.split("_")[1]) for p in (cwd / "run" / "checkpoints").glob("step_????????")]
    resumes_at = max(saved, default=0)  # a step logged after this one was trained by this job

    def last_step():
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return json.loads(lines[-1])["step"] if lines else 0

    job = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=cwd,
        env={**os.environ, **SLOW_RANK},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None:
            if metrics.exists() and metrics.stat().st_mtime_ns != written_before and last_step() > resumes_at:
                break
            time.sleep(0.05)
        # Within the time the remaining steps take at least (each sleeps 0.15 s on the slow rank).
        time.sleep(rng.uniform(0.0, min(2.0, 0.1 * (STEPS - last_step()))))
        ranks = rank_processes(job.pid)
        assert job.poll() is None and ranks, "the run ended before a rank could be killed"
        victim = rng.choice(ranks)
        at_step = last_step()
        victim.send_signal(signal.SIGKILL)
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    print(f"killed rank process {victim.pid} at logged step {at_step}: exit {job.returncode}")
    assert job.returncode == 1, stderr
    assert "Signal 9" in stderr or "SIGKILL" in stderr
    return at_step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cache = {}

    def run(strategy):
        if strategy not in cache:
            root = tmp_path_factory.mktemp(f"uninterrupted_{strategy}")
            result = run_train([*ARGS, *STRATEGIES[strategy]], root)
            assert result.returncode == 0, result.stderr
            cache[strategy] = losses(root / "run")
            assert sorted(cache[strategy]) == list(range(1, STEPS + 1))
        return cache[strategy]

    return run


@pytest.mark.parametrize("strategy", sorted(set(STRATEGIES) - {"ddp"}))  # ddp: the soak test kills it 3 times
def test_sigkill_of_one_rank_at_a_random_moment_then_resume_is_bit_identical(tmp_path, uninterrupted, strategy):
    rng = random.Random(f"{SEED}-{strategy}")
    args = [*ARGS, *STRATEGIES[strategy]]
    kill_one_rank_at_random(args, tmp_path, rng)
    resumed = run_train([*args, "checkpoint.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(tmp_path / "run") == uninterrupted(strategy)


@pytest.mark.slow
def test_soak_repeated_kills_at_random_moments_lose_nothing(tmp_path, uninterrupted):
    """Three kills at random moments in one ddp run, each followed by a resume that is killed in turn; the last
    resume finishes. Every logged loss equals the uninterrupted run's."""
    rng = random.Random(f"{SEED}-soak")
    args = [*ARGS, *STRATEGIES["ddp"]]
    for kill in range(3):
        at_step = kill_one_rank_at_random([*args, "checkpoint.resume=auto"] if kill else args, tmp_path, rng)
        print(f"kill {kill + 1}: at step {at_step}")
    resumed = run_train([*args, "checkpoint.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(tmp_path / "run") == uninterrupted("ddp")
