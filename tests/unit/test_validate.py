"""Invalid values are refused before any rank starts: in-process (the message) and through train.py (the exit)."""

import pytest
import torch
from helpers import FAST, compose_config
from hydra.utils import instantiate

from distrain.config.validate import ConfigError, validate
from distrain.planning.dry_run import plan
from distrain.precision.policy import autocast_supported

BAD_INPUTS = [
    # (override, key named in the message, what the message must say is allowed)
    ("distributed.nproc_per_node=0", "distributed.nproc_per_node", ">= 1"),
    ("distributed.nproc_per_node=-2", "distributed.nproc_per_node", ">= 1"),
    ("data.micro_batch_size=0", "data.micro_batch_size", ">= 1"),
    ("optimizer.lr=-0.001", "optimizer.lr", "> 0"),
    ("trainer.grad_accum_steps=0", "trainer.grad_accum_steps", ">= 1"),
    ("trainer.max_steps=0", "trainer.max_steps", ">= 1"),
    ("distributed.device=cuda", "distributed.device", "no CUDA device"),
    ("distributed.backend=nccl", "distributed.backend", "nccl needs CUDA"),
    ("model.n_heads=3", "model.n_heads", "divisor of model.d_model"),
    ("data.seq_len=4096", "data.seq_len", "model.max_seq_len"),
    ("optimizer=sgd optimizer.momentum=1.5", "optimizer.momentum", "[0, 1)"),
    ("stage=3", "stage", "takes no stage"),
    ("parallelism=zero stage=4", "stage", "takes stage 1 or 2 or 3"),
    ("parallelism=zero parallelism.stage=0", "parallelism.stage", "takes stage 1 or 2 or 3"),
    ("parallelism=fsdp stage=1", "stage", "takes stage 2 or 3"),
    ("parallelism=fsdp parallelism.cpu_offload=true", "parallelism.cpu_offload", "on cpu they are there"),
    ("parallelism=zero parallelism.offload_optimizer=cpu", "parallelism.offload_optimizer", "none on cpu"),
    ("parallelism=zero stage=2 parallelism.offload_param=cpu", "parallelism.offload_param", "none on cpu"),
    ("parallelism=zero precision=fp16", "precision", "no fp16 there"),
    ("parallelism=zero trainer.on_nonfinite=skip", "trainer.on_nonfinite", "it applies every step"),
    ("parallelism=single stage=2", "stage", "parallelism=zero (1/2/3), parallelism=fsdp (2/3)"),
    ("parallelism=single distributed.nproc_per_node=2", "distributed.nproc_per_node", "parallelism=single"),
    ("parallelism=zero checkpoint.async_save=true", "checkpoint.async_save", "its saves are synchronous"),
    ("checkpoint.emergency_timeout_s=0", "checkpoint.emergency_timeout_s", "> 0"),
    ("comm=topk comm.density=0", "comm.density", "(0, 1]"),
    ("comm=topk comm.density=1.5", "comm.density", "(0, 1]"),
    (
        "comm=topk comm.warmup_steps=5 comm.warmup_start_density=0.001",
        "comm.warmup_start_density",
        "[comm.density (0.01), 1]",
    ),
    ("comm=topk comm.momentum=0.9", "comm.momentum", "optimizer=sgd optimizer.momentum=0"),
    ("comm=topk precision=fp16", "comm.feedback", "residual under precision=fp16"),
    (
        "comm=topk comm.momentum=0.9 optimizer=sgd optimizer.momentum=0",  # momentum correction is residual-only
        "comm.momentum",
        "0 unless comm.feedback=residual",
    ),
    ("parallelism=fsdp comm=topk", "comm", "combines only with parallelism=ddp"),
    ("parallelism=zero comm=powersgd", "comm", "combines only with parallelism=ddp"),
    ("parallelism=pipeline comm=bf16", "comm", "comm=default with parallelism=pipeline"),
    ("comm=powersgd comm.start_iter=1", "comm.start_iter", ">= 2"),
    ("comm=powersgd comm.rank=0", "comm.rank", ">= 1"),
    ("parallelism=hybrid parallelism.dp=2 parallelism.tp=2", "parallelism.dp", "product is the world size 2"),
    ("parallelism=hybrid parallelism.tp=3", "parallelism.tp", "dp_replicate x cp x tp x pp = 3 does not divide"),
    ("parallelism=hybrid parallelism.tp=2 precision=fp16", "precision", "fp32 or bf16 with parallelism=hybrid"),
    ("activation_checkpointing=selective activation_checkpointing_every=0", "activation_checkpointing_every", ">= 1"),
    ("comm=hierarchical comm.ranks_per_node=3", "comm.ranks_per_node", "divisor of the world size (2)"),
    ("compile=true compile_backend=turbo", "compile_backend", "inductor, openxla, tvm, aot_eager, eager"),
    ("data.global_batch_size=0", "data.global_batch_size", ">= 1"),
    ("data.global_batch_size=12", "data.global_batch_size", "data.micro_batch_size x the data-parallel degree = 4 x 2"),
    ("data.global_batch_size=16 trainer.grad_accum_steps=3", "trainer.grad_accum_steps", "2, derived from data"),
]


