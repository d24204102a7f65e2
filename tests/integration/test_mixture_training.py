"""data=mix through train.py: docs/data.md's mixture recipe (and its document masking recipe) runs as written and
logs each source's realised share and validation loss; one rank with accumulation and two data-parallel ranks train
on the same global batches; a resume from a checkpoint continues with exactly the losses of the uninterrupted run."""

import numpy as np
import pytest
from helpers import REPO, run_readme_bash_block, run_train, write_token_dataset
from replica_groups_helpers import losses, records, summary

pytestmark = [pytest.mark.integration]


def test_the_docs_mixture_block_runs_as_written(tmp_path):
    done = run_readme_bash_block("# a mixture:", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run = tmp_path / "outputs" / "mix"
    final = summary(run)
    assert final["data/asyncio/fraction"] == pytest.approx(0.7, abs=0.01)
    assert final["data/email/fraction"] == pytest.approx(0.3, abs=0.01)
    for record in (r for r in records(run) if "loss" in r):  # every logged step, over the run so far
        assert record["data/asyncio/fraction"] == pytest.approx(0.7, abs=0.01), record["step"]
    per_source = 0.7 * final["val/asyncio/loss"] + 0.3 * final["val/email/loss"]
    assert final["final_val_loss"] == pytest.approx(per_source, rel=1e-9)
    assert final["val/asyncio/loss"] != final["val/email/loss"]  # two validation sets, not one
    evaluated = [r for r in records(run) if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [20, 40] and all("val/email/loss" in r for r in evaluated)
    # docs/data.md's masking block, on the datasets the mixture block prepared.
    done = run_readme_bash_block("# document masking:", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    masked = summary(tmp_path / "outputs" / "mix_masked")
    assert masked["data/asyncio/fraction"] == pytest.approx(0.7, abs=0.01)
    assert masked["final_val_loss"] == pytest.approx(
        0.7 * masked["val/asyncio/loss"] + 0.3 * masked["val/email/loss"], rel=1e-9
    )
    assert abs(masked["final_val_loss"] - final["final_val_loss"]) > 1e-3  # masked windows train another model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two byte-valued sources of different text (vocabulary 256, no tokenizer file)."""
    root = tmp_path_factory.mktemp("sources")
    paths = {}
    for name, file in (("code", REPO / "distrain" / "config" / "validate.py"), ("docs", REPO / "README.md")):
        ids = np.frombuffer(file.read_bytes() * 2, dtype=np.uint8)
        cut = len(ids) * 9 // 10
        paths[name] = write_token_dataset(root / name, {"train": [ids[:cut]], "val": [ids[cut:]]})
    return paths


def mixture_args(sources, *extra):
    weights = dict(zip(sources, (0.7, 0.3), strict=True))
    listed = ",".join(f"{name}:{{path:{path},weight:{weights[name]}}}" for name, path in sources.items())
    return ["data=mix", f"data.sources={{{listed}}}", "logger=none", "model.n_layers=1", "data.seq_len=64",
            "data.micro_batch_size=4", "data.global_batch_size=8", "trainer.log_every=1", *extra]  # fmt: skip


def test_one_rank_and_two_ranks_train_on_the_same_mixture_and_resume_exactly(sources, tmp_path):
    args = mixture_args(sources, "trainer.max_steps=12", "checkpoint.every_n_steps=6")
    one = run_train([*args, "distributed.nproc_per_node=1", "hydra.run.dir=one"], tmp_path)
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_train([*args, "distributed.nproc_per_node=2", "hydra.run.dir=two"], tmp_path)
    assert two.returncode == 0, two.stderr[-2000:]
    for step, loss in losses(tmp_path / "one").items():  # 2 accumulation steps on one rank, 2 ranks of one
        assert losses(tmp_path / "two")[step] == pytest.approx(loss, rel=1e-5), step
    checkpoint = tmp_path / "two" / "checkpoints" / "step_00000006"
    resumed = run_train([*args, "distributed.nproc_per_node=2", "hydra.run.dir=resumed",
                         f"checkpoint.resume={checkpoint}"], tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after, before = losses(tmp_path / "resumed"), losses(tmp_path / "two")
    assert sorted(after) == list(range(7, 13)) and all(after[step] == before[step] for step in after)
    assert summary(tmp_path / "resumed")["data/code/fraction"] == pytest.approx(0.7, abs=0.01)
    one_dataset = ["data=tokens", f"data.path={sources['code']}", "logger=none", "model.n_layers=1", "data.seq_len=64"]
    switched = run_train([*one_dataset, f"checkpoint.resume={checkpoint}", "hydra.run.dir=switched"], tmp_path)
    assert switched.returncode == 2 and switched.stderr.count("\n") == 1, switched.stderr
    assert "data='one dataset' is not allowed: data=mix as in the checkpoint" in switched.stderr
    renamed = mixture_args({"code": sources["code"], "prose": sources["docs"]}, f"checkpoint.resume={checkpoint}")
    refused = run_train([*renamed, "hydra.run.dir=renamed"], tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "data.sources='code, prose' is not allowed: the sources code, docs as in the checkpoint" in refused.stderr


def test_a_source_made_with_another_vocabulary_is_refused_before_any_rank_starts(sources, tmp_path):
    other = write_token_dataset(tmp_path / "other", {"train": [np.arange(3000) % 500], "val": [np.arange(500)]}, 512)
    args = mixture_args({"code": sources["code"], "other": other}, "trainer.max_steps=2")
    refused = run_train([*args, "hydra.run.dir=run"], tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert (
        "data.sources.other.path=" in refused.stderr and "ids of different tokenizers cannot be mixed" in refused.stderr
    )
