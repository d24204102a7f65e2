"""Checks of the parallelism options against the world size, the model and each other (comm: distrain.comm.checks).

Called by ``distrain.config.validate.validate`` once the world size is known (the job's, or a dry run's target).
"""

from __future__ import annotations

import importlib.util

from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from distrain.config.checks import ConfigError, at_least, check
from distrain.config.options import Placement
from distrain.models.meta import meta_device
from distrain.models.spec import WHOLE_MODEL, ConfigProblem, ModelSpec, spec_of
from distrain.parallelism.capabilities import capabilities_of
from distrain.parallelism.layout import Layout, layout_of

# The stages a sharding strategy takes (top-level `stage=`, or `parallelism.stage=` for ZeRO and
# `parallelism.fsdp_stage=` for FSDP on the dp axis of a mesh layout; named here as the options that shard by default).
ZERO_STAGES, FSDP_STAGES = (1, 2, 3), (2, 3)
STAGE_TAKERS = "parallelism=zero (1/2/3), parallelism=fsdp (2/3), parallelism=hsdp (2/3), parallelism=hybrid (2/3)"


def is_mesh_layout(cfg: DictConfig) -> bool:
    """Whether the parallelism option is ``hybrid`` or a preset of it (a config file with its target: ``fsdp``,
    ``hsdp``, ``tensor``, ``pipeline``, or one of the user's own)."""
    return capabilities_of(cfg.parallelism).device_mesh


RENAMED = {
    "stage": "fsdp_stage",
    "microbatches": "pipeline_microbatches",
    "activation_checkpointing": "recompute_stages",  # its root namesake is a mode; this one lists stages
}  # a mesh layout's old keys: new keys
NEW_KEY_DEFAULTS = {"pipeline_microbatches": 4, "recompute_stages": []}


def adopt_renamed_keys(cfg: DictConfig) -> list[str]:
    """Move a mesh layout's values set under an old key name onto the new key (in place); one line for each, naming
    both. An old key whose value no new key could take, or that contradicts a value set under the new key, is
    refused as the old key."""
    notes = []
    if not is_mesh_layout(cfg):
        return notes
    for old, new in RENAMED.items():
        value = cfg.parallelism.get(old)
        if value is None:
            continue
        # The new key's own value counts as set when it is not the schema's default (for fsdp_stage: ${stage_or:3}).
        new_set = not OmegaConf.is_interpolation(cfg.parallelism, new) if new == "fsdp_stage" else None
        if new_set is None:
            new_set = cfg.parallelism[new] != NEW_KEY_DEFAULTS[new]
        if new_set and cfg.parallelism[new] != value:
            allowed = f"unset: parallelism.{new}={cfg.parallelism[new]} is set too, and {new} is its new name"
            raise ConfigError(f"parallelism.{old}", value, allowed)
        if old == "stage" and value not in FSDP_STAGES:
            allowed = f"parallelism={cfg.parallelism.name} takes stage 2 or 3 (its new name: parallelism.{new})"
            raise ConfigError("parallelism.stage", value, allowed)
        if old == "microbatches" and value < 1:
            allowed = f"an integer >= 1 (its new name: parallelism.{new})"
            raise ConfigError("parallelism.microbatches", value, allowed)
        cfg.parallelism[new], cfg.parallelism[old] = value, None
        notes.append(f"parallelism.{old} is now parallelism.{new}: using parallelism.{new}={value}")
    return notes


def sharding_stages(cfg: DictConfig) -> tuple[int, ...]:
    """The stages the parallelism option takes: none unless it shards (ZeRO, or a mesh layout whose dp axis is not
    fixed at 1)."""
    if stages := capabilities_of(cfg.parallelism).zero_stages:
        return stages
    if is_mesh_layout(cfg) and cfg.parallelism.dp != 1:
        return FSDP_STAGES
    return ()


def model_name(cfg: DictConfig) -> str:
    return str(cfg.model.get("_target_", "?")).rsplit(".", 1)[-1]


