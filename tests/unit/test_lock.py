"""One job per checkpoint directory: of several jobs starting at once exactly one holds the lock, also when they
all take over a stale one at the same moment."""

import json
import multiprocessing
import socket
import subprocess

from distrain.checkpoint.lock import LOCK_NAME, CheckpointDirInUse, CheckpointDirLock


def try_to_hold(directory, start, results):
    start.wait()
    try:
        with CheckpointDirLock(directory, run_dir=f"job-{multiprocessing.current_process().name}"):
            results.put("held")
            start.wait()  # hold it until every contender has tried
    except CheckpointDirInUse:
        results.put("refused")
        start.wait()


def contend(directory, jobs=4):
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(jobs), context.Queue()
    processes = [context.Process(target=try_to_hold, args=(directory, start, results)) for _ in range(jobs)]
    for process in processes:
        process.start()
    outcomes = sorted(results.get(timeout=30) for _ in processes)
    for process in processes:
        process.join(timeout=30)
    return outcomes


def test_of_jobs_starting_together_exactly_one_holds_the_lock(tmp_path):
    assert contend(tmp_path) == ["held", "refused", "refused", "refused"]
    assert not (tmp_path / LOCK_NAME).exists()  # released by its holder
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no drafts or stale copies left behind


def test_of_jobs_taking_over_a_stale_lock_together_exactly_one_wins(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = {"host": socket.gethostname(), "pid": gone.pid, "run_dir": "old", "slurm_job_id": None, "since": "then"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    assert contend(tmp_path) == ["held", "refused", "refused", "refused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
