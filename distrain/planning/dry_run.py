"""``python train.py dry_run=true target.nodes=8 target.ranks_per_node=8``: check a job for a cluster on a laptop.

In this one process, for the target's world size and device type: the same ``validate`` the real launch runs
(degrees, divisibility, schedules, precision, every key), then a fake process group of the target's world size
(torch's ``fake`` backend: collectives return at once) under which the strategy's own functions build the device
mesh and split and shard the model on the meta device; the corpus is loaded and the global batch checked against
it as the samplers do. Then each kind of rank's predicted memory (``distrain.planning.rank_memory``) is set against
the target's device memory. Nothing is allocated for the model, so a 70B plan runs on a laptop in seconds.

Collectives: none that communicate (the fake backend's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig

from distrain.config.global_batch import validate_data_fits
from distrain.config.options import Placement
from distrain.config.validate import ConfigError, Target, validate
from distrain.ft.config import replica_group_count
from distrain.launch.process_group import resolve_device_type
from distrain.launch.ranks import default_nproc_per_node
from distrain.models.meta import meta_device
from distrain.parallelism.capabilities import capabilities_of
from distrain.parallelism.describe import degree_items, mesh_line
from distrain.parallelism.layout import Layout, layout_of
from distrain.parallelism.recompute import apply_activation_checkpointing
from distrain.planning.memory import optimizer_state_bytes_per_param
from distrain.planning.rank_memory import RankMemory, Workload, predict_rank_memory

GIB = 2**30
DEFAULT_GPU_MEMORY_GIB = 80.0  # a cuda target without a GPU here: an 80 GB A100/H100
DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class DryRunReport:
    """What a dry run found: the target, its data-parallel layout, batch arithmetic and per-rank memory."""

    target: Target
    parallelism: str
    model_parameters: int
    data_parallel: int
    global_batch_size: int
    tokens_per_step: int
    steps_per_epoch: int
    ranks: list[RankMemory]
    mesh: Layout | None = None  # the layout's degrees on the target (None: not planned)

    @property
    def fits(self) -> bool:
        return all(row.total <= self.target.device_memory_bytes for row in self.ranks)

    def shortfall(self) -> str:
        """One line naming the fullest rank and how far it is over the device memory ('' when all fit)."""
        fullest = max(self.ranks, key=lambda row: row.total)
        if fullest.total <= self.target.device_memory_bytes:
            return ""
        return (
            f"{fullest.ranks}: {fullest.total / GIB:.2f} GiB predicted, more than the "
            f"{self.target.device_memory_bytes / GIB:.1f} GiB per device (target.device_memory_gib)"
        )

    def as_dict(self) -> dict[str, Any]:
        target = self.target
        return {
            "target": {
                "nodes": target.nodes,
                "ranks_per_node": target.ranks_per_node,
                "world_size": target.world_size,
                "device": target.device_type,
                "device_memory_bytes": target.device_memory_bytes,
            },
            "parallelism": self.parallelism,
            "model_parameters": self.model_parameters,
            "data_parallel": self.data_parallel,
            "global_batch_size": self.global_batch_size,
            "tokens_per_step": self.tokens_per_step,
            "steps_per_epoch": self.steps_per_epoch,
            "mesh": None if self.mesh is None else degree_items(self.mesh),
            "ranks": [row.as_dict() for row in self.ranks],
            "fits": self.fits,
        }

    def describe(self) -> str:
        t = self.target
        fullest = max(row.total for row in self.ranks)
        unit_name, unit = ("GiB", GIB) if fullest >= GIB else ("MiB", 2**20)
        lines = [
            f"distrain dry run: parallelism={self.parallelism} on {t.world_size} ranks ({t.nodes} node(s) x "
            f"{t.ranks_per_node} {t.device_type}): configuration valid",
            f"model: {self.model_parameters / 1e6:,.1f} M parameters; data-parallel replicas: {self.data_parallel}; "
            f"global batch: {self.global_batch_size} sequences = {self.tokens_per_step:,} tokens per step; "
            f"{self.steps_per_epoch:,} steps per epoch",
            *([] if self.mesh is None else [mesh_line(self.mesh)]),
            f"predicted memory per rank ({unit_name}) against {t.device_memory_bytes / GIB:.1f} GiB per device:",
            f"  {'ranks':<44} {'params':>8} {'grads':>8} {'optim':>8} {'gathered':>9} {'activ':>8} {'buffers':>8} "
            f"{'total':>8}  fits",
        ]
        for row in self.ranks:
            values = (row.params, row.grads, row.optimizer, row.gathered, row.activations, row.buffers, row.total)
            cells = " ".join(f"{v / unit:>{w}.3f}" for v, w in zip(values, (8, 8, 8, 9, 8, 8, 8), strict=True))
            verdict = "yes" if row.total <= t.device_memory_bytes else "NO"
            lines.append(f"  {row.ranks:<44} {cells}  {verdict}")
        margin = t.device_memory_bytes - fullest
        lines.append(
            f"fits: {'yes' if self.fits else 'NO'} ({abs(margin) / GIB:.2f} GiB "
            f"{'to spare' if margin >= 0 else 'short'} on the fullest rank; allocator fragmentation, "
            "other strategies' communication buffers and the CUDA context come on top)"
        )
        return "\n".join(lines)


def resolve_target(cfg: DictConfig) -> Target:
    """The target of ``cfg.target``, its unset keys filled from this machine and ``cfg.distributed``."""
    spec = cfg.target
    if spec.device not in (None, "cpu", "cuda"):
        raise ConfigError("target.device", spec.device, "cpu, cuda, or null (distributed.device on this machine)")
    if spec.device is None and cfg.distributed.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("distributed.device", cfg.distributed.device, "one of auto, cpu, cuda")
    device_type = spec.device or resolve_device_type(cfg.distributed.device)
    if spec.nodes is None or spec.nodes < 1:
        raise ConfigError("target.nodes", spec.nodes, "an integer >= 1")
    ranks, key = spec.ranks_per_node, "target.ranks_per_node"
    if ranks is None:
        ranks, key = cfg.distributed.nproc_per_node, "distributed.nproc_per_node"
    if ranks is None:
        gpus_here = torch.cuda.device_count() if device_type == "cuda" else 0
        ranks = gpus_here or (DEFAULT_GPUS_PER_NODE if device_type == "cuda" else default_nproc_per_node("cpu"))
        if capabilities_of(cfg.parallelism).one_rank:
            ranks = 1
    if ranks < 1:  # worded as validate() words it, so that a dry run and the real launch refuse alike
        raise ConfigError(key, ranks, "an integer >= 1 (or null: automatic)")
    memory_gib = spec.device_memory_gib
    if memory_gib is not None and memory_gib <= 0:
        raise ConfigError("target.device_memory_gib", memory_gib, "a size in GiB > 0, or null")
    if memory_gib is None:
        if device_type == "cuda":
            here = torch.cuda.is_available()
            memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB if here else DEFAULT_GPU_MEMORY_GIB
        else:
            memory_gib = psutil.virtual_memory().total / GIB / ranks
    return Target(
        nodes=spec.nodes,
        ranks_per_node=ranks,
        device_type=device_type,
        device_memory_bytes=int(memory_gib * GIB),
        ranks_key=key,
    )


def plan(cfg: DictConfig) -> DryRunReport:
    """Validate ``cfg`` for its target and predict each rank's memory there; ``ConfigError`` as the real launch
    would raise it."""
    target = resolve_target(cfg)
    validate(cfg, target)
    strategy = instantiate(cfg.parallelism)
    precision = instantiate(cfg.precision)
    workload = Workload(
        micro_batch_size=cfg.data.micro_batch_size,
        grad_accum_steps=cfg.trainer.grad_accum_steps,
        seq_len=cfg.data.seq_len,
        optimizer_bytes=optimizer_state_bytes_per_param(cfg.optimizer),
    )
    new_model = partial(_model_with_recomputation, cfg)
    with meta_device():
        parameters = sum(p.numel() for p in new_model().parameters())
    # Under replica groups each group runs the layout on its own ranks: one group's ranks are planned.
    groups = replica_group_count(cfg)
    inside = Placement(target.world_size, target.ranks_per_node, target.device_type, True, groups).inside_group()
    in_group = layout_of(cfg.parallelism, inside.world_size, inside.ranks_per_node)
    mesh = layout_of(cfg.parallelism, target.world_size, target.ranks_per_node, replica_groups=groups)
    dist.init_process_group("fake", store=_fake_store(), rank=0, world_size=inside.world_size)
    try:
        ranks = predict_rank_memory(
            strategy,
            layout=in_group,
            new_model=new_model,
            precision=precision,
            workload=workload,
        )
    finally:
        dist.destroy_process_group()
        _forget_destroyed_meshes()
    data_parallel = mesh.data_parallel
    # validate() checked it; the sampler sizes the report
    sampler = validate_data_fits(cfg, target.world_size, target.ranks_per_node)
    return DryRunReport(
        target=target,
        parallelism=cfg.parallelism.name,
        model_parameters=parameters,
        data_parallel=data_parallel,
        global_batch_size=sampler.global_batch_size,
        tokens_per_step=sampler.global_batch_size * cfg.data.seq_len,
        steps_per_epoch=sampler.num_samples // sampler.global_batch_size,
        ranks=ranks,
        mesh=mesh,
    )


def write_report(report: DryRunReport, run_dir: str) -> Path:
    """Write the report as ``dry_run.json`` in the run directory."""
    path = Path(run_dir) / "dry_run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.as_dict(), indent=2))
    return path


def _fake_store() -> dist.Store:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _forget_destroyed_meshes() -> None:
    """Empty DTensor's caches of sharding and redistribution plans: they hold the meshes just planned with, whose
    process groups are gone, and an equal mesh in a later plan in this process would find them there."""
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's own cache
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def _model_with_recomputation(cfg: DictConfig) -> torch.nn.Module:
    model = instantiate(cfg.model)
    apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.activation_checkpointing_every)
    return model
