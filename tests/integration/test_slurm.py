"""train.py on a real SLURM cluster (cluster/local_slurm.sh: two slurmd daemons as nodes n1 and n2) through
hydra-submitit-launcher: a 2-node DDP job, a 2-job multirun, a pre-timeout signal that checkpoints, requeues and
resumes, requests the cluster cannot satisfy, and torchft replica groups one per node, one of them killed."""

import json
import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest
from helpers import FAST, REPO, run_train
from replica_groups_helpers import SLOW_STEPS, records

pytestmark = [pytest.mark.integration, pytest.mark.slurm]


def cluster_up():
    if shutil.which("sinfo") is None:
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0


if not cluster_up():
    pytest.skip("no SLURM cluster here (bash cluster/local_slurm.sh up starts one)", allow_module_level=True)

SLURM = ["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10", *FAST]


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


FAILED_JOB_STATES = {"FAILED", "CANCELLED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY"}


def slurm_output(*command):
    return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout


def job_state(job_id):
    return slurm_output("scontrol", "show", "job", job_id)


def release_requeued_job(job_id, submitting, deadline):
    """SLURM holds a requeued job for about two minutes before it may start again; release it sooner, once both
    nodes are idle and a few seconds have passed. A job started again within the second its old run was killed in is
    refused by slurmd ("Job credential revoked") and ends as failed, which submitit cannot see without sacct."""
    pending_since = None
    while time.time() < deadline and submitting.poll() is None:
        state, _, reason = slurm_output("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T %r").strip().partition(" ")
        if state in FAILED_JOB_STATES:
            submitting.kill()
            pytest.fail(f"job {job_id} failed instead of finishing after the requeue:\n{job_state(job_id)}")
        if state == "PENDING" and reason == "BeginTime":
            pending_since = pending_since or time.time()
            nodes = slurm_output("sinfo", "-h", "-N", "-o", "%t").split()
            if time.time() - pending_since >= 3 and nodes and all(n == "idle" for n in nodes):
                subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], timeout=30)
        time.sleep(1)


def test_two_job_multirun_finishes_both(tmp_path):
    result = run_train([*SLURM, "trainer.max_steps=5", "trainer.seed=1,2", "hydra.sweep.dir=sweep"], tmp_path)
    assert result.returncode == 0, result.stderr
    for job in ("0", "1"):
        run_dir = tmp_path / "sweep" / job
        assert summary(run_dir)["steps"] == 5 and (run_dir / ".hydra" / "config.yaml").is_file()
    assert (
        summary(tmp_path / "sweep" / "0")["final_train_loss"] != summary(tmp_path / "sweep" / "1")["final_train_loss"]
    )


ONE_GROUP_PER_NODE = ["ft=torchft", "ft.replica_groups=2", "distributed.nproc_per_node=1"]