def root_cause(err: BaseException) -> BaseException:
    """The innermost cause of ``err`` (Hydra wraps a constructor's or an import's error, which names the problem)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def spec_for_config(cfg: DictConfig) -> ModelSpec:
    """The spec of the configured model's class (its ``parallel_spec``), found without building the model."""
    target = cfg.model.get("_target_")
    try:
        built = get_object(target)
    except Exception as err:
        cause = root_cause(err)
        raise ConfigError("model._target_", target, f"an importable class ({type(cause).__name__}: {cause})") from None
    spec = getattr(built, "parallel_spec", None)
    return spec if isinstance(spec, ModelSpec) else WHOLE_MODEL


def meta_model(cfg: DictConfig, strict: bool = True) -> tuple[nn.Module, ModelSpec] | None:
    """The configured model built on the meta device (shapes, no storage) and its spec: what is asked about the
    model before any rank starts. A model its config cannot build is a config error naming the constructor's
    complaint. Not ``strict``: only the constructor's refusals of its arguments (TypeError, ValueError) are errors;
    a model that cannot be built on the meta device (it reads a tensor's value) is then not inspected (None)."""
    try:
        with meta_device():
            model = instantiate(cfg.model)
        return model, spec_of(model)
    except Exception as err:
        cause = root_cause(err)
        if not strict and not isinstance(cause, TypeError | ValueError):
            return None
        detail = (str(cause).strip().splitlines() or [""])[0]
        raise ConfigError(
            "model", model_name(cfg), f"a model its config builds ({type(cause).__name__}: {detail})"
        ) from None


def raise_problem(cfg: DictConfig, problem: ConfigProblem | str | None, strategy: str) -> None:
    """A spec's answer as a config error: its own key and value, or the model's name with the reason."""
    if isinstance(problem, ConfigProblem):
        raise ConfigError(problem.key, problem.value, problem.allowed)
    if problem:
        raise ConfigError("model", model_name(cfg), f"a model {strategy} can split: {problem}")


def validate_sharding(cfg: DictConfig) -> None:
    """The sharding stage: one the strategy takes (ZeRO's, or FSDP's on a mesh layout that shards over dp), and
    none given to one that does not shard."""
    strategy, stages = cfg.parallelism.name, sharding_stages(cfg)
    if not stages:
        if cfg.stage is not None:
            allowed = f"parallelism={strategy} takes no stage; stages apply to {STAGE_TAKERS}"
            raise ConfigError("stage", cfg.stage, allowed)
        return
    own_key = "fsdp_stage" if is_mesh_layout(cfg) else "stage"
    stage = cfg.parallelism[own_key]
    key = "stage" if cfg.stage is not None else f"parallelism.{own_key}"
    if stage not in stages:
        raise ConfigError(key, stage, f"parallelism={strategy} takes stage {' or '.join(map(str, stages))}")


