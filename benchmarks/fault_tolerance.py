"""ft=torchft under real failures: replica groups killed by SIGKILL while the job trains, measured against the same job
uninterrupted.

Runs `train.py ft=torchft ft.replica_groups=G` on the default model and data (G groups of one CPU rank each), once
uninterrupted and once per scenario: one kill of group 1, and a soak with several kills of random groups (group 0,
the one whose metrics are the run's, included) at random steps. Each kill SIGKILLs every rank of the group; its
supervisor's elastic agent restarts them and they heal from a live group. Reported per scenario:

- steps lost by the survivors: steps the quorum did not commit and the survivors ran again (the "not committed"
  warnings in every group's train.log, which each life of a group appends to);
- the outage: steps of group 0's metrics that ran with fewer groups (the smaller global batch), or that group 0
  missed while it was the one killed;
- time to rejoin: from the SIGKILL to the restarted group's "joined at step" line (start-up, quorum, healing). A
  restart faster than the lighthouse's heartbeat timeout is absorbed in the survivors' next quorum, which waits for
  the group (no step runs with fewer groups); a slower one shows as outage steps;
- the final validation loss against the uninterrupted run (every group validates on the whole validation set).

    python benchmarks/fault_tolerance.py                                  # 200 steps, 2 groups, 4 soak kills
    python benchmarks/fault_tolerance.py --out-dir benchmarks/results
    python benchmarks/fault_tolerance.py --out-dir benchmarks/results --diloco   # comm=diloco across the groups

With ``--diloco`` the groups are DiLoCo's workers (``comm=diloco comm.sync_every=10``, plain averaging: outer lr 1,
no momentum), which talk only at outer steps: the "steps lost" column then counts outer steps not committed (the
inner steps before them are kept), a restarted group heals at the next outer step, and the outage column (read from
the groups in the last quorum) is a lower bound. The step-time column (the median step) compares with the per-step
quorum of the default mode.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import REPO, metrics, publish

DILOCO = ["comm=diloco", "comm.sync_every=10", "comm.outer_lr=1.0", "comm.outer_momentum=0.0", "comm.nesterov=false"]
DELAY = "0:0.05"  # every group's rank 0 sleeps 50 ms per step: the default job's steps are shorter than a restart


def group_ranks(launcher: psutil.Process, group: int) -> list[psutil.Process]:
    """The rank processes of one replica group: the children of that group's fork server."""
    ranks = []
    for process in launcher.children(recursive=True):
        try:
            forkserver = "multiprocessing.forkserver" in " ".join(process.cmdline())
            if forkserver and process.environ().get("DISTRAIN_REPLICA_GROUP") == str(group):
                ranks += process.children()
        except psutil.NoSuchProcess:
            continue
    return ranks


def last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def group_dir(run_dir: Path, group: int) -> Path:
    return run_dir if group == 0 else run_dir / f"replica_group_{group}"


def joins(run_dir: Path, group: int) -> int:
    log = group_dir(run_dir, group) / "train.log"
    return log.read_text().count("joined at step") if log.exists() else 0


