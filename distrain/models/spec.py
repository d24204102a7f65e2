"""The model contract: what generic code (parallelism, planning, monitoring) may ask of a model.

A model family declares a ``ModelSpec`` beside its model (``distrain/models/<family>/spec.py``) and its model class
names it as the class attribute ``parallel_spec``. Generic code calls ``spec_of(model)`` and then only the spec's
methods; it never reads a family's attribute names. A model without ``parallel_spec`` gets ``WHOLE_MODEL``: one
unit, no tensor-parallel plan, no pipeline split, 6 FLOPs per parameter per token; it trains under the
data-parallel strategies (single, ddp, zero, fsdp) and the others refuse it with one line.

The pieces a spec names:

- ``blocks``: the dotted path of an ``nn.ModuleDict`` of the repeated blocks. They are FSDP's sharding units,
  activation checkpointing's and compile's units and the pipeline's split points. Each block is called with the
  hidden states (and, under document masking, the sequence's documents).
- ``document_masking``: the model's forward takes ``documents=`` (long, (batch, seq): each token's document inside
  its sequence; ``distrain.data.packing``), restarts positions at each document and attends only inside it; every
  pipeline stage takes it too. False: ``data.document_masking=true`` is refused before any rank starts.
- ``before_blocks`` / ``after_blocks``: the model's own children used before the first block (embeddings) and after
  the last (final norm, output head). A pipeline stage is the model itself with the children it does not hold set to
  ``None`` and only its blocks left in the ``ModuleDict``; the model's one forward skips what is ``None``.
- ``width``: the attribute holding the residual width (the hidden states a middle pipeline stage receives).
- ``tensor_plan``: ``(model, sequence_parallel, loss_parallel) -> {module path: ParallelStyle}`` keyed to the family's
  own module names, over the blocks the model (or pipeline stage) holds; ``tensor_options`` lists the options the
  plan implements (``sequence_parallel``, ``loss_parallel``); ``tensor_problem(model, degree, split_head)`` says
  which config key does not divide by the tensor-parallel degree (``split_head``: an option splits the output head
  over the vocabulary).
- ``flops_per_token``, ``loss`` (summed next-token loss on the model's output) and ``auxiliary_loss`` (a per-forward
  loss the model computed, e.g. a mixture of experts' load balancing, added to the objective but not reported as the
  loss), ``metrics`` (values to log after a step, e.g. tokens per expert), and ``hf`` (an ``HFCounterpart``: state-dict
  renaming to and from the family's Hugging Face counterpart, and the transformers config of a model).
- ``expert_parallel``: an ``ExpertParallelPlan``, how the family splits its experts over ranks (None: no experts).
- ``context_parallel``: ``(model, context)`` turns on exact context-parallel attention in every attention module of
  the model (or pipeline stage), given a ``distrain.parallelism.context.ContextParallel``; None: the family has none.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TensorPlan = Callable[..., dict[str, object]]


@dataclass(frozen=True)
class ConfigProblem:
    """A model config value a layout cannot use: the key, its value and what is allowed."""

    key: str
    value: object
    allowed: str


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over (batch, seq) logits, in fp32 whatever the autocast dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def matmul_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """6 training FLOPs (forward and backward) per weight of every ``nn.Linear`` module, counted once per module (a
    module called twice per token is undercounted); no attention term. The default for models whose spec says
    nothing else."""
    del seq_len
    return 6.0 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


@dataclass(frozen=True)
class ExpertParallelPlan:
    """How a family splits its experts over the ``ep`` ranks of ``parallelism.ep`` (generic code calls only these).

    - ``parallelize(model, ep_mesh, replicas_group)``: in place, on the materialised model before FSDP; each rank
      keeps its share of the experts (DTensors on ``ep_mesh``) and routes token-slots to their owners by all-to-all;
      ``replicas_group`` joins the ranks holding the same experts (None when the data-parallel degree is ep).
    - ``parameters(model)``: the expert weights, which FSDP must leave alone (``ignored_params``).
    - ``sync_gradients(model)``: after the step's last backward, before clipping: the experts' gradients scaled
      (and reduced over the replicas) to the gradient of the data-parallel mean.
    - ``num_experts(model)``: what ep must divide.
    """

    parallelize: Callable[[nn.Module, Any, Any], None]
    parameters: Callable[[nn.Module], set[nn.Parameter]]
    sync_gradients: Callable[[nn.Module], None]
    num_experts: Callable[[nn.Module], int]


@dataclass(frozen=True)
class HFCounterpart:
    """A family's Hugging Face counterpart: ``to_hf``/``from_hf`` rename a state dict to and from Hugging Face's
    names and layouts (KeyError on an unknown key); ``config(model)`` is the transformers config describing
    ``model``."""

    to_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    from_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    config: Callable[[nn.Module], Any]


@dataclass(frozen=True)
class ModelSpec:
    """How a model family is split, sharded, counted and trained (see the module docstring)."""

    name: str
    blocks: str | None = None
    before_blocks: tuple[str, ...] = ()
    after_blocks: tuple[str, ...] = ()
    width: str | None = None
    tensor_plan: TensorPlan | None = None
    tensor_options: tuple[str, ...] = ()  # the plan's forms besides the plain one: sequence_parallel, loss_parallel
    tensor_problem: Callable[[nn.Module, int, bool], ConfigProblem | None] | None = None
    pipeline_problem: Callable[[nn.Module], str | None] | None = None
    flops_per_token: Callable[[nn.Module, int], float] = matmul_flops_per_token
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss
    auxiliary_loss: Callable[[nn.Module], torch.Tensor | None] | None = None
    metrics: Callable[[nn.Module], dict[str, float]] | None = None
    # Checks of the family's own config keys (``distrain.config.checks.check``), run before any rank starts.
    check_config: Callable[[Any], None] | None = None
    hf: HFCounterpart | None = None  # None: the family has no Hugging Face counterpart
    # Turns on context-parallel attention in every attention module, given a ContextParallel (Any: no import cycle).
    context_parallel: Callable[[nn.Module, Any], None] | None = None
    expert_parallel: ExpertParallelPlan | None = None  # how ``parallelism.ep`` splits the experts; None: no experts
    # Its forward takes ``documents=`` (document masking: positions restart and attention stays in each document).
    document_masking: bool = False
    # Parameter name -> role, for families whose roles the generic rule gets wrong (None: ``parameter_roles``'s rule).
    roles: Callable[[nn.Module], dict[str, str]] | None = None

    @property
    def label(self) -> str:
        """How messages name the model: by its family, or as having no spec."""
        return f"the {self.name} model" if self.name else "a model without a parallel_spec"

    # ------------------------------------------------------------------------------------------- blocks
    def block_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """The repeated blocks of ``model`` (or of a pipeline stage of it) by name, in forward order: the children
        of the ``ModuleDict`` (or ``ModuleList``) the spec names; empty when it names none."""
        if self.blocks is None:
            return {}
        return dict(model.get_submodule(self.blocks).named_children())

    def units(self, model: nn.Module) -> list[nn.Module]:
        """The modules FSDP shards, activation checkpointing recomputes and compile traces one by one: the blocks,
        or the whole model when the spec names none."""
        blocks = self.block_modules(model)
        return list(blocks.values()) if len(blocks) else [model]

    def unit_names(self, model: nn.Module) -> list[str]:
        """Module paths of ``units(model)`` ("" for the model itself)."""
        blocks = self.block_modules(model)
        return [f"{self.blocks}.{key}" for key in blocks] if len(blocks) else [""]

    # ------------------------------------------------------------------------------------------- pipeline
    def splittable_problem(self, model: nn.Module) -> str | None:
        """Why ``model`` cannot be split into pipeline stages (None: it can): the family's own reason first."""
        family_reason = self.pipeline_problem(model) if self.pipeline_problem else None
        if family_reason:
            return family_reason
        if self.blocks is None or not self.before_blocks or not self.after_blocks:
            return f"{self.label} names no blocks to split (ModelSpec.blocks/before_blocks/after_blocks)"
        if self.auxiliary_loss is not None:
            return f"{self.label} adds an auxiliary loss inside its blocks, which a pipeline stage cannot return"
        names = (self.blocks, *self.before_blocks, *self.after_blocks)
        missing = [name for name in names if name not in model._modules]
        container = None if missing else type(model.get_submodule(self.blocks)).__name__
        if container is not None and container != "ModuleDict":
            return f"{self.label} keeps its blocks in a {container}: a pipeline needs a ModuleDict (stages keep names)"
        if missing:
            return f"{self.label} has no child module {', '.join(missing)} (the spec names its own children)"
        own = [name for name, _ in [*model.named_parameters(recurse=False), *model.named_buffers(recurse=False)]]
        if own:
            return f"{self.label} holds {', '.join(own)} itself, in no stage's module: move it into a child"
        return None

    def stage(self, model: nn.Module, block_ids: Iterable[str], *, first: bool, last: bool) -> nn.Module:
        """A pipeline stage: a shallow copy of ``model`` holding the blocks ``block_ids``, the ``before_blocks``
        children when ``first`` and the ``after_blocks`` ones when ``last``; the rest are ``None``. The children (so
        every parameter) are shared with ``model`` and keep the full model's names (checkpoints name every tensor as
        the unsplit model); the copied root and blocks container have their own tables of children and hooks."""
        keep = set(block_ids)
        stage = _shallow_copy_along(model, self.blocks)
        blocks = stage.get_submodule(self.blocks)
        for key in [k for k in blocks if k not in keep]:
            del blocks[key]
        for name in (() if first else self.before_blocks) + (() if last else self.after_blocks):
            stage._modules[name] = None
        return stage

    def is_first_stage(self, stage: nn.Module) -> bool:
        """Whether ``stage`` (or the whole model) holds the modules before the blocks: it takes token ids."""
        return all(stage._modules.get(name) is not None for name in self.before_blocks)

    def is_last_stage(self, stage: nn.Module) -> bool:
        """Whether ``stage`` (or the whole model) holds the modules after the blocks: it returns logits."""
        return all(stage._modules.get(name) is not None for name in self.after_blocks)

    def hidden_width(self, model: nn.Module) -> int:
        """The residual width: the last dimension of the hidden states passed between blocks."""
        if self.width is None:
            raise ValueError(f"{self.label} names no width (ModelSpec.width)")
        return int(getattr(model, self.width))

    # ------------------------------------------------------------------------------------------- tensor parallel
    def tensor_plan_for(self, model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, object]:
        """The tensor-parallel plan of ``model`` (whole or a pipeline stage): module path -> ``ParallelStyle``."""
        if self.tensor_plan is None:
            raise ValueError(f"{self.label} has no tensor-parallel plan (ModelSpec.tensor_plan)")
        return self.tensor_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    def tensor_parallel_problem(
        self, model: nn.Module, degree: int, loss_parallel: bool = False, sequence_parallel: bool = False
    ) -> ConfigProblem | str | None:
        """Why ``model`` cannot be split over ``degree`` tensor-parallel ranks with these options (None: it can)."""
        if self.tensor_plan is None:
            return f"{self.label} has no tensor-parallel plan (ModelSpec.tensor_plan)"
        for option, chosen in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
            if chosen and option not in self.tensor_options:
                return ConfigProblem(
                    f"parallelism.{option}", True, f"false: the {self.name} model's tensor plan has no {option} form"
                )
        split_head = loss_parallel or sequence_parallel  # either splits the output head over the vocabulary
        return self.tensor_problem(model, degree, split_head) if self.tensor_problem else None

    # ------------------------------------------------------------------------------------------- optimizer
    def parameter_roles(self, model: nn.Module) -> dict[str, str]:
        """Every parameter's role (``distrain.optim.groups.ROLES``) by its name in the unwrapped ``model``: the
        family's ``roles`` if it has one, else ``default_parameter_roles`` with this spec's ``after_blocks``."""
        return self.roles(model) if self.roles is not None else default_parameter_roles(model, self.after_blocks)

    # ------------------------------------------------------------------------------------------- training
    def objective(
        self, model: nn.Module, output: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(what backward runs on, the summed loss to report) for one forward's ``output``. An auxiliary loss (a
        mean over the micro-batch) enters the objective weighted by the micro-batch's token count, so that dividing
        by the step's tokens makes it a token-weighted mean over the step's micro-batches, like the loss."""
        loss = self.loss(output, targets)
        auxiliary = self.auxiliary_loss(model) if self.auxiliary_loss else None
        if auxiliary is None:
            return loss, loss
        return loss + auxiliary * (targets >= 0).sum(), loss  # the counted targets: ignored ones are negative

    def step_metrics(self, model: nn.Module) -> dict[str, float]:
        """Model-specific values to log after a step (this rank's)."""
        return self.metrics(model) if self.metrics else {}


WHOLE_MODEL = ModelSpec(name="")


def spec_of(model: nn.Module) -> ModelSpec:
    """The spec ``model`` declares as ``parallel_spec`` (its own, as a wrapped Hugging Face model builds one for its
    architecture, or its class's), else ``WHOLE_MODEL``."""
    spec = getattr(model, "parallel_spec", None)
    if spec is None:
        return WHOLE_MODEL
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"{type(model).__qualname__}.parallel_spec is {type(spec).__name__}, not a ModelSpec")
    return spec