def check_zero(cfg: DictConfig, placement: Placement) -> list[str]:
    """``parallelism=zero``'s own checks (``ZeroStrategy.check_config``): DeepSpeed installed, offload only from a
    GPU (and parameters only at stage 3), no fp16 on cpu, positive bucket sizes."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("parallelism", cfg.parallelism.name, "DeepSpeed is not installed (pip install deepspeed)")
    for option in ("offload_optimizer", "offload_param"):
        if cfg.parallelism[option] != "none" and placement.device_type != "cuda":
            raise ConfigError(
                f"parallelism.{option}", cfg.parallelism[option], "none on cpu (offload moves GPU state to CPU)"
            )
    if cfg.parallelism.offload_param != "none" and cfg.parallelism.stage != 3:
        raise ConfigError("parallelism.offload_param", cfg.parallelism.offload_param, "none below stage 3")
    if placement.device_type == "cpu" and cfg.precision.compute_dtype == "float16":
        raise ConfigError("precision", cfg.precision.name, "fp32 or bf16 with DeepSpeed on cpu (no fp16 there)")
    sizes = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")
    for size in (*sizes, "stage3_max_live_parameters"):
        allowed = "a number of elements > 0 (or null: sized to the model)"
        check(cfg, f"parallelism.{size}", lambda v: v is None or v > 0, allowed)
    check(cfg, "parallelism.stage3_param_persistence_threshold", at_least(0), "a number of elements >= 0")
    return []


def check_mesh(cfg: DictConfig, placement: Placement) -> list[str]:
    """The mesh layout's own checks (``HybridStrategy.check_config``): offload, the degrees against the world size,
    each axis's rules; the note that an hsdp job on one node holds one copy (not on a dry run's target)."""
    if cfg.parallelism.cpu_offload:
        if placement.device_type != "cuda":
            allowed = "false on cpu: offload moves shards from GPU to CPU memory; on cpu they are there"
            raise ConfigError("parallelism.cpu_offload", True, allowed)
        if cfg.parallelism.dp_mode != "fsdp":
            raise ConfigError("parallelism.cpu_offload", True, "false with dp_mode=replicate (it offloads FSDP shards)")
    validate_hybrid(cfg, placement.world_size, ranks_per_node=placement.ranks_per_node)
    note = None if placement.planning else single_copy_note(cfg, placement.world_size, placement.ranks_per_node)
    return [note] if note else []


def validate_pipeline(cfg: DictConfig, world_size: int) -> None:
    """Schedule, stage count against blocks, micro-batch divisibility and split points; ``world_size``: the ranks
    of one pipeline."""
    pp = cfg.parallelism
    check(cfg, "parallelism.pipeline_microbatches", at_least(1), "an integer >= 1")
    virtual = pp.virtual_stages if pp.schedule == "interleaved" else 1
    if pp.schedule == "interleaved":
        check(cfg, "parallelism.virtual_stages", at_least(2), "an integer >= 2 with schedule=interleaved")
        if pp.pipeline_microbatches % world_size:
            allowed = f"a multiple of the {world_size} ranks with interleaved"
            raise ConfigError("parallelism.pipeline_microbatches", pp.pipeline_microbatches, allowed)
    stages = world_size * virtual
    model, spec = meta_model(cfg)
    raise_problem(cfg, spec.splittable_problem(model), "a pipeline")
    blocks = len(spec.block_modules(model))
    if stages > blocks:
        raise ConfigError(
            "parallelism",
            cfg.parallelism.name,
            f"at most {blocks} stages (the model's blocks); {world_size} ranks x {virtual} virtual stages = {stages}",
        )
    sequences = cfg.data.micro_batch_size * cfg.trainer.grad_accum_steps
    if sequences % pp.pipeline_microbatches:
        raise ConfigError(
            "parallelism.pipeline_microbatches",
            pp.pipeline_microbatches,
            f"a divisor of the {sequences} sequences per step (data.micro_batch_size x trainer.grad_accum_steps)",
        )
    points = list(pp.split_points)
    increasing = points == sorted(set(points)) and all(0 < point < blocks for point in points)
    if points and (len(points) != stages - 1 or not increasing):
        raise ConfigError(
            "parallelism.split_points",
            points,
            f"{stages - 1} increasing block indices in 1..{blocks - 1} (empty: balanced)",
        )
    recompute = list(pp.recompute_stages)
    if any(not 0 <= stage < stages for stage in recompute):
        raise ConfigError("parallelism.recompute_stages", recompute, f"stage indices in 0..{stages - 1} (empty: none)")
    if cfg.precision.compute_dtype == "float16":
        raise ConfigError(
            "precision", cfg.precision.name, f"fp32 or bf16 with parallelism={cfg.parallelism.name} (no loss scaler)"
        )
    if cfg.trainer.on_nonfinite == "skip":
        raise ConfigError("trainer.on_nonfinite", "skip", f"stop with parallelism={cfg.parallelism.name} pipelines")
    if cfg.checkpoint.async_save:
        raise ConfigError("checkpoint.async_save", True, f"false with parallelism={cfg.parallelism.name}")


def validate_tensor(cfg: DictConfig, world_size: int) -> None:
    """The model's spec has a tensor-parallel plan whose heads and widths split evenly over the ranks."""
    model, spec = meta_model(cfg)
    options = cfg.parallelism
    problem = spec.tensor_parallel_problem(
        model, world_size, bool(options.loss_parallel), bool(options.get("sequence_parallel", False))
    )
    raise_problem(cfg, problem, "tensor parallelism")
    if cfg.checkpoint.async_save:
        raise ConfigError("checkpoint.async_save", True, f"false with parallelism={cfg.parallelism.name}")
    if cfg.parallelism.sequence_parallel and cfg.data.seq_len % world_size:
        raise ConfigError(
            "data.seq_len",
            cfg.data.seq_len,
            f"a multiple of the {world_size} tensor-parallel ranks with sequence_parallel",
        )
    if cfg.parallelism.loss_parallel and cfg.model.get("vocab_size", 0) % world_size:
        raise ConfigError(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"a multiple of the {world_size} tensor-parallel ranks with loss_parallel",
        )