@pytest.mark.parametrize("override,key,allowed", BAD_INPUTS)
def test_bad_value_names_key_value_and_what_is_allowed(override, key, allowed):
    cfg = compose_config([*FAST, *override.split()])
    if "cuda" in override:
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("a GPU is present")
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == key
    assert allowed in str(err.value)
    assert f"{key}=" in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (["comm=topk", "comm.feedback=residual"], True),  # classic error feedback under AdamW
        (["comm=topk"], False),
        (["comm=topk", "comm.feedback=residual", "optimizer=sgd"], False),
    ],
)
def test_topk_feedback_unsound_for_the_optimizer_is_warned_in_one_line(caplog, overrides, warned):
    validate(compose_config([*FAST, *overrides]))
    lines = [r.getMessage() for r in caplog.records if "comm.feedback=residual with" in r.getMessage()]
    assert len(lines) == int(warned)
    assert all("\n" not in line and "sound for SGD" in line for line in lines)


def test_zero_checkpoint_from_another_world_size_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text('{"step": 4, "world_size": 4, "files": {}}')
    cfg = compose_config([*FAST, "parallelism=zero", f"checkpoint.resume={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == "checkpoint.resume" and "saved by 4" in str(err.value)
    validate(compose_config([*FAST, "parallelism=fsdp", f"checkpoint.resume={tmp_path}"]))  # fsdp reshards


def test_autocast_probe_reports_unsupported_combinations():
    assert autocast_supported("cpu", "float32") == (True, "")
    assert autocast_supported("cpu", "bfloat16")[0]
    ok, reason = autocast_supported("cpu", "float16")
    assert ok or reason  # a refusal always carries its reason


# What only this machine decides (no GPU here): a dry run plans for a target, which may have GPUs.
MACHINE_SPECIFIC = {"distributed.device=cuda", "distributed.backend=nccl"}


@pytest.mark.parametrize("override,key,allowed", [b for b in BAD_INPUTS if b[0] not in MACHINE_SPECIFIC])
def test_dry_run_refuses_it_with_the_same_message(override, key, allowed):
    cfg = compose_config([*FAST, *override.split(), "dry_run=true"])
    with pytest.raises(ConfigError) as real:
        validate(cfg)
    with pytest.raises(ConfigError) as dry:
        plan(cfg)
    assert str(dry.value) == str(real.value)


TARGET_64 = ["target.nodes=8", "target.ranks_per_node=8", "target.device=cuda", "model=gpt_small"]
LAUNCHED_AS_RANK_OF_64 = {"RANK": "0", "WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "localhost"}


@pytest.mark.parametrize(
    "overrides",
    [
        "parallelism=hybrid parallelism.tp=3",  # 64 is not divisible by 3
        "parallelism=hybrid parallelism.dp=4 parallelism.tp=2 parallelism.pp=2",  # 16, not 64
        "parallelism=tensor",  # 64 tensor-parallel ranks for 6 heads
        "parallelism=pipeline",  # 64 stages for 6 layers
        "comm=hierarchical comm.ranks_per_node=5",
    ],
)
def test_dry_run_for_64_ranks_refuses_what_a_64_rank_launch_refuses(monkeypatch, overrides):
    cfg = compose_config([*FAST[:1], *overrides.split(), *TARGET_64, "distributed.device=cpu"])
    with pytest.raises(ConfigError) as dry:
        plan(cfg)
    for name, value in LAUNCHED_AS_RANK_OF_64.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as real:
        validate(cfg)
    assert str(dry.value) == str(real.value)


@pytest.mark.parametrize(
    "override,key,allowed",
    [
        ("target.nodes=0", "target.nodes", ">= 1"),
        ("target.ranks_per_node=0", "target.ranks_per_node", ">= 1"),
        ("target.device_memory_gib=-1", "target.device_memory_gib", "> 0"),
    ],
)
def test_dry_run_refuses_a_bad_target(override, key, allowed):
    with pytest.raises(ConfigError) as err:
        plan(compose_config([*FAST, "dry_run=true", override]))
    assert err.value.key == key and allowed in str(err.value) and f"{key}=" in str(err.value)


def test_dry_run_of_single_on_many_ranks_names_the_target_key():
    with pytest.raises(ConfigError) as err:
        plan(compose_config([*FAST[:1], "parallelism=single", *TARGET_64]))
    assert err.value.key == "target.nodes" and "parallelism=single runs one rank" in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        "parallelism=ddp",
        "parallelism=zero parallelism.stage=3",
        "parallelism=fsdp",
        "parallelism=hybrid parallelism.tp=2 parallelism.pp=2",
        "parallelism=hybrid parallelism.tp=2 parallelism.pp=2 parallelism.schedule=interleaved",
        "parallelism=hybrid parallelism.tp=2 parallelism.dp_mode=replicate parallelism.sequence_parallel=true",
    ],
)
def test_dry_run_accepts_valid_64_rank_jobs(overrides):
    cfg = compose_config([*FAST[:1], *overrides.split(), *TARGET_64])
    report = plan(cfg)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in instantiate(cfg.model).parameters())
    assert report.target.world_size == 64 and report.model_parameters == parameters and report.fits
    assert all(0 < row.model_state < report.target.device_memory_bytes for row in report.ranks)