@pytest.mark.parametrize("groups", [[], ONE_GROUP_PER_NODE], ids=["ddp", "replica_groups"])
def test_pre_timeout_signal_checkpoints_requeues_and_finishes_like_an_uninterrupted_job(tmp_path, groups):
    """A 2-node job gets SIGUSR2 (what submitit asks SLURM to send before the time limit) after step 8: its ranks
    (with replica groups: both groups, after the same step) checkpoint at the step boundary, rank 0 requeues the job,
    and the requeued job resumes and logs exactly the losses of an uninterrupted 2-node job."""
    args = [*SLURM, "hydra.launcher.nodes=2", "trainer.max_steps=30", "checkpoint=default", *groups]
    submitting = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args, "hydra.sweep.dir=signalled"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "signalled" / "0" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 8):
        time.sleep(0.5)
    (job_id,) = [p.name for p in (tmp_path / "signalled" / ".submitit").iterdir() if p.name.isdigit()]
    try:
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        release_requeued_job(job_id, submitting, deadline=time.time() + 180)
        output, _ = submitting.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        submitting.kill()
        pytest.fail(f"job {job_id} did not finish after the requeue:\n{job_state(job_id)}")
    finally:
        subprocess.run(["scancel", job_id], timeout=30)  # never leave a job behind for the next test
    assert submitting.returncode == 0, output
    run_dir = tmp_path / "signalled" / "0"
    log = "\n".join(p.read_text() for p in (tmp_path / "signalled" / ".submitit" / job_id).glob("*.err"))
    assert "stopping at step" in log and "requeueing SLURM job" in log and "resumed from" in log
    stopped_at = min(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").iterdir())
    assert 8 <= stopped_at < 30

    reference = run_train([*args, "hydra.sweep.dir=uninterrupted"], tmp_path)
    assert reference.returncode == 0, reference.stderr
    expected = tmp_path / "uninterrupted" / "0"
    if groups:  # each group is its own torch.distributed world, on its own node
        assert summary(expected)["replica_groups"] == 2 and summary(expected)["nodes"] == ["n1"]
        assert summary(expected / "replica_group_1")["nodes"] == ["n2"]
    else:
        assert summary(expected)["world_size"] == 2 and summary(expected)["nodes"] == ["n1", "n2"]
    assert losses(run_dir) == losses(expected)  # every step, before and after the requeue
    assert summary(run_dir)["final_val_loss"] == summary(expected)["final_val_loss"]


@pytest.mark.parametrize(
    "override,message",
    [
        ("hydra.launcher.nodes=3", "hydra.launcher.nodes=3 is not allowed: at most 2 (partition debug)"),
        ("hydra.launcher.partition=gpu", "hydra.launcher.partition='gpu' is not allowed: one of debug"),
        ("hydra.launcher.tasks_per_node=4", "hydra.launcher.tasks_per_node=4 is not allowed"),
        (
            "ft=torchft hydra.launcher.tasks_per_node=2",
            "hydra.launcher.tasks_per_node=2 is not allowed: 1 with ft=torchft",
        ),
        (
            "ft=torchft hydra.launcher.nodes=2 ft.replica_groups=3",
            "ft.replica_groups=3 is not allowed: a multiple of hydra.launcher.nodes=2",
        ),
    ],
)
def test_a_request_the_cluster_cannot_satisfy_is_refused_at_submission(tmp_path, override, message):
    result = run_train([*SLURM, *override.split(), "hydra.sweep.dir=sweep"], tmp_path, timeout=120)
    assert result.returncode == 2
    assert f"distrain: invalid SLURM request: {message}" in result.stderr
    assert not (tmp_path / "sweep" / ".submitit").exists()  # nothing was submitted


def test_hierarchical_all_reduce_takes_its_nodes_from_slurm(tmp_path):
    """comm=hierarchical in a 2-node job finds its node groups in SLURM's environment (tasks per node, node names)
    and trains exactly like the flat all-reduce in the same 2-node allocation."""
    args = [*SLURM, "hydra.launcher.nodes=2", "trainer.max_steps=8", "comm=default,hierarchical"]
    result = run_train([*args, "hydra.sweep.dir=sweep"], tmp_path)
    assert result.returncode == 0, result.stderr
    flat, two_level = tmp_path / "sweep" / "0", tmp_path / "sweep" / "1"
    assert "hierarchical all-reduce: 2 nodes x 1 ranks per node (n1, n2)" in (two_level / "train.log").read_text()
    assert summary(two_level)["nodes"] == ["n1", "n2"]
    flat_losses, two_level_losses = losses(flat), losses(two_level)
    assert flat_losses.keys() == two_level_losses.keys() and len(flat_losses) >= 8
    for step, loss in flat_losses.items():
        assert two_level_losses[step] == pytest.approx(loss, rel=1e-6), step


def test_a_config_refused_inside_the_job_comes_back_to_the_submitter_in_one_line(tmp_path):
    """A check only a job can make (here: the job's ranks, counted on its nodes) refuses inside it. The refusal
    reaches the submitting command as one line; an exit would leave submitit without a result, waiting forever on
    a cluster that keeps no accounting (this one)."""
    args = [*SLURM, "hydra.launcher.nodes=2", "ft=torchft", "ft.replica_groups=4", "distributed.nproc_per_node=1"]
    result = run_train([*args, "hydra.sweep.dir=sweep"], tmp_path, timeout=180)
    assert result.returncode == 1
    line = "distrain: invalid config: ft.replica_groups=4 is not allowed: a divisor of the job's 2 ranks"
    assert line in result.stderr and "Traceback" not in result.stderr


def group_ranks_in_job(job_id, group):
    """The rank processes of one replica group of a SLURM job: children of that group's fork server (on whichever
    node; the local cluster's nodes share this machine's process table)."""
    ranks = []
    for process in psutil.process_iter():
        try:
            if "multiprocessing.forkserver" in " ".join(process.cmdline()):
                env = process.environ()
                if env.get("SLURM_JOB_ID") == job_id and env.get("DISTRAIN_REPLICA_GROUP") == str(group):
                    ranks += process.children()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return ranks


def last_step(metrics):
    try:
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError):
        return 0