def single_copy_note(cfg: DictConfig, world_size: int, ranks_per_node: int | None) -> str | None:
    """One line when ``parallelism=hsdp`` (one copy per node) runs on one node whose ranks could hold two copies:
    it resolves to one copy, sharded over every dp rank, which is what ``parallelism=fsdp`` does."""
    if not is_mesh_layout(cfg) or cfg.parallelism.get("dp_replicate") != -1:  # -1: one copy per node
        return None
    if ranks_per_node is None or ranks_per_node < world_size:  # several nodes: a copy per node, as asked
        return None
    degrees = layout_of(cfg.parallelism, world_size, ranks_per_node)
    model_copy = degrees.tp * degrees.pp * degrees.cp  # the ranks one data-parallel rank's model spans
    if world_size % (2 * model_copy) or world_size // (2 * model_copy) < 2:  # two sharded copies must fit
        return None
    return (
        f"parallelism={cfg.parallelism.name} keeps one copy per node (dp_replicate=-1), and these {world_size} ranks "
        "are one node: the model is sharded "
        f"over all of them, as parallelism=fsdp would (parallelism.dp_replicate=2 "
        f"parallelism.dp={world_size // (2 * model_copy)} makes two copies on this node)"
    )


def validate_hybrid(cfg: DictConfig, world_size: int, ranks_per_node: int | None = None) -> None:
    """Degrees against the world size, then the tensor and pipeline rules for their own axes (the resolved degrees:
    a preset's -1 is the rest of the world size)."""
    hybrid = cfg.parallelism
    for axis in ("dp", "tp", "pp"):
        if hybrid[axis] != -1:
            check(cfg, f"parallelism.{axis}", at_least(1), "an integer >= 1, or -1 for the rest of the world size")
    check(cfg, "parallelism.cp", at_least(1), "an integer >= 1")
    check(cfg, "parallelism.ep", at_least(1), "an integer >= 1")
    if hybrid.dp_replicate != -1:
        check(cfg, "parallelism.dp_replicate", at_least(1), "an integer >= 1, or -1 for one per node")
    if hybrid.dp_replicate != 1 and hybrid.dp_mode != "fsdp":
        raise ConfigError("parallelism.dp_replicate", hybrid.dp_replicate, "1 with dp_mode=replicate (use dp)")
    try:
        degrees = layout_of(cfg.parallelism, world_size, ranks_per_node, with_experts=False)
    except ValueError as err:
        raise ConfigError(
            *_misfit_degree(hybrid, world_size), f"degrees whose product is the world size {world_size}: {err}"
        ) from None
    if degrees.dp % hybrid.ep:
        allowed = f"a divisor of the data-parallel degree dp = {degrees.dp} (the experts are split over dp)"
        raise ConfigError("parallelism.ep", hybrid.ep, allowed)
    # fp16's loss scaler and background saves are tested with FSDP over the ranks alone (the fsdp preset) only.
    sharded_only = degrees.tp * degrees.pp * degrees.cp * hybrid.ep * degrees.replicate == 1
    sharded_only = sharded_only and hybrid.pp != -1 and hybrid.dp_mode == "fsdp"
    if cfg.precision.compute_dtype == "float16" and not sharded_only:
        allowed = (
            f"fp32 or bf16 with parallelism={hybrid.name} (fp16's loss scaler: FSDP over dp alone, the fsdp preset)"
        )
        raise ConfigError("precision", cfg.precision.name, allowed)
    if degrees.cp > 1:
        validate_context(cfg, degrees)
    if hybrid.ep > 1:
        validate_experts(cfg, hybrid.ep, degrees)
    if degrees.tp > 1:
        validate_tensor(cfg, degrees.tp)
    pipelined = hybrid.pp != 1  # pp=-1 (the pipeline preset) is a pipeline even of one stage
    if not pipelined and hybrid.recompute_stages:
        raise ConfigError("parallelism.recompute_stages", list(hybrid.recompute_stages), "[] with pp=1 (per stage)")
    if pipelined:
        validate_pipeline(cfg, degrees.pp)
        for option in ("sequence_parallel", "loss_parallel"):
            if hybrid[option]:
                raise ConfigError(
                    f"parallelism.{option}", True, "false with a pipeline, parallelism.pp != 1 (whole models only)"
                )
    if cfg.checkpoint.async_save and not sharded_only:
        raise ConfigError("checkpoint.async_save", True, f"false with parallelism={hybrid.name} (fsdp's only)")


