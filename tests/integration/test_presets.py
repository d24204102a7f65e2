"""The fsdp, hsdp, tensor and pipeline options are presets of the one mesh layout (``parallelism=hybrid``): config
files that set its degrees, no classes of their own. A user adds a layout with one config file in their own config
directory, and it trains and validates like the built-in ones."""

import json

import pytest
from helpers import FAST, REPO, compose_config, run_train
from hydra.utils import instantiate
from omegaconf import OmegaConf

from distrain.checkpoint.preflight import pipeline_stages
from distrain.config.validate import ConfigError, validate
from distrain.parallelism.hybrid import _ComposedModel, _ComposedPipeline
from distrain.parallelism.layout import layout_of

DEGREES = ("replicate", "dp", "cp", "tp", "pp")


@pytest.mark.parametrize(
    "overrides, ranks, expected",
    [
        (["parallelism=fsdp"], 4, (1, 4, 1, 1, 1)),
        (["parallelism=tensor"], 4, (1, 1, 1, 4, 1)),
        (["parallelism=pipeline"], 4, (1, 1, 1, 1, 4)),
        (["parallelism=tensor", "parallelism.dp=2"], 4, (1, 2, 1, 2, 1)),  # a preset's other degrees compose
        (["parallelism=pipeline", "parallelism.dp=2"], 8, (1, 2, 1, 1, 4)),
        (["parallelism=fsdp", "parallelism.tp=2"], 8, (1, 4, 1, 2, 1)),
    ],
)
def test_the_presets_resolve_their_minus_one_to_the_rest_of_the_ranks(overrides, ranks, expected):
    degrees = layout_of(compose_config([*FAST, *overrides]).parallelism, ranks)
    assert tuple(getattr(degrees, axis) for axis in DEGREES) == expected


@pytest.mark.parametrize("preset", ["fsdp", "hsdp", "tensor", "pipeline"])
def test_every_preset_is_built_by_the_mesh_layout(preset):
    strategy = instantiate(compose_config([*FAST, f"parallelism={preset}"]).parallelism)
    expected = _ComposedPipeline if preset == "pipeline" else _ComposedModel
    assert type(strategy) is expected and strategy.name == preset


def test_two_free_degrees_are_refused_in_one_line():
    cfg = compose_config([*FAST, "parallelism=tensor", "parallelism.pp=-1"])
    with pytest.raises(ConfigError, match="parallelism.pp=-1 is not allowed: .*only one of dp, tp, pp may be -1"):
        validate(cfg)