def test_replica_groups_one_per_node_survive_a_killed_group(tmp_path):
    """ft=torchft in a 2-node job: each node's task runs one replica group, the first node the lighthouse. Until the
    kill the groups train as a 2-rank DDP job does; group 1 (node n2) SIGKILLed at step 10 is restarted on its node
    and heals from group 0, which never stops nor repeats a step."""
    steps = 40
    common = [*FAST, f"trainer.max_steps={steps}", "trainer.eval_every=0"]
    reference = run_train([*common, "distributed.nproc_per_node=2", "hydra.run.dir=ddp"], tmp_path)
    assert reference.returncode == 0, reference.stderr
    args = [*SLURM, *common, "hydra.launcher.nodes=2", "ft=torchft", "ft.replica_groups=2"]
    command = [sys.executable, str(REPO / "train.py"), *args, "distributed.nproc_per_node=1", "hydra.sweep.dir=ft"]
    with open(tmp_path / "submit.txt", "w+") as out:
        submitting = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                      env={**os.environ, **SLOW_STEPS})  # fmt: skip
        run_dir, job_id, killed = tmp_path / "ft" / "0", None, []
        try:
            deadline = time.time() + 240
            while submitting.poll() is None and time.time() < deadline:
                if not killed and last_step(run_dir / "replica_group_1" / "metrics.jsonl") >= 10:
                    (job_id,) = [p.name for p in (tmp_path / "ft" / ".submitit").iterdir() if p.name.isdigit()]
                    killed = group_ranks_in_job(job_id, 1)
                    for rank in killed:
                        rank.kill()
                time.sleep(0.1)
            submitting.wait(timeout=max(1, deadline - time.time()))
        finally:
            if submitting.poll() is None:
                submitting.kill()
            if job_id:
                subprocess.run(["scancel", job_id], timeout=30)  # never leave a job behind for the next test
        out.seek(0)
        output = out.read()
    assert submitting.returncode == 0, output
    assert killed, "group 1's rank was not found"
    assert summary(run_dir)["nodes"] == ["n1"] and summary(run_dir / "replica_group_1")["nodes"] == ["n2"]
    survivor = records(run_dir)
    assert [r["step"] for r in survivor] == list(range(1, steps + 1))
    expected = losses(tmp_path / "ddp")
    for step in range(1, 10):  # both groups in every step: the 2-rank DDP job's losses
        assert losses(run_dir)[step] == pytest.approx(expected[step], rel=1e-5), step
    log = (run_dir / "replica_group_1" / "train.log").read_text()
    assert "joined at step" in log and "resumed from" not in log  # healed from group 0, not from a checkpoint
    assert last_step(run_dir / "replica_group_1" / "metrics.jsonl") == steps
    healed = summary(run_dir / "replica_group_1")["final_val_loss"]
    assert healed == pytest.approx(summary(run_dir)["final_val_loss"], rel=1e-6)
    assert summary(run_dir)["final_val_loss"] == pytest.approx(summary(tmp_path / "ddp")["final_val_loss"], rel=0.02)
