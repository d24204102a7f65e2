"""ft=torchft through train.py: two replica groups train as one DDP job does; a group killed by SIGKILL is restarted
and heals from the live group while that group keeps stepping; a stop signal stops both groups at one step and the
job resumes from its checkpoint exactly; bad ft settings are refused in one line before any rank starts."""

import os
import signal

import pytest
from helpers import FAST, run_train
from replica_groups_helpers import joined, killer, losses, reached, records, reference_run, run_until, run_with, summary

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

STEPS = 40
COMMON = [*FAST, f"trainer.max_steps={STEPS}", "trainer.eval_every=0", "distributed.nproc_per_node=2"]
GROUPS = ["ft=torchft", "ft.replica_groups=2"]


@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory):
    """The same job without replica groups: DDP over the same two ranks."""
    return reference_run(tmp_path_factory, "ddp", [*COMMON])


def test_two_groups_train_as_one_ddp_job(tmp_path, plain_ddp):
    result = run_train([*COMMON, *GROUPS, "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    reference = losses(plain_ddp)
    for group_dir in (run, run / "replica_group_1"):  # each group logs the job's loss, averaged across groups
        assert losses(group_dir).keys() == reference.keys()
        for step, loss in losses(group_dir).items():
            assert loss == pytest.approx(reference[step], rel=1e-5), step
    assert summary(run)["final_val_loss"] == pytest.approx(summary(plain_ddp)["final_val_loss"], rel=1e-5)
    assert summary(run)["replica_groups"] == 2 and summary(run)["dropped_steps"] == 0
    assert {r["replica_groups"] for r in records(run)} == {2.0}


def test_a_killed_group_rejoins_from_its_peer_while_the_other_keeps_stepping(tmp_path, plain_ddp):
    run = tmp_path / "run"
    killed = []
    result = run_until(
        tmp_path, [*COMMON, *GROUPS, "hydra.run.dir=run"], reached(run / "replica_group_1" / "metrics.jsonl", 10),
        killer(1, killed),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    survivor = records(run)
    assert [r["step"] for r in survivor] == list(range(1, STEPS + 1))  # group 0 never stopped nor repeated a step
    # The outage shows: the step the group died in ran again, and steps ran with one group (none when the restart
    # fits in the survivor's next quorum, which waits for the group while the lighthouse counts it alive).
    alone = [r["step"] for r in survivor if r["replica_groups"] < 2]
    assert summary(run)["dropped_steps"] <= 1  # at most the step the group died in, run again
    assert summary(run)["dropped_steps"] + len(alone) >= 1
    assert "not committed" in (run / "train.log").read_text()
    rejoined = records(run / "replica_group_1")
    steps = [r["step"] for r in rejoined]
    # No rewind, no repeat: the steps it was away for are missing (none when its restart fit in the survivor's
    # quorum of the step it died in, which it then ran with the survivor).
    assert steps == sorted(set(steps)) and steps[-1] == STEPS
    log = (run / "replica_group_1" / "train.log").read_text()
    assert "joined at step" in log and "resumed from" not in log  # healed from the peer, not a checkpoint
    # The outage trained some steps on half the global batch: close to the uninterrupted job, not equal.
    assert summary(run)["final_val_loss"] == pytest.approx(summary(plain_ddp)["final_val_loss"], rel=0.02)


def test_a_soak_of_kills_of_either_group_loses_no_step_of_the_run(tmp_path, plain_ddp):
    """Group 1, then group 0 (whose metrics are the run's, and which writes checkpoints), then group 1 again: each
    killed after the previous one rejoined; the run ends at max_steps with one record per step and every periodic
    checkpoint. (A restart of about 2 s mostly fits in the survivor's next quorum, which waits for the group while
    the lighthouse still counts it alive, so how many steps ran with one group depends on the machine's load.)"""
    run, killed = tmp_path / "run", []
    metrics_1 = run / "replica_group_1" / "metrics.jsonl"
    actions = [
        (reached(metrics_1, 6), killer(1, killed)),
        (joined(run, 1, 1), lambda launcher: None),
        (reached(metrics_1, 16), killer(0, killed)),
        (joined(run, 0, 1), lambda launcher: None),
        (reached(run / "metrics.jsonl", 26), killer(1, killed)),
    ]
    saving = ["checkpoint=default", "checkpoint.every_n_steps=5", "checkpoint.keep_last=0"]
    result = run_with(tmp_path, [*COMMON, *GROUPS, *saving, "hydra.run.dir=run"], actions)
    assert result.returncode == 0, result.stderr
    assert killed == [1, 0, 1]
    for group_dir in (run, run / "replica_group_1"):
        steps = [r["step"] for r in records(group_dir)]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS  # none repeated, none after the end
    assert summary(run)["final_val_loss"] == pytest.approx(summary(plain_ddp)["final_val_loss"], rel=0.03)
    # Every periodic checkpoint is there, complete: group 0 (the saver while it lives) died and came back, and
    # whichever group was rank 0 of the quorum at each multiple of 5 wrote it.
    saved = {int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*")}
    assert saved == set(range(5, STEPS + 1, 5))


def test_a_stop_signal_stops_every_group_at_one_step_and_resume_is_exact(tmp_path, plain_ddp):
    run = tmp_path / "run"
    args = [*COMMON, *GROUPS, "checkpoint=default", "checkpoint.every_n_steps=0", "hydra.run.dir=run"]
    stopped = run_until(tmp_path, args, reached(run / "metrics.jsonl", 8), lambda p: p.send_signal(signal.SIGTERM))
    assert stopped.returncode == 143, stopped.stderr
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert len(saved) == 1
    step = int(saved[0].split("_")[1])
    assert records(run)[-1]["step"] == records(run / "replica_group_1")[-1]["step"] == step
    resumed = run_train([*args, "checkpoint.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    reference = losses(plain_ddp)
    for at, loss in losses(run).items():
        assert loss == pytest.approx(reference[at], rel=1e-5), at
    assert summary(run)["final_val_loss"] == pytest.approx(summary(plain_ddp)["final_val_loss"], rel=1e-5)


SHARDED = ["parallelism=fsdp", "distributed.nproc_per_node=4"]  # 2 groups of 2 ranks, each sharding the model


@pytest.fixture(scope="module")
def plain_fsdp(tmp_path_factory):
    """FSDP over the same four ranks without replica groups."""
    return reference_run(tmp_path_factory, "fsdp", [*COMMON, *SHARDED])


def test_groups_that_shard_the_model_train_as_one_fsdp_job(tmp_path, plain_fsdp):
    """Each group shards the model over its 2 ranks; rank r of each group averages its shards' gradients with
    rank r of the other group: the same losses as FSDP over the 4 ranks."""
    result = run_train([*COMMON, *SHARDED, *GROUPS, "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 0, result.stderr
    reference = losses(plain_fsdp)
    assert losses(tmp_path / "run").keys() == reference.keys()
    for step, loss in losses(tmp_path / "run").items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    assert summary(tmp_path / "run")["final_val_loss"] == pytest.approx(summary(plain_fsdp)["final_val_loss"], rel=1e-5)


def test_a_killed_sharding_group_heals_each_rank_from_its_peer_rank(tmp_path, plain_fsdp):
    """Both ranks of group 1 killed: on restart, rank r takes rank r's shards (parameters and optimizer state) from
    group 0, and the job ends close to the uninterrupted one."""
    run, killed = tmp_path / "run", []
    result = run_until(
        tmp_path, [*COMMON, *SHARDED, *GROUPS, "hydra.run.dir=run"],
        reached(run / "replica_group_1" / "metrics.jsonl", 10), killer(1, killed),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert killed == [1]
    assert [r["step"] for r in records(run)] == list(range(1, STEPS + 1))  # group 0 never stopped
    log = (run / "replica_group_1" / "train.log").read_text()
    assert "joined at step" in log and "resumed from" not in log
    rejoined = records(run / "replica_group_1")
    assert rejoined[-1]["step"] == STEPS
    # Each group evaluates the validation set on its own weights: equal only if every rank of group 1 took its own
    # shards (parameters and optimizer state, or the next steps would part them) from its peer rank.
    healed_val = summary(run / "replica_group_1")["final_val_loss"]
    assert healed_val == pytest.approx(summary(run)["final_val_loss"], rel=1e-6)
    assert summary(run)["final_val_loss"] == pytest.approx(summary(plain_fsdp)["final_val_loss"], rel=0.02)


HIDE_TORCHFT = "import sys; sys.modules['torchft'] = None\n"


@pytest.mark.parametrize(
    "args, line",
    [
        (["ft.replica_groups=3"], "ft.replica_groups=3 is not allowed: a divisor of the job's 2 ranks"),
        (["parallelism=pipeline"], "parallelism='pipeline' is not allowed: ddp, fsdp, hsdp, tensor or a mesh"),
        (["comm=topk"], "comm='topk' is not allowed: an option that all-reduces gradients"),
        (["ft.lighthouse=http://127.0.0.1:9"], "ft.lighthouse='http://127.0.0.1:9' is not allowed: a reachable"),
        ([], "ft='torchft' is not allowed: none, or install torchft first: pip install -e '.[ft]'"),
    ],
    ids=["groups", "layout", "comm", "lighthouse", "not-installed"],
)
def test_bad_ft_settings_are_refused_in_one_line(tmp_path, args, line):
    env = None
    if not args:  # torchft not importable
        (tmp_path / "sitecustomize.py").write_text(HIDE_TORCHFT)
        env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = run_train([*COMMON, *GROUPS, *args], tmp_path, env=env)
    assert result.returncode == 2, result.stderr
    assert line in result.stderr
    assert "Traceback" not in result.stderr
