"""Running train.py with torchft replica groups as the tests do: start it, act on its groups' rank processes (a
SIGKILL of every rank of one group) when a condition on its outputs holds, and read back what each group wrote."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
from helpers import REPO, run_train

SLOW_STEPS = {"DISTRAIN_INJECT_DELAY": "0:0.1"}  # rank 0 of each group sleeps 0.1 s per step: room for the kill


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def group_ranks(launcher, group):
    """The rank processes of one replica group: children of that group's fork server."""
    ranks = []
    for process in launcher.children(recursive=True):
        try:
            if "multiprocessing.forkserver" in " ".join(process.cmdline()):
                if process.environ().get("DISTRAIN_REPLICA_GROUP") == str(group):
                    ranks += process.children()
        except psutil.NoSuchProcess:
            pass
    return ranks


def run_until(tmp_path, args, when, act, timeout=240):
    """Start train.py, call ``act(launcher)`` once ``when()`` holds, and wait for the end."""
    return run_with(tmp_path, args, [(when, act)], timeout)


def run_with(tmp_path, args, actions, timeout=240):
    """Start train.py and take ``actions`` [(when, act)] in turn: each ``act(launcher)`` once its ``when()`` holds."""
    command = [sys.executable, str(REPO / "train.py"), *args]
    out, err = (open(tmp_path / name, "w+") for name in ("stdout.txt", "stderr.txt"))  # never a full pipe
    pending = list(actions)
    with out, err, subprocess.Popen(
        command, cwd=tmp_path, env={**os.environ, **SLOW_STEPS}, stdout=out, stderr=err, text=True,
        start_new_session=True,
    ) as process:  # fmt: skip
        try:
            deadline = time.monotonic() + timeout
            while process.poll() is None and time.monotonic() < deadline:
                if pending and pending[0][0]():
                    pending.pop(0)[1](psutil.Process(process.pid))
                time.sleep(0.05)
            process.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert not pending, stderr
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def reached(metrics, step):
    def check():
        try:
            lines = metrics.read_text().splitlines()
            return bool(lines) and json.loads(lines[-1])["step"] >= step
        except (OSError, ValueError):
            return False

    return check


def killer(group, killed):
    def kill(launcher):
        ranks = group_ranks(launcher, group)
        assert ranks, f"no ranks of group {group}"
        for rank in ranks:
            rank.send_signal(signal.SIGKILL)
        killed.append(group)

    return kill


def joined(run, group, times):
    """True once group's train.log says it joined (healed) ``times`` times."""
    log = (run if group == 0 else run / f"replica_group_{group}") / "train.log"
    return lambda: log.exists() and log.read_text().count("joined at step") >= times


def reference_run(tmp_path_factory, name, args):
    """The run directory of train.py with ``args`` (a job without replica groups, to compare the groups against)."""
    root = tmp_path_factory.mktemp(name)
    result = run_train([*args, "hydra.run.dir=run"], root)
    assert result.returncode == 0, result.stderr
    return root / "run"
