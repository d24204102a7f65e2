"""Every key of every config schema, and what refuses a wrong value of it, before any rank starts.

``KEYS`` is the table: for each key, either a wrong value and the words of the one-line refusal that names the
key, the value and what is allowed, or why no value of the key's type is wrong. Refusals come from three places:
Hydra's composition (types and enums: ``distrain.config.overrides.composition_error``),
``distrain.config.validate.validate``
(ranges, divisibility, lengths, combinations, the data against the model), and the dry-run planner (``target.*``).
A schema key missing from the table fails ``test_every_schema_key_has_an_entry``.
"""

import dataclasses

import pytest
from helpers import FAST, compose_config

from distrain.config.overrides import composition_error
from distrain.config.schema import SCHEMAS, Config
from distrain.config.validate import ConfigError, validate
from distrain.planning.dry_run import plan


def compose(*overrides):
    return ("compose", overrides)


def check(*overrides):
    return ("validate", overrides)


def planned(*overrides):
    return ("plan", overrides)


def free(reason):
    return ("free", reason), None


BOOL = free("a boolean: Hydra refuses anything that is not true or false")
# key: ((how, overrides), words the refusal must contain), or ((free, why no value is wrong), None)
KEYS = {
    "model.vocab_size": (check("model.vocab_size=200"), "largest token id (255)"),
    "model.max_seq_len": (check("model.max_seq_len=0"), ">= 1"),
    "model.d_model": (check("model.d_model=0"), ">= 1"),
    "model.n_layers": (check("model.n_layers=0"), ">= 1"),
    "model.n_heads": (check("model.n_heads=3"), "a divisor of model.d_model"),
    "model.mlp_ratio": (check("model.mlp_ratio=0"), ">= 1"),
    "model.dropout": (check("model.dropout=1.5"), "[0, 1)"),
    "model.hidden": (check("model=mlp", "model.hidden=0"), ">= 1"),
    "model.n_kv_heads": (check("model=llama_tiny", "model.n_kv_heads=3"), "a divisor of model.n_heads (4)"),
    "model.ffn_hidden": (check("model=llama_tiny", "model.ffn_hidden=0"), ">= 1"),
    "model.norm_eps": (check("model=llama_tiny", "model.norm_eps=0"), "> 0"),
    "model.rope_theta": (check("model=llama_tiny", "model.rope_theta=-1"), "> 0"),
    "model.init_std": (check("model=llama_tiny", "model.init_std=0"), "> 0"),
    "model.rope_scaling": (check("model=llama_tiny", "+model.rope_scaling.rope_type=yarn"), "llama3 scaling"),
    "model.tie_embeddings": BOOL,
    "model.name_or_path": (check("model=hf", "model.name_or_path=/no/such/hf/model"), "(no such directory)"),
    "model.attn_implementation": (
        check("model=hf", "model.name_or_path=/x", "model.attn_implementation=flash"),
        "sdpa",
    ),
    "model.random_init": BOOL,
    "model.bias": BOOL,
    "model.init_from": (check("model=llama_tiny", "model.init_from=/no/such/hf/model"), "(no such directory)"),
    "model.expert_hidden": (check("model=moe_tiny", "model.expert_hidden=0"), ">= 1"),
    "model.n_experts": (check("model=moe_tiny", "model.n_experts=0"), ">= 1"),
    "model.top_k": (check("model=moe_tiny", "model.top_k=9"), "1..model.n_experts (8)"),
    "model.load_balance_coef": (check("model=moe_tiny", "model.load_balance_coef=-1"), ">= 0"),
    "model.z_loss_coef": (check("model=moe_tiny", "model.z_loss_coef=-1"), ">= 0"),
    "data.micro_batch_size": (check("data.micro_batch_size=0"), ">= 1"),
    "data.global_batch_size": (check("data.global_batch_size=6"), "a multiple of data.micro_batch_size"),
    "data.seq_len": (check("data.seq_len=64"), "1..model.max_seq_len (32)"),
    "data.corpus.max_bytes": (check("data.corpus.max_bytes=0"), ">= 1"),
    "data.corpus.val_fraction": (check("data.corpus.val_fraction=0.9"), "(0, 0.5]"),
    "data.corpus.num_tokens": (check("data=synthetic", "data.corpus.num_tokens=0"), ">= 1"),
    "data.corpus.vocab_size": (check("data=synthetic", "data.corpus.vocab_size=1000"), "2..model.vocab_size (256)"),
    "data.corpus.seed": free("any integer seeds the synthetic tokens"),
    "data.path": (check("data=tokens", "data.path=/no/such/dataset"), "a readable dataset: /no/such/dataset: no such"),
    "data.corpus.path": free("an interpolation of data.path (checked there)"),
    "data.corpus.vocab_limit": free("an interpolation of model.vocab_size (checked there); <= 0 means none"),
    "data.sources": (check("data=mix", "data.sources={}"), "at least one source: name -> {path: DATASET_DIR"),
    "data.corpus.sources": free("an interpolation of data.sources (checked there)"),
    "data.verify_checksums": BOOL,
    "data.prefetch": BOOL,
    "data.document_masking": (check("data.document_masking=true"), "one stream without documents"),
    "parallelism.name": free("set by each option's file; names the strategy in summaries"),
    "parallelism.find_unused_parameters": BOOL,
    "parallelism.stage": (check("parallelism=fsdp", "parallelism.stage=1"), "takes stage 2 or 3 (its new name"),
    "parallelism.fsdp_stage": (check("parallelism=fsdp", "parallelism.fsdp_stage=1"), "takes stage 2 or 3"),
    "parallelism.cpu_offload": (check("parallelism=fsdp", "parallelism.cpu_offload=true"), "on cpu they are there"),
    "parallelism.overlap_comm": BOOL,
    "parallelism.contiguous_gradients": BOOL,
    "parallelism.reduce_bucket_size": (check("parallelism=zero", "parallelism.reduce_bucket_size=0"), "> 0"),
    "parallelism.allgather_bucket_size": (check("parallelism=zero", "parallelism.allgather_bucket_size=0"), "> 0"),
    "parallelism.offload_optimizer": (
        compose("parallelism=zero", "parallelism.offload_optimizer=disk"),
        "one of none, cpu",
    ),
    "parallelism.offload_param": (compose("parallelism=zero", "parallelism.offload_param=nvme"), "one of none, cpu"),
    "parallelism.stage3_prefetch_bucket_size": (
        check("parallelism=zero", "parallelism.stage3_prefetch_bucket_size=-1"),
        "> 0",
    ),
    "parallelism.stage3_param_persistence_threshold": (
        check("parallelism=zero", "parallelism.stage3_param_persistence_threshold=-1"),
        ">= 0",
    ),
    "parallelism.stage3_max_live_parameters": (
        check("parallelism=zero", "parallelism.stage3_max_live_parameters=0"),
        "> 0",
    ),
    "parallelism.schedule": (
        compose("parallelism=pipeline", "parallelism.schedule=zb"),
        "one of gpipe, 1f1b, interleaved",
    ),
    "parallelism.microbatches": (check("parallelism=pipeline", "parallelism.microbatches=0"), "its new name"),
    "parallelism.pipeline_microbatches": (
        check("parallelism=pipeline", "parallelism.pipeline_microbatches=3"),
        "a divisor of the 4",
    ),
    "parallelism.virtual_stages": (
        check("parallelism=pipeline", "parallelism.schedule=interleaved", "parallelism.virtual_stages=1"),
        ">= 2 with schedule=interleaved",
    ),
    "parallelism.split_points": (check("parallelism=pipeline", "parallelism.split_points=[5]"), "increasing"),
    "parallelism.activation_checkpointing": (
        check("parallelism=pipeline", "parallelism.recompute_stages=[0]", "parallelism.activation_checkpointing=[1]"),
        "recompute_stages is its new name",
    ),
    "parallelism.recompute_stages": (
        check("parallelism=pipeline", "parallelism.recompute_stages=[7]"),
        "stage indices in 0..1",
    ),
    "parallelism.sequence_parallel": (
        check("parallelism=tensor", "parallelism.sequence_parallel=true", "data.seq_len=31"),
        "a multiple of the 2 tensor-parallel ranks",
    ),
    "parallelism.loss_parallel": (
        check("parallelism=tensor", "parallelism.loss_parallel=true", "model.vocab_size=257"),
        "a multiple of the 2 tensor-parallel ranks",
    ),
    "parallelism.dp": (check("parallelism=hybrid", "parallelism.dp=3"), "product is the world size 2"),
    "parallelism.dp_replicate": (check("parallelism=hsdp", "parallelism.dp_replicate=0"), "an integer >= 1, or -1"),
    "parallelism.tp": (check("parallelism=hybrid", "parallelism.tp=0"), ">= 1"),
    "parallelism.pp": (check("parallelism=hybrid", "parallelism.pp=0"), ">= 1"),
    "parallelism.cp": (check("parallelism=hybrid", "model=llama_tiny", "parallelism.cp=0"), ">= 1"),
    "parallelism.ep": (check("parallelism=hybrid", "model=moe_tiny", "parallelism.ep=0"), ">= 1"),
    "parallelism.dp_mode": (compose("parallelism=hybrid", "parallelism.dp_mode=zero"), "one of fsdp, replicate"),
    "optimizer.lr": (check("optimizer.lr=0"), "> 0"),
    "optimizer.betas": (check("optimizer.betas=[0.9,1.5]"), "two numbers in [0, 1)"),
    "optimizer.eps": (check("optimizer.eps=0"), "> 0"),
    "optimizer.weight_decay": (check("optimizer.weight_decay=-0.1"), ">= 0"),
    "optimizer.momentum": (check("optimizer=sgd", "optimizer.momentum=1"), "[0, 1)"),
    "optimizer.nesterov": (check("optimizer=sgd", "optimizer.nesterov=true", "optimizer.momentum=0"), "needs momentum"),
    "optimizer.no_decay": free("rules: one naming no parameter is a warning line (tests/unit/test_optim.py)"),
    "optimizer.lr_multipliers": (check("optimizer.lr_multipliers.head=0"), "a factor > 0"),
    "optimizer.muon": (check("optimizer=muon", "optimizer.muon=[matrix,norm]"), "Muon updates matrices"),
    "optimizer.ns_steps": (check("optimizer=muon", "optimizer.ns_steps=0"), ">= 1"),
    "optimizer.bucket_mb": (check("optimizer=muon", "optimizer.bucket_mb=0"), "> 0"),
    "precision.name": free("set by each option's file; names the precision in summaries"),
    "precision.compute_dtype": (compose("precision.compute_dtype=float64"), "one of float32, bfloat16, float16"),
    "precision.grad_scaler": BOOL,
    "ft.name": free("set by each option's file; ft=none or ft=torchft selects it"),
    "ft.replica_groups": (check("ft=torchft", "ft.replica_groups=3"), "a divisor of the job's 2 ranks"),
    "ft.min_replicas": (check("ft=torchft", "ft.min_replicas=3"), "an integer in 1..ft.replica_groups (2)"),
    "ft.lighthouse": (check("ft=torchft", "ft.lighthouse=http://127.0.0.1:9"), "a reachable torchft lighthouse"),
    "ft.max_restarts": (check("ft=torchft", "ft.max_restarts=-1"), ">= 0"),
    "ft.timeout_s": (check("ft=torchft", "ft.timeout_s=0"), "> 0"),
    "ft.quorum_timeout_s": (check("ft=torchft", "ft.quorum_timeout_s=0"), "> 0"),
    "ft.join_timeout_ms": (check("ft=torchft", "ft.join_timeout_ms=0"), "> 0"),
    "ft.heartbeat_timeout_ms": (check("ft=torchft", "ft.heartbeat_timeout_ms=0"), "> 0"),
    "ft.quorum_tick_ms": (check("ft=torchft", "ft.quorum_tick_ms=0"), "> 0"),
    "comm.name": free("set by each option's file; the strategies check the option (comm=...) it names"),
    "comm.bucket_cap_mb": (check("comm.bucket_cap_mb=0"), "> 0"),
    "comm.gradient_as_bucket_view": BOOL,
    "comm.static_graph": BOOL,
    "comm.dtype": (compose("comm=bf16", "comm.dtype=float8"), "one of bfloat16, float16"),
    "comm.rank": (check("comm=powersgd", "comm.rank=0"), ">= 1"),
    "comm.start_iter": (check("comm=powersgd", "comm.start_iter=1"), ">= 2"),
    "comm.min_compression_rate": (check("comm=powersgd", "comm.min_compression_rate=0"), "> 0"),
    "comm.error_feedback": BOOL,
    "comm.warm_start": BOOL,
    "comm.density": (check("comm=topk", "comm.density=0"), "(0, 1]"),
    "comm.warmup_steps": (check("comm=topk", "comm.warmup_steps=-1"), ">= 0"),
    "comm.warmup_start_density": (
        check("comm=topk", "comm.warmup_steps=5", "comm.warmup_start_density=2"),
        "[comm.density (0.01), 1]",
    ),
    "comm.momentum": (check("comm=topk", "comm.momentum=0.9"), "optimizer=sgd optimizer.momentum=0"),
    "comm.sync_every": (check("comm=topk", "comm.sync_every=-1"), "an integer >= 0"),
    "comm.feedback": (compose("comm=topk", "comm.feedback=sparse"), "one of update, estimate, residual"),
    "comm.outer_lr": (check("comm=diloco", "comm.outer_lr=0"), "> 0"),
    "comm.outer_momentum": (check("comm=diloco", "comm.outer_momentum=1"), "[0, 1)"),
    "comm.nesterov": (check("comm=diloco", "comm.outer_momentum=0"), "Nesterov needs momentum"),
    "comm.fragments": (check("comm=diloco", "comm.sync_every=10", "comm.fragments=3"), "a divisor of comm.sync_every"),
    "comm.compression": (compose("comm=diloco", "comm.compression=gzip"), "one of none, topk, powersgd"),
    "comm.quality_every": (check("comm=bf16", "comm.quality_every=-1"), ">= 0"),
    "comm.quality_threshold": (check("comm=powersgd", "comm.quality_threshold=0"), "> 0"),
    "comm.ranks_per_node": (check("comm=hierarchical", "comm.ranks_per_node=3"), "a divisor of the world size"),
    "checkpoint.every_n_steps": (check("checkpoint.every_n_steps=-1"), ">= 0"),
    "checkpoint.keep_last": (check("checkpoint.keep_last=-1"), ">= 0"),
    "checkpoint.dir": (check("checkpoint.dir=/etc/hostname"), "is a file; a directory is written here"),
    "checkpoint.save_final": BOOL,
    "checkpoint.resume": (check("checkpoint.resume=/nonexistent/step_00000001"), "never, auto, or a valid step_*"),
    "checkpoint.async_save": (check("parallelism=zero", "checkpoint.async_save=true"), "saves are synchronous"),
    "checkpoint.emergency": BOOL,
    "checkpoint.emergency_timeout_s": (check("checkpoint.emergency_timeout_s=0"), "> 0"),
    "logger.jsonl.path": (check("logger=jsonl", "logger.jsonl.path=/tmp"), "is a directory; a file is written here"),
    "logger.wandb.project": free("any W&B project name"),
    "logger.wandb.entity": free("any W&B entity, or null"),
    "logger.wandb.group": free("any group name, or null"),
    "logger.wandb.tags": free("any list of strings"),
    "logger.wandb.name": free("any run name, or null"),
    "logger.wandb.mode": (compose("logger=wandb", "logger.wandb.mode=cloud"), "one of auto, online, offline, disabled"),
    "logger.tensorboard.dir": (check("logger=tensorboard", "logger.tensorboard.dir=/etc/hostname"), "is a file"),
    "logger.mlflow.tracking_uri": (check("logger=mlflow", "logger.mlflow.tracking_uri=s3://x"), "sqlite:///<path>"),
    "logger.mlflow.experiment_name": free("any experiment name"),
    "logger.mlflow.run_name": free("any run name, or null"),
    "logger.mlflow.tags": free("any mapping of tag names to strings"),
    "scheduler.warmup_steps": (check("scheduler.warmup_steps=-1"), ">= 0"),
    "scheduler.decay": (compose("scheduler.decay=exp"), "one of cosine, linear, constant, wsd"),
    "scheduler.decay_fraction": (
        check("scheduler.decay=wsd", "scheduler.decay_fraction=0.95"),
        "fits after the 20-step warm-up",
    ),
    "scheduler.decay_shape": (compose("scheduler.decay_shape=exp"), "one of linear, cosine, 1-sqrt"),
    "scheduler.min_lr_ratio": (check("scheduler.min_lr_ratio=2"), "[0, 1]"),
    "trainer.max_steps": (check("trainer.max_steps=0"), ">= 1"),
    "trainer.seed": free("any integer"),
    "trainer.grad_accum_steps": (check("trainer.grad_accum_steps=0"), ">= 1"),
    "trainer.grad_clip_norm": (check("trainer.grad_clip_norm=-1"), ">= 0"),
    "trainer.on_nonfinite": (compose("trainer.on_nonfinite=ignore"), "one of stop, skip"),
    "trainer.log_every": (check("trainer.log_every=0"), ">= 1"),
    "trainer.eval_every": (check("trainer.eval_every=-1"), ">= 0"),
    "trainer.eval_batches": (check("trainer.eval_batches=0"), ">= 1"),
    "trainer.progress_bar": BOOL,
    "trainer.overfit_batches": (check("trainer.overfit_batches=-1"), ">= 0"),
    "trainer.detect_anomaly": BOOL,
    "distributed.nproc_per_node": (check("distributed.nproc_per_node=0"), ">= 1"),
    "distributed.device": (compose("distributed.device=tpu"), "one of auto, cpu, cuda"),
    "distributed.backend": (compose("distributed.backend=mpi"), "one of gloo, nccl"),
    "distributed.timeout_s": (check("distributed.timeout_s=0"), "> 0"),
    "distributed.max_restarts": (check("distributed.max_restarts=-1"), ">= 0"),
    "distributed.max_requeues": (check("distributed.max_requeues=-1"), ">= 0"),
    "distributed.threads_per_rank": (check("distributed.threads_per_rank=0"), ">= 1"),
    "monitor.straggler_threshold": (check("monitor.straggler_threshold=0"), "> 0"),
    "monitor.peak_flops": (check("monitor.peak_flops=-1"), "> 0, or null"),
    "monitor.profile_start_step": (check("monitor.profile_start_step=-1"), ">= 0"),
    "monitor.profile_steps": (check("monitor.profile_steps=0"), ">= 1"),
    "profile": BOOL,
    "stage": (check("stage=3"), "takes no stage"),
    "activation_checkpointing": (compose("activation_checkpointing=some"), "one of none, full, selective"),
    "activation_checkpointing_every": (check("activation_checkpointing_every=0"), ">= 1"),
    "compile": BOOL,
    "compile_scope": (compose("compile_scope=layers"), "one of blocks, model"),
    "compile_backend": (check("compile=true", "compile_backend=turbo"), "inductor"),
    "dry_run": BOOL,
    "target.nodes": (planned("target.nodes=0"), ">= 1"),
    "target.ranks_per_node": (planned("target.ranks_per_node=0"), ">= 1"),
    "target.device": (compose("target.device=tpu"), "one of cpu, cuda"),
    "target.device_memory_gib": (planned("target.device_memory_gib=-1"), "> 0"),
}