def run(args: list[str], run_dir: Path, kills: list[tuple[int, int]], groups: int) -> dict:
    """Train with ``kills`` = [(step, group)]: at each step (read from group 0's metrics), SIGKILL that group's
    ranks, then wait for it to rejoin before the next kill."""
    command = [sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "DISTRAIN_INJECT_DELAY": DELAY}
    events = []
    output = (run_dir.parent / f"{run_dir.name}.log").open("w+")  # a pipe left unread would fill and stop the run
    with subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True) as process:
        launcher, pending, waiting = psutil.Process(process.pid), list(kills), None
        while process.poll() is None:
            if waiting is not None:  # (group, killed_at, joins before, step)
                group, killed_at, before, step = waiting
                if joins(run_dir, group) > before:
                    events.append({"group": group, "step": step, "rejoin_s": time.monotonic() - killed_at})
                    waiting = None
            elif pending and last_step(run_dir) >= pending[0][0]:
                ranks = group_ranks(launcher, pending[0][1])
                if ranks:  # none while its fork server is being restarted: try again at the next poll
                    step, group = pending.pop(0)
                    before = joins(run_dir, group)
                    for rank in ranks:
                        rank.send_signal(signal.SIGKILL)
                    waiting = (group, time.monotonic(), before, step)
            time.sleep(0.02)
    output.seek(0)
    text = output.read()
    output.close()
    if process.returncode != 0:
        sys.exit(f"train.py failed:\n{text[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    # Every life of a group appends to its train.log: the survivors' steps run again, whichever group survived.
    lost = sum((group_dir(run_dir, group) / "train.log").read_text().count("not committed") for group in range(groups))
    records = metrics(run_dir)
    outage = sum(1 for r in records if r.get("replica_groups", groups) < groups) + summary["steps"] - len(records)
    for event in events:
        joined = re.findall(r"joined at step (\d+)", (group_dir(run_dir, event["group"]) / "train.log").read_text())
        event["missed"] = int(joined[-1]) - event["step"] if joined else None
    times = sorted(r["step_time_s"] for r in records if "step_time_s" in r)
    step_ms = 1000 * times[len(times) // 2] if times else float("nan")  # the median: kills stretch a few steps
    return {"summary": summary, "events": events, "outage_steps": outage, "lost": lost, "step_ms": step_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--soak-kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None, help="write fault_tolerance.md here")
    parser.add_argument(
        "--diloco", action="store_true", help="comm=diloco across the groups (fault_tolerance_diloco.md)"
    )
    args = parser.parse_args()
    common = [
        "ft=torchft",
        f"ft.replica_groups={args.groups}",
        f"distributed.nproc_per_node={args.groups}",
        f"trainer.max_steps={args.steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        "checkpoint=none",
        "logger=none",
        "distributed.threads_per_rank=1",  # the groups' ranks share the machine's cores: step times compare
    ]
    if args.diloco:
        common += DILOCO
    # Kills at random steps, one per stretch of the run, of each group in turn (group 0 writes the run's metrics
    # and, while it lives, the checkpoints; a run with it killed must end the same).
    draw = random.Random(args.seed)
    spacing = args.steps // (args.soak_kills + 1)
    soak = [
        (spacing * (i + 1) - draw.randrange(max(1, spacing // 2)), (i + 1) % args.groups)
        for i in range(args.soak_kills)
    ]
    scenarios = {
        "uninterrupted": [],
        f"group 1 killed at step {args.steps // 4}": [(args.steps // 4, 1)],
        f"soak: {len(soak)} kills {soak}": soak,
    }
    header = (
        "| scenario | kills | steps lost (survivors) | outage steps | rejoin (s) | step (ms) | final val loss "
        "| vs uninterrupted |"
    )
    rows = [header, "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for index, (name, kills) in enumerate(scenarios.items()):
            results[name] = r = run(common, Path(tmp) / str(index), kills, args.groups)
            reference = results["uninterrupted"]["summary"]["final_val_loss"]
            rejoin = ", ".join(f"{e['rejoin_s']:.1f}" for e in r["events"]) or "-"
            val = r["summary"]["final_val_loss"]
            rows.append(
                f"| {name} | {len(r['events'])} | {r['lost']} | {r['outage_steps']} | {rejoin} | {r['step_ms']:.0f} "
                f"| {val:.4f} | {val / reference - 1:+.2%} |"
            )
            print(rows[-1], flush=True)
    title = (
        f"default model and data, {args.groups} replica groups of 1 CPU rank (gloo), {args.steps} steps, "
        f"rank 0 of each group sleeping {DELAY.split(':')[1]} s per step (DISTRAIN_INJECT_DELAY)"
        + (f", {' '.join(DILOCO)}" if args.diloco else ", gradients averaged across the groups every step")
    )
    publish(title, rows, args.out_dir, "fault_tolerance_diloco" if args.diloco else "fault_tolerance")


if __name__ == "__main__":
    main()
