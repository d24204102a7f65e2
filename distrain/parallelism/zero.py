"""``parallelism=zero``: the DeepSpeed engine with ZeRO stage 1, 2 or 3.

The engine owns backward (loss scaling, gradient reduction and partitioning) and the optimizer step (clipping,
the LR scheduler at accumulation boundaries). The optimizer, schedule, precision, clipping and accumulation all
come from distrain's own config groups and are translated into one DeepSpeed config, saved in the run directory
as ``deepspeed_config.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distrain.checkpoint.data_only import load_tensors_and_values
from distrain.checkpoint.steps import checkpoint_world_size
from distrain.data.sampler import Batch, step_token_count
from distrain.models.spec import spec_of
from distrain.optim.deepspeed_muon import deepspeed_muon
from distrain.optim.groups import base_lr
from distrain.optim.muon import Muon
from distrain.parallelism.base import NonFiniteGradientError, StepResult, StrategyContext
from distrain.parallelism.capabilities import Capabilities
from distrain.parallelism.checks import check_zero
from distrain.parallelism.layout import Layout
from distrain.planning.memory import ModelStateBytes, StorageCounter, optimizer_state_tensors, reachable_tensors
from distrain.trainer.faults import maybe_inject_fault

CHECKPOINT_TAG = "deepspeed"
# DeepSpeed's defaults for the buffer sizes (elements) that are sized to the model when not set; sizes are rounded
# up to a multiple of BUFFER_ALIGNMENT (DeepSpeed asserts its all-gather bucket is a multiple of its NCCL alignment).
BUFFER_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
}
BUFFER_ALIGNMENT = 512


def import_deepspeed(device_type: str) -> Any:
    """Import DeepSpeed with the accelerator matching ``device_type`` (``DS_ACCELERATOR=cpu`` without a GPU)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device_type == "cuda" else "cpu")
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