def _misfit_degree(hybrid: DictConfig, world_size: int) -> tuple[str, int]:
    """The key and value to name when the degrees do not fit the world size: the first degree set (not 1 or -1)
    that does not divide it, else the last one set, else the free ones (two -1s; the message names both)."""
    free = [axis for axis in ("dp", "tp", "pp") if hybrid[axis] == -1]
    if len(free) > 1:
        return f"parallelism.{free[-1]}", -1
    chosen = [axis for axis in ("dp_replicate", "cp", "tp", "pp", "dp") if hybrid[axis] not in (-1, 1)]
    for axis in chosen:
        if world_size % hybrid[axis]:
            return f"parallelism.{axis}", hybrid[axis]
    axis = chosen[-1] if chosen else "dp"
    return f"parallelism.{axis}", hybrid[axis]


def validate_context(cfg: DictConfig, degrees: Layout) -> None:
    """Context parallelism: a model whose spec has context-parallel attention, sequences cut into 2 x cp equal
    chunks, whole models sharded by FSDP (no pipeline, no replicate mode, no sequence-parallel split of its own)."""
    hybrid, cp = cfg.parallelism, degrees.cp
    if degrees.pp > 1:
        raise ConfigError("parallelism.pp", hybrid.pp, "1 with parallelism.cp > 1 (cp splits whole models' inputs)")
    if hybrid.dp_mode != "fsdp":
        raise ConfigError("parallelism.dp_mode", "replicate", "fsdp with parallelism.cp > 1")
    if hybrid.sequence_parallel:
        raise ConfigError("parallelism.sequence_parallel", True, "false with parallelism.cp > 1")
    _, spec = meta_model(cfg)
    if spec.context_parallel is None:
        raise ConfigError(
            "parallelism.cp", cp, f"1 for {spec.label}: its spec has no context-parallel attention (context_parallel)"
        )
    if cfg.data.seq_len % (2 * cp):
        raise ConfigError(
            "data.seq_len",
            cfg.data.seq_len,
            f"a multiple of 2 x parallelism.cp = {2 * cp} (each cp rank holds an early and a late chunk)",
        )


def validate_experts(cfg: DictConfig, ep: int, degrees: Layout) -> None:
    """Expert parallelism: a model whose spec splits experts, as many experts on every ep rank, composed with FSDP
    over dp alone (no pipeline, tensor or context split, no replicas or replicate mode; ``degrees`` resolved)."""
    hybrid = cfg.parallelism
    for axis in ("pp", "tp", "cp"):
        if getattr(degrees, axis) != 1:
            raise ConfigError(f"parallelism.{axis}", hybrid[axis], "1 with parallelism.ep > 1 (experts split over dp)")
    if degrees.replicate != 1:
        raise ConfigError("parallelism.dp_replicate", hybrid.dp_replicate, "1 (one node) with parallelism.ep > 1")
    if hybrid.dp_mode != "fsdp":
        raise ConfigError("parallelism.dp_mode", "replicate", "fsdp with parallelism.ep > 1")
    model, spec = meta_model(cfg)
    if spec.expert_parallel is None:
        raise ConfigError("parallelism.ep", ep, f"1 for {spec.label}: its spec splits no experts (expert_parallel)")
    experts = spec.expert_parallel.num_experts(model)
    if experts % ep:
        raise ConfigError("parallelism.ep", ep, f"a divisor of the model's {experts} experts (model.n_experts)")
