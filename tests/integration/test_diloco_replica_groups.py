"""comm=diloco across ft=torchft replica groups, through train.py: the groups are DiLoCo's workers, which average
their pseudo-gradients through torchft's Manager only at outer steps; a group killed by SIGKILL between outer steps
is restarted and heals (model, inner optimizer, outer model and momentum) from the live group at the next one; a
stop signal stops both groups at an outer step."""

import signal

import pytest
from helpers import FAST, run_train
from replica_groups_helpers import killer, losses, reached, records, reference_run, run_until, summary

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

STEPS, SYNC = 30, 5
# Outer steps that average the workers' models (local SGD: outer lr 1, no momentum). The paper's Nesterov momentum
# makes 30 steps of this tiny model chaotic (the uninterrupted run's grad norm jumps to 40), so a run whose outage
# changed a few pseudo-gradients could end anywhere; averaging keeps the comparisons below meaningful.
STABLE_OUTER = ["comm.outer_lr=1.0", "comm.outer_momentum=0.0", "comm.nesterov=false"]
# One thread per rank in both jobs: a group of one rank would otherwise take the threads of two ranks, and the
# matmuls' different summation order would part the runs in the last digits (which DiLoCo's outer momentum grows).
COMMON = [
    *FAST, f"trainer.max_steps={STEPS}", "trainer.eval_every=0", "distributed.nproc_per_node=2",
    "distributed.threads_per_rank=1", "comm=diloco", f"comm.sync_every={SYNC}", *STABLE_OUTER,
]  # fmt: skip
GROUPS = ["ft=torchft", "ft.replica_groups=2"]


@pytest.fixture(scope="module")
def plain_diloco(tmp_path_factory):
    """DiLoCo over the two ranks of one job: each rank a worker."""
    return reference_run(tmp_path_factory, "diloco", COMMON)


def sent(run_dir):
    return {r["step"]: r["grad_bytes_sent"] for r in records(run_dir) if "grad_bytes_sent" in r}


def test_replica_groups_are_diloco_workers_as_the_ranks_of_one_job_are(tmp_path, plain_diloco):
    result = run_train([*COMMON, *GROUPS, "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    # Each group logs its own inner loss; their mean is the plain job's (which averages its ranks').
    reference, first, second = losses(plain_diloco), losses(run), losses(run / "replica_group_1")
    assert first.keys() == reference.keys() == second.keys()
    for step, loss in reference.items():
        assert (first[step] + second[step]) / 2 == pytest.approx(loss, rel=1e-5), step
    for group_dir in (run, run / "replica_group_1"):  # the outer model, evaluated by each group
        assert summary(group_dir)["final_val_loss"] == pytest.approx(summary(plain_diloco)["final_val_loss"], rel=1e-6)
    # The groups talk only at outer steps, sending what the plain job's ranks send there.
    outer_steps = set(range(SYNC, STEPS + 1, SYNC))
    assert {step for step, count in sent(run).items() if count > 0} == outer_steps
    for step in outer_steps:
        assert sent(run)[step] == pytest.approx(sent(plain_diloco)[step], rel=1e-6)


def test_a_group_killed_between_outer_steps_heals_at_the_next_one(tmp_path, plain_diloco):
    """The restarted group first resumes the checkpoint of the last outer step, whose commit count equals the live
    group's; it must still take group 0's state at the next outer step rather than train on from its own."""
    run, killed = tmp_path / "run", []
    saving = ["checkpoint=default", f"checkpoint.every_n_steps={SYNC}", "checkpoint.keep_last=0"]
    result = run_until(
        tmp_path, [*COMMON, *GROUPS, *saving, "hydra.run.dir=run"],
        reached(run / "replica_group_1" / "metrics.jsonl", SYNC + 2),
        killer(1, killed),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert killed == [1]
    assert [r["step"] for r in records(run)] == list(range(1, STEPS + 1))  # group 0 never stopped nor repeated
    log = (run / "replica_group_1" / "train.log").read_text()
    assert "resumed from" in log and "joined at step" in log  # its checkpoint first, then group 0's newer state
    joined_at = int(log.split("joined at step ")[1].split()[0])
    assert joined_at % SYNC == SYNC - 1  # it took group 0's state at the start of an outer step's inner step
    assert records(run / "replica_group_1")[-1]["step"] == STEPS
    # Both groups end on the same outer model: the healed group took the outer model and momentum too.
    healed_val = summary(run / "replica_group_1")["final_val_loss"]
    assert healed_val == pytest.approx(summary(run)["final_val_loss"], rel=1e-6)
    # The cycles group 1 missed averaged one worker's pseudo-gradient: close to the uninterrupted run, not equal.
    assert summary(run)["final_val_loss"] == pytest.approx(summary(plain_diloco)["final_val_loss"], rel=0.03)


def test_a_stop_signal_stops_both_groups_at_an_outer_step_and_the_job_resumes(tmp_path, plain_diloco):
    run = tmp_path / "run"
    args = [*COMMON, *GROUPS, "checkpoint=default", "checkpoint.every_n_steps=0", "hydra.run.dir=run"]
    stopped = run_until(tmp_path, args, reached(run / "metrics.jsonl", 7), lambda p: p.send_signal(signal.SIGTERM))
    assert stopped.returncode == 143, stopped.stderr
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert len(saved) == 1
    step = int(saved[0].split("_")[1])
    assert step % SYNC == 0  # the stop rode in an outer step's all-reduce: both groups stopped after it
    assert records(run)[-1]["step"] == records(run / "replica_group_1")[-1]["step"] == step
    resumed = run_train([*args, "checkpoint.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert records(run)[-1]["step"] == STEPS and "resumed from" in (run / "train.log").read_text()
    assert summary(run)["final_val_loss"] == pytest.approx(summary(plain_diloco)["final_val_loss"], rel=0.02)


@pytest.mark.parametrize(
    "args, line",
    [
        (["comm.compression=topk"], "comm.compression='topk' is not allowed: none or powersgd with ft=torchft"),
        (
            ["ft.replica_groups=3", "distributed.nproc_per_node=6"],
            "ft.replica_groups=3 is not allowed: 2 with comm=diloco and groups of several ranks",
        ),
    ],
    ids=["topk", "three-groups-of-two"],
)
def test_what_diloco_across_groups_cannot_do_is_refused_in_one_line(tmp_path, args, line):
    result = run_train([*COMMON, *GROUPS, *args], tmp_path)
    assert result.returncode == 2, result.stderr
    assert line in result.stderr
    assert "Traceback" not in result.stderr