# Refusals that no one key's range explains: a combination of options, or what Hydra cannot compose at all.
COMBINATIONS = [
    (
        compose("parallelism=warp"),
        "parallelism='warp' is not allowed: one of ddp, fsdp, hsdp, hybrid, pipeline, single",
    ),
    (compose("trainer.max_step=5"), "trainer.max_step=5 is not allowed: no such key"),
    (compose("+trainer.foo=1"), "trainer.foo=1 is not allowed: no such key in trainer (one of max_steps, seed"),
    (compose("trainer.max_steps=many"), "trainer.max_steps='many' is not allowed: an integer"),
    (compose("trainer.seed=null"), "trainer.seed=null is not allowed: an integer, not null"),
    (compose("comm.static_graph=maybe"), "comm.static_graph='maybe' is not allowed: true or false"),
    (compose("trainer.grad_clip_norm=false"), "trainer.grad_clip_norm=false is not allowed: a number"),
    (
        compose("parallelism.tp=2"),
        "parallelism.tp=2 is not allowed: no such key (one of name, find_unused_parameters); it is a key of "
        "parallelism=fsdp, hsdp, hybrid, pipeline, tensor",
    ),
    (check("parallelism=zero", "stage=4"), "stage=4 is not allowed: parallelism=zero takes stage 1 or 2 or 3"),
    (check("parallelism=zero", "parallelism.offload_param=cpu"), "parallelism.offload_param='cpu' is not allowed"),
    (check("comm=topk", "comm.density=2"), "comm.density=2.0 is not allowed: a fraction in (0, 1]"),
    (check("parallelism=fsdp", "comm=topk"), "comm='topk' is not allowed: comm=default with parallelism=fsdp"),
]


