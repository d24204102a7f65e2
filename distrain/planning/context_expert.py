"""The context- and expert-parallel terms of the dry run's per-rank memory (``distrain.planning.rank_memory``).

Both work on the meta device, under the fake process group ``dry_run.py`` sets up, on the two copies of a rank's
modules the planner builds: the held one (split and sharded as the strategy holds it at rest) and the computing one
(tensor-parallel only, whole over dp x cp, in the compute dtype). Neither allocates storage or communicates.

Context parallelism (``cp > 1``) is measured, not derived. The computing model gets the spec's context-parallel
attention as cp rank 0 of the mesh's ``cp`` axis (a ``ContextParallel``) and runs one forward on its local
``seq_len / cp`` tokens of each sequence. The fake group's all-gather runs on meta tensors, so autograd saves what
``ContextParallel.attend`` keeps: the local tokens' activations, the keys and values of the whole sequence after
head repetition, the gather's argsort index, and what attention under the local x seq_len mask keeps. On the meta
device ``scaled_dot_product_attention`` takes its math path, which saves the attention probabilities (local x
seq_len per head; the boolean mask itself is consumed in forward); a fused GPU kernel keeps a log-sum-exp instead
(and the memory-efficient one the mask as a bias). The cp = 1 estimate makes the same choice (seq_len x seq_len), so
layouts compare on equal terms, both on the high side. Every cp rank holds as many tokens (an early and a late
chunk), so rank 0 stands for all.

Expert parallelism (``ep > 1``) is estimated, since its forward cannot run on meta tensors (the all-to-all splits
are read from routing counts). The assumption is balanced routing: every expert gets an equal share of the slots,
as the meta MoE layer routes, so each rank receives as many token-slots as it sends and its local experts save the
same rows that the whole experts would for its own slots. The computing model without EP is measured on the rank's
micro-batch, and to that come what only the EP path keeps:

- per expert layer with ``R`` routed slots: the experts' output rows the combine's ``index_copy`` saves (R x width
  in the activation dtype) and the int64 index that sorts the received rows by expert (R x 8 bytes). R is counted
  in the same forward: the rows multiplied by each expert weight (``_ExpertRows``);
- under autocast, the compute-dtype copies of this rank's experts: FSDP's mixed precision skips them (ignored
  params, fp32 at rest), so each expert matmul casts its weight and saves the copy for backward.

Routing skew above the balanced share and the all-to-all send/receive buffers (transient, freed inside the layer,
as for every strategy's communication buffers) are not predicted. FSDP gathers only the non-expert parameters, so
the experts are left out of the gathered bytes (``not_gathered``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from distrain.models.spec import spec_of
from distrain.parallelism.context import ContextParallel
from distrain.parallelism.layout import Layout
from distrain.planning.memory import local
from distrain.precision.policy import PrecisionPolicy

Measure = Callable[[nn.Module, int], int]  # (computing model, local seq_len) -> bytes saved by one forward
INDEX_BYTES = torch.int64.itemsize  # the sort index of the received rows


def whole_model_activations(
    computing: nn.Module,
    held: nn.Module,
    degrees: Layout,
    mesh: DeviceMesh | None,
    seq_len: int,
    precision: PrecisionPolicy,
    measure: Measure,
) -> int:
    """Bytes one rank of a whole-model layout (pp == 1) saves for backward in one forward of its micro-batch, with
    the cp and ep terms of the module docstring. ``computing`` gets context-parallel attention in place when cp > 1;
    ``mesh`` (the planner's, over the fake group) must have a ``cp`` axis then. Collectives: the fake group's
    all-gather (cp), which moves nothing."""
    if degrees.cp > 1:
        if mesh is None:
            raise ValueError("context parallelism needs the layout's mesh (its cp axis)")
        cp_axis = mesh["cp"]
        # Rank 0 of the cp group: every rank holds seq_len / cp tokens, so all save the same bytes.
        spec_of(computing).context_parallel(computing, ContextParallel(cp_axis.get_group(), degrees.cp, 0))
        seq_len //= degrees.cp
    if degrees.ep == 1:
        return measure(computing, seq_len)
    return _expert_parallel_activations(computing, held, seq_len, precision, measure)


def not_gathered(computing: nn.Module, held: nn.Module, degrees: Layout) -> set[int]:
    """Ids of the computing model's parameters that FSDP does not all-gather: the experts under ep (each rank holds
    its own whole, outside FSDP); empty otherwise."""
    if degrees.ep == 1:
        return set()
    names = _expert_names(held)
    return {id(param) for name, param in computing.named_parameters() if name in names}


def _expert_names(held: nn.Module) -> frozenset[str]:
    """Names of the expert parameters of ``held`` (split by the spec's expert-parallel plan): the names are the same
    in the computing model, which FSDP and the plan leave unchanged in structure."""
    experts = {id(param) for param in spec_of(held).expert_parallel.parameters(held)}
    return frozenset(name for name, param in held.named_parameters() if id(param) in experts)


def _expert_parallel_activations(
    computing: nn.Module, held: nn.Module, seq_len: int, precision: PrecisionPolicy, measure: Measure
) -> int:
    names = _expert_names(held)
    # The expert layer of each weight: its module's name (a weight's rows are that layer's routed slots).
    layer_of = {id(param): name.rsplit(".", 1)[0] for name, param in computing.named_parameters() if name in names}
    counter = _ExpertRows(layer_of)
    with counter:
        saved = measure(computing, seq_len)
    activation_bytes = precision.compute_dtype.itemsize if precision.uses_autocast else 4
    width = spec_of(computing).hidden_width(computing)
    routed = sum(counter.slots_per_layer()) * (width * activation_bytes + INDEX_BYTES)
    held_experts = sum(local(param).numel() for name, param in held.named_parameters() if name in names)
    casts = held_experts * activation_bytes if precision.uses_autocast else 0
    return saved + routed + casts


class _ExpertRows(TorchDispatchMode):
    """Counts, during a forward on the meta device, the rows multiplied by each expert weight: every ``aten.mm``
    whose second operand is a view of one (``rows @ weight[e].t()``). No collective, no storage."""

    def __init__(self, layer_of: dict[int, str]) -> None:
        super().__init__()
        self.layer_of = layer_of  # id of an expert parameter -> the name of the layer holding it
        self.rows: dict[int, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.ops.aten.mm.default:
            weight = id(args[1]._base)  # a weight's slice, transposed: a view whose base is the parameter
            if weight in self.layer_of:
                self.rows[weight] = self.rows.get(weight, 0) + args[0].shape[0]
        return func(*args, **(kwargs or {}))

    def slots_per_layer(self) -> list[int]:
        """Routed token-slots of each expert layer: every slot passes through each of the layer's expert weights
        once, so any one weight's count (the largest, to be safe) is the layer's."""
        layers: dict[str, int] = {}
        for weight, rows in self.rows.items():
            layer = self.layer_of[weight]
            layers[layer] = max(layers.get(layer, 0), rows)
        return list(layers.values())