def test_a_users_preset_is_one_config_file_in_their_own_config_dir(tmp_path):
    presets = tmp_path / "conf" / "parallelism"
    presets.mkdir(parents=True)
    (presets / "tp_pairs.yaml").write_text(
        "defaults:\n  - /schema/parallelism/hybrid@_here_\n  - _self_\n\nname: tp_pairs\ntp: 2\n"
    )
    common = [*FAST, "distributed.nproc_per_node=2", "trainer.max_steps=3", "trainer.log_every=1"]
    runs = {}
    for name, args in (
        ("tp_pairs", ["--config-dir", str(tmp_path / "conf"), "parallelism=tp_pairs"]),
        ("tensor", ["parallelism=tensor"]),
    ):
        done = run_train([*args, *common, f"hydra.run.dir={tmp_path / name}"], cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
        records = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        runs[name] = ([json.loads(line)["loss"] for line in records if '"loss"' in line], summary)
    (mine, my_summary), (tensor, _) = runs["tp_pairs"], runs["tensor"]
    assert my_summary["parallelism"] == "tp_pairs" and my_summary["data_parallel"] == 1
    assert len(mine) == 3 and max(abs(a - b) for a, b in zip(mine, tensor, strict=True)) < 1e-6
    # Validated as a mesh layout: tp=2 on 3 ranks is named in one line before any rank starts.
    bad = run_train(
        ["--config-dir", str(tmp_path / "conf"), "parallelism=tp_pairs", *FAST, "distributed.nproc_per_node=3"],
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "world size 3" in bad.stderr.strip().splitlines()[-1], bad.stderr[-1000:]


@pytest.mark.parametrize(
    "overrides, ranks, key",
    [
        (["parallelism=pipeline", "parallelism.tp=2"], 3, "parallelism.tp=2"),
        (["parallelism=tensor", "parallelism.tp=3"], 4, "parallelism.tp=3"),
        (["parallelism=fsdp", "parallelism.pp=3"], 2, "parallelism.pp=3"),
        (["parallelism=hsdp", "parallelism.dp_replicate=2", "parallelism.dp=2"], 2, "parallelism.dp=2"),
        (["parallelism=tensor", "precision=fp16"], 2, "precision='fp16'"),
        (["parallelism=tensor", "parallelism.cpu_offload=true"], 2, "parallelism.cpu_offload=true"),
    ],
)
def test_a_presets_bad_setting_names_the_key_the_user_set(overrides, ranks, key):
    with pytest.raises(ConfigError) as refused:
        validate(compose_config([*FAST, *overrides, f"distributed.nproc_per_node={ranks}"]))
    assert str(refused.value).startswith(f"{key} is not allowed"), str(refused.value)


@pytest.mark.parametrize(
    "parallelism, ranks, stages",
    [
        (["parallelism=pipeline"], 4, (4, 1, ())),
        (["parallelism=pipeline", "parallelism.dp=2"], 4, (2, 1, ())),  # same name, other stages
        (["parallelism=hybrid", "parallelism.pp=2"], 4, (2, 1, ())),  # other name, the same stages
        (["parallelism=pipeline", "parallelism.schedule=interleaved"], 2, (2, 2, ())),
        (["parallelism=fsdp"], 4, None),
    ],
)
def test_a_pipeline_checkpoint_is_matched_by_its_resolved_stages(parallelism, ranks, stages):
    assert pipeline_stages(compose_config([*FAST, *parallelism]).parallelism, ranks) == stages


def test_a_pipeline_checkpoint_from_before_the_presets_spans_every_rank():
    old = {"_target_": "distrain.parallelism.pipeline.PipelineStrategy", "name": "pipeline"}  # its saved config
    saved = OmegaConf.create({**old, "schedule": "1f1b", "microbatches": 4, "split_points": []})
    assert pipeline_stages(saved, 2) == (2, 1, ())


def test_old_key_names_still_work_and_name_the_new_key_in_one_line(tmp_path):
    common = [*FAST, "distributed.nproc_per_node=2", "trainer.max_steps=2", "data.micro_batch_size=2"]
    args = [*common, "parallelism=pipeline", "parallelism.microbatches=2", f"hydra.run.dir={tmp_path / 'old'}"]
    done = run_train(args, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    notes = [line for line in (done.stdout + done.stderr).splitlines() if "is now parallelism." in line]
    assert len(notes) == 1 and "parallelism.microbatches is now parallelism.pipeline_microbatches" in notes[0], notes
    cfg = compose_config([*FAST, "parallelism=fsdp", "parallelism.stage=2", "parallelism.microbatches=8"])
    validate(cfg)
    assert (cfg.parallelism.fsdp_stage, cfg.parallelism.pipeline_microbatches) == (2, 8)
    # A strategy built straight from the config (a notebook, no validation) reads the old names too.
    old = instantiate(compose_config([*FAST, "parallelism=pipeline", "parallelism.microbatches=2"]).parallelism)
    assert old.microbatches == 2


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallelism=fsdp", "parallelism.fsdp_stage=3", "parallelism.stage=2"],
        ["parallelism=pipeline", "parallelism.pipeline_microbatches=8", "parallelism.microbatches=2"],
    ],
)
def test_an_old_key_that_contradicts_its_new_name_is_refused(overrides):
    old = overrides[-1].split("=")[0]
    with pytest.raises(ConfigError, match=f"{old}=2 is not allowed: unset: .* is set too"):
        validate(compose_config([*FAST, *overrides]))