def default_parameter_roles(
    model: nn.Module, after_blocks: Iterable[str], experts: Iterable[nn.Parameter] = ()
) -> dict[str, str]:
    """Roles by parameter name: expert (in ``experts``), embedding (an ``nn.Embedding``'s), head (a linear layer's
    among the ``after_blocks`` children), norm (a normalisation layer's), bias, matrix (any other parameter of 2 or
    more dimensions: the hidden matrices) or vector (the rest). A tied head is named once, as the embedding."""
    expert_ids = {id(param) for param in experts}
    heads = {
        id(param)
        for child in after_blocks
        if model._modules.get(child) is not None
        for module in model.get_submodule(child).modules()
        if isinstance(module, nn.Linear)
        for param in module.parameters(recurse=False)
    }
    owners: dict[int, nn.Module] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), module)
    roles = {}
    for name, param in model.named_parameters():
        owner = owners[id(param)]
        if id(param) in expert_ids:
            roles[name] = "expert"
        elif isinstance(owner, nn.Embedding):
            roles[name] = "embedding"
        elif id(param) in heads:
            roles[name] = "head"
        elif _is_norm(owner):
            roles[name] = "norm"
        elif name.rsplit(".", 1)[-1] == "bias":
            roles[name] = "bias"
        else:
            roles[name] = "matrix" if param.dim() >= 2 else "vector"
    return roles


def _is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer: torch's, or any class whose name says so (RMSNorm, LlamaRMSNorm)."""
    torch_norms = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
    return isinstance(module, torch_norms) or "norm" in type(module).__name__.lower()


def _shallow_copy_along(model: nn.Module, path: str) -> nn.Module:
    """A copy of ``model`` sharing every parameter, whose modules along ``path`` (inclusive) are copies too, so that
    children can be removed from the copy without touching ``model``."""
    root = _module_copy(model)
    parent = root
    for name in path.split("."):
        child = _module_copy(parent._modules[name])
        parent._modules[name] = child
        parent = child
    return root


def _module_copy(module: nn.Module) -> nn.Module:
    """A new module object over the same children, parameters and buffers, whose own tables (children, parameters,
    buffers, hooks) are copies: a child removed or a hook (FSDP's, a user's) registered on it stays on it."""
    duplicate = copy.copy(module)
    for name, value in vars(module).items():
        if name.startswith("_") and isinstance(value, dict):
            setattr(duplicate, name, copy.copy(value))  # keeps OrderedDict and the hooks' dict types
    return duplicate