def schema_keys(cls, prefix=""):
    for entry in dataclasses.fields(cls):
        if entry.name.startswith("_"):
            continue
        default = entry.default_factory() if entry.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            yield from schema_keys(type(default), f"{prefix}{entry.name}.")
        else:
            yield prefix + entry.name


def every_schema_key():
    keys = {key for key in schema_keys(Config) if key.split(".")[0] not in SCHEMAS}
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():  # trackers sit under their name: logger.<name>.<key>
            keys |= {f"{group}.{key}" for key in schema_keys(schema, f"{name}." if group == "logger" else "")}
    return keys - {"scheduler", "precision", "checkpoint"}


def test_every_schema_key_has_an_entry():
    missing = sorted(every_schema_key() - KEYS.keys())
    assert not missing, f"schema keys without a check in KEYS: {missing}"
    assert not sorted(KEYS.keys() - every_schema_key()), "KEYS names keys no schema has"


CHECKED = sorted((key, how, allowed) for key, ((how, _), allowed) in KEYS.items() if how != "free")


@pytest.mark.parametrize("key,how,allowed", CHECKED)
def test_a_wrong_value_is_refused_naming_the_key_and_what_is_allowed(key, how, allowed):
    extra = KEYS[key][0][1]
    # The synthetic corpus has no max_bytes (FAST's stdlib setting).
    base = [
        o
        for o in FAST
        if not (extra[0] in ("data=synthetic", "data=tokens", "data=mix") and o.startswith("data.corpus."))
    ]
    base = [o for o in base if not ("model=hf" in extra and o.startswith("model."))]  # hf has none of their keys
    overrides = [*base, *extra]
    if how == "compose":
        problem = composition_error(overrides)
        assert problem is not None and problem.startswith(f"{key}=") and allowed in problem, problem
        return
    cfg = compose_config([*overrides, *(["dry_run=true"] if how == "plan" else [])])
    with pytest.raises(ConfigError) as refused:
        plan(cfg) if how == "plan" else validate(cfg)
    # A combination is refused naming the key whose value breaks it (e.g. data.seq_len with sequence_parallel).
    named = {key, *(o.split("=")[0] for o in extra)}
    if "." not in refused.value.key:  # a whole group option refused (model=..., precision=...)
        named.add(key.split(".")[0])
    assert refused.value.key in named and allowed in str(refused.value), str(refused.value)
    assert f"{refused.value.key}=" in str(refused.value)


@pytest.mark.parametrize("how,words", COMBINATIONS, ids=[" ".join(how[1]) for how, _ in COMBINATIONS])
def test_a_combination_or_an_uncomposable_override_is_refused_in_the_same_words(how, words):
    kind, overrides = how
    overrides = [*FAST, *overrides]
    if kind == "compose":
        problem = composition_error(overrides)
    else:
        with pytest.raises(ConfigError) as refused:
            validate(compose_config(overrides))
        problem = str(refused.value)
    assert problem is not None and words in problem, problem