def test_a_refusal_shows_values_as_they_are_typed_on_the_command_line():
    """``true``/``false``/``null`` as in an override, not Python's ``True``/``None``; strings stay quoted."""
    assert str(ConfigError("optimizer.nesterov", False, "true")) == "optimizer.nesterov=false is not allowed: true"
    assert str(ConfigError("target.nodes", None, "a count")) == "target.nodes=null is not allowed: a count"
    assert str(ConfigError("comm", "topk", "default")) == "comm='topk' is not allowed: default"
    assert str(ConfigError("trainer.max_steps", 0, "> 0")) == "trainer.max_steps=0 is not allowed: > 0"


@pytest.mark.parametrize(
    "overrides, world, per_node, suggested",
    [
        ([], 4, 4, "parallelism.dp=2"),
        ([], 8, 8, "parallelism.dp=4"),
        (["parallelism.tp=2"], 8, 8, "parallelism.dp=2"),  # 2 copies x dp 2 x tp 2 = 8 ranks
        ([], 8, 4, None),  # two nodes: a copy per node, as asked
        (["parallelism.dp_replicate=2", "parallelism.dp=2"], 4, 4, None),  # replication chosen
        ([], 2, 2, None),  # two copies of one unsharded rank each is DDP, not what hsdp is for
        (["parallelism.tp=2"], 4, 4, None),
    ],
)
def test_hsdp_on_one_node_says_it_is_fsdp_and_how_to_get_two_copies(overrides, world, per_node, suggested):
    from distrain.parallelism.checks import single_copy_note

    note = single_copy_note(compose_config(["parallelism=hsdp", *overrides]), world, per_node)
    if suggested is None:
        assert note is None, note
    else:
        assert note is not None and f"parallelism.dp_replicate=2 {suggested} makes two copies" in note, note


@pytest.mark.parametrize(
    "mode, checkpoint_dir, expected",
    [
        ("RUN", None, "hydra.run.dir={run}"),  # one run directory: one summary.json for the whole run
        ("RUN", "ckpts", "checkpoint.dir={ckpts} hydra.run.dir={run}"),
        ("MULTIRUN", None, "checkpoint.dir={run}/checkpoints"),  # hydra.run.dir does not apply to a sweep's jobs
    ],
)
def test_the_stop_hint_continues_the_run_where_it_was(tmp_path, monkeypatch, mode, checkpoint_dir, expected):
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from distrain.launch.entry import resume_override

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "run"
    cfg = OmegaConf.create({"checkpoint": {"dir": checkpoint_dir}})
    hydra_cfg = OmegaConf.create({"mode": getattr(RunMode, mode)})
    written = checkpoint_dir or str(run / "checkpoints")
    hint = resume_override(cfg, hydra_cfg, "outputs/run", written)
    assert hint == expected.format(run=run, ckpts=tmp_path / "ckpts")