def _data_only_checkpoint_engine(config: Any) -> Any:
    """DeepSpeed's torch checkpoint engine, loading every file with ``load_tensors_and_values``."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class DataOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            return load_tensors_and_values(Path(path), map_location=map_location)

    return DataOnlyCheckpointEngine(config)


class ZeroStrategy:
    """ZeRO data parallelism through ``deepspeed.initialize``.

    Collectives (per optimizer step, data-parallel group = all ranks): stage 1 all-reduces gradients and
    all-gathers updated parameter partitions; stage 2 reduce-scatters gradients in buckets during backward and
    all-gathers parameters after the step; stage 3 also all-gathers each module's parameters before its forward
    and backward and releases them after.

    Args mirror DeepSpeed's ``zero_optimization`` section (see conf/parallelism/zero.yaml).
    """

    capabilities = Capabilities(
        checkpoint_format="deepspeed",
        reshards_on_resume=False,
        async_save=False,
        can_skip_step=False,
        zero_stages=(1, 2, 3),
        deepspeed_optimizer=True,
        memory_formula="zero",
    )

    @staticmethod
    def check_config(cfg: Any, placement: Any) -> list[str]:
        """Its own checks before any rank starts (``distrain.parallelism.checks.check_zero``)."""
        return check_zero(cfg, placement)

    @staticmethod
    def resolve_layout(parallelism: Any, world_size: int, ranks_per_node: int | None = None, **_: Any) -> Layout:
        """Every rank data parallel, the model state sharded by ZeRO's stage."""
        return Layout(dp=world_size, dp_holds="shard", sharding_stage=int(parallelism.stage))

    updating = False
    compile_unsupported = (
        "DeepSpeed's engine drives the module (ZeRO-3 gathers parameters in its own module hooks); "
        "use its own compile support instead"
    )

    def __init__(
        self,
        *,
        name: str = "zero",
        stage: int,
        overlap_comm: bool,
        contiguous_gradients: bool,
        reduce_bucket_size: int | None,
        allgather_bucket_size: int | None,
        offload_optimizer: str,
        offload_param: str,
        stage3_prefetch_bucket_size: int | None,
        stage3_param_persistence_threshold: int,
        stage3_max_live_parameters: int | None,
    ) -> None:
        self.name, self.stage = name, stage
        self.zero_settings = {
            "stage": stage,
            "overlap_comm": overlap_comm,
            "contiguous_gradients": contiguous_gradients,
            "reduce_bucket_size": reduce_bucket_size,
            "allgather_bucket_size": allgather_bucket_size,
        }
        if offload_optimizer != "none":
            self.zero_settings["offload_optimizer"] = {"device": offload_optimizer, "pin_memory": True}
        if stage == 3:
            self.zero_settings |= {
                "stage3_prefetch_bucket_size": stage3_prefetch_bucket_size,
                "stage3_param_persistence_threshold": stage3_param_persistence_threshold,
                "stage3_max_live_parameters": stage3_max_live_parameters,
            }
            if offload_param != "none":
                self.zero_settings["offload_param"] = {"device": offload_param, "pin_memory": True}

    def sized_to(self, num_params: int) -> dict[str, Any]:
        """``zero_settings`` with each buffer size left unset (None) sized to the model: its parameter count
        (rounded up to DeepSpeed's alignment), capped at DeepSpeed's default."""
        sized = dict(self.zero_settings)
        for key, cap in BUFFER_DEFAULTS.items():
            if key in sized and sized[key] is None:
                sized[key] = min(cap, -(-num_params // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT)
        return sized

    def deepspeed_config(self, ctx: StrategyContext, num_params: int, muon: bool = False) -> dict[str, Any]:
        """The DeepSpeed config equivalent to distrain's settings (batch, accumulation, clipping, precision), its
        buffers sized to a model of ``num_params`` parameters where not set. ``muon``: the optimizer is DeepSpeed's
        Muon, whose stage 3 reduces gradients without reduce-scatter (it needs every matrix's whole gradient)."""
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": ctx.micro_batch_size,
            "gradient_accumulation_steps": ctx.grad_accum_steps,
            "train_batch_size": ctx.micro_batch_size * ctx.grad_accum_steps * ctx.env.world_size,
            # With Muon, DeepSpeed would clip its updates, not gradients (see optim.checks.unapplied_clipping).
            "gradient_clipping": 0.0 if muon else ctx.grad_clip_norm,
            "zero_optimization": self.sized_to(num_params)
            | ({"reduce_scatter": False} if muon and self.stage == 3 else {}),
            # distrain builds the torch optimizer (AdamW/SGD) from its optimizer group; DeepSpeed wraps it.
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        dtype = ctx.precision.compute_dtype
        if dtype == torch.bfloat16:
            config["bf16"] = {"enabled": True}
        elif dtype == torch.float16:
            config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
        return config

    def setup(self, model: nn.Module, ctx: StrategyContext) -> None:
        deepspeed = import_deepspeed(ctx.env.device.type)
        # DeepSpeed's ZeRO steps call torch collectives that torch deprecates (stages 1-2 all_gather_into_tensor,
        # stage 3 reduce_scatter_tensor); the warning is DeepSpeed's to act on, and printed by every rank it only
        # hides the run's own lines.
        deprecated = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
        warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)
        self.ctx, self.device, self.spec = ctx, ctx.env.device, spec_of(model)
        optimizer = ctx.build_optimizer(model.named_parameters())
        muon = isinstance(optimizer, Muon)
        if muon:  # ZeRO drives DeepSpeed's Muon, which it knows how to partition
            optimizer = deepspeed_muon(optimizer)
        config = self.deepspeed_config(ctx, sum(p.numel() for p in model.parameters()), muon)
        if ctx.env.is_main:
            Path(ctx.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(ctx.run_dir) / "deepspeed_config.json").write_text(json.dumps(config, indent=2) + "\n")
        scheduler = ctx.build_scheduler(optimizer)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config, dist_init_required=False
        )
        # DeepSpeed's own engine unpickles its files unrestricted (any pickle runs); this one reads data only.
        self.engine.checkpoint_engine = _data_only_checkpoint_engine(self.engine._config)
        self._state_bytes: ModelStateBytes | None = None

    @property
    def data_parallel(self) -> tuple[int, int]:
        return self.ctx.env.rank, self.ctx.env.world_size

    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        self.engine.train()
        if self._state_bytes is None:
            self._watch_buckets()
        loss_sum = torch.zeros((), device=self.device)
        total_tokens = step_token_count(micro_batches)
        for index, batch in enumerate(micro_batches):
            batch = batch.to(self.device)
            output = self.engine(batch.inputs, **batch.model_kwargs)
            objective, micro_loss = self.spec.objective(self.engine.module, output, batch.targets)
            # The engine divides by gradient_accumulation_steps itself: hand it the step's token mean times that.
            self.engine.backward(objective / (total_tokens / len(micro_batches)))
            measure = index == len(micro_batches) - 1 and self._state_bytes is None
            if measure:  # gradients exist only between the last backward and the step
                counter = StorageCounter()
                grad_bytes = self._gradient_bytes(counter)
            last = index == len(micro_batches) - 1
            if last:
                marks = {
                    "backward_done": self.ctx.clock.mark(),
                    "model_metrics": self.spec.step_metrics(self.engine.module),
                }
            self.updating = last  # stays set if the step fails: DeepSpeed may have applied part of it
            self.engine.step()  # steps the optimizer and scheduler only at the accumulation boundary
            if last:
                maybe_inject_fault(self.ctx.env.rank, self.engine.global_steps, point="update")
            if measure:  # optimizer state exists only after the first step
                self._state_bytes = self._measure_model_state(counter, grad_bytes)
            loss_sum += micro_loss.detach().float()
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None and not math.isfinite(float(grad_norm)) and not self.engine.fp16_enabled():
            # DeepSpeed has applied the step already (only its fp16 loss scaler skips overflowing steps):
            # stop before these weights can reach a checkpoint.
            raise NonFiniteGradientError(f"gradient norm is {float(grad_norm)} under DeepSpeed")
        self.updating = False
        marks["optimizer_done"] = self.ctx.clock.mark()
        return StepResult(
            loss=loss_sum / total_tokens,
            grad_norm=torch.as_tensor(0.0 if grad_norm is None else float(grad_norm), device=self.device),
            marks=marks,
        )

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> tuple[torch.Tensor, int]:
        self.engine.eval()
        batch = batch.to(self.device)
        return self.spec.loss(self.engine(batch.inputs, **batch.model_kwargs), batch.targets), batch.num_tokens

    def current_lr(self) -> float:
        return base_lr(self.engine.optimizer)

    def _zero_optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return reachable_tensors(self.engine.optimizer, skip=(nn.Module,))

    def _gradient_bytes(self, counter: StorageCounter) -> int:
        """Gradients: ``.grad`` of the module's parameters and the gradient partitions the ZeRO optimizer keeps
        (not its ``ipg`` communication buckets)."""
        grads = [p.grad for p in self.engine.module.parameters()]
        grads += [t for path, t in self._zero_optimizer_tensors() if "grad" in path.lower() and "ipg" not in path]
        return counter.bytes(grads)

    def _watch_buckets(self) -> None:
        """Record the bytes of DeepSpeed's stage-1/2 gradient buckets while backward fills them (they are freed
        before the step returns; stage 3 keeps its bucket, which ``_measure_model_state`` finds), from a backward
        hook on the first block, the last module backward reaches. The hook removes itself after one record."""
        self._bucket_bytes = 0
        blocks = list(self.spec.block_modules(self.engine.module).values())
        if self.stage == 3 or not blocks:  # a model without blocks: its buckets go unmeasured (0)
            return

        def record(*_: object) -> None:
            held = 0
            for bucket in getattr(self.engine.optimizer, "ipg_buckets", {}).values():
                buffers = bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer]
                held += sum(t.numel() * t.element_size() for t in buffers if t is not None)
            self._bucket_bytes = max(self._bucket_bytes, held)
            handle.remove()

        handle = blocks[0].register_full_backward_hook(record)

    def _measure_model_state(self, counter: StorageCounter, grad_bytes: int) -> ModelStateBytes:
        """Parameter partitions (full parameters below stage 3), optimizer state with the fp32 master partitions,
        and, as buffers, whatever else the ZeRO optimizer holds (scratch) and its gradient buckets at their fullest
        during backward."""
        param_bytes = counter.bytes(getattr(p, "ds_tensor", p) for p in self.engine.module.parameters())
        found = self._zero_optimizer_tensors()
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        optimizer_bytes = counter.bytes(optimizer_state_tensors(inner))
        optimizer_bytes += counter.bytes(t for path, t in found if "fp32" in path)
        buffer_bytes = counter.bytes(t for path, t in found) + self._bucket_bytes
        return ModelStateBytes(params=param_bytes, grads=grad_bytes, optimizer=optimizer_bytes, buffers=buffer_bytes)

    def model_state_bytes(self) -> ModelStateBytes:
        if self._state_bytes is None:
            raise RuntimeError("model state is measured during the first train_step")
        return self._state_bytes

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        """DeepSpeed's own sharded format: each rank writes its optimizer (and, at stage 3, parameter) partition.
        Synchronous only (its capabilities say no ``async_save``, so validation refuses it)."""
        self.engine.save_checkpoint(str(path), tag=CHECKPOINT_TAG, client_state={"extra": extra}, save_latest=False)

    def load_checkpoint(self, path: Path, extra: dict[str, Any]) -> dict[str, Any]:
        saved_world_size = checkpoint_world_size(path)
        if saved_world_size not in (None, self.ctx.env.world_size):
            raise ValueError(
                f"{path} was saved by {saved_world_size} ranks; a zero checkpoint resumes only on the same number of "
                f"ranks (this job has {self.ctx.env.world_size}). Export it with python -m distrain.checkpoint.export"
            )
        _, client_state = self.engine.load_checkpoint(
            str(path), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if client_state is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path}")
        return client_state["extra"]
