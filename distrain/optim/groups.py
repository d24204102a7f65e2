"""Parameter groups by rule: which parameters decay, which learning-rate multiplier each gets, which Muon updates.

A *rule* is either a role (``ROLES``: what the model spec says a parameter is, ``ModelSpec.parameter_roles``) or an
``fnmatch`` glob over the parameter's name in the unwrapped model (``layers.0.*``, ``*.wq.weight``). For the
learning rate a glob wins over a role; two globs naming one parameter are an error. A glob naming no parameter is a
warning (a misspelt role is such a glob); a role this model has no parameter of is not. Roles are
resolved once on the unwrapped model; optimizers built later over a wrapped or sharded model (DDP's ``module.``
prefix, compile's and activation checkpointing's wrappers, FSDP's and tensor parallelism's DTensors, pipeline
stages, which keep the full model's names) find each parameter's role by its canonical name.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from torch import nn

from distrain.errors import RunError

ROLES = ("embedding", "head", "norm", "bias", "matrix", "expert", "vector")
# Module names wrappers insert between a model's own names: compile, activation checkpointing, FSDP1.
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
GROUPS_FILE = "param_groups.json"
log = logging.getLogger("distrain.train")


class GroupRuleError(RunError, ValueError):
    """A parameter two ``optimizer.lr_multipliers`` rules claim, or a Muon rule naming a non-matrix parameter."""

    def __init__(self, key: str, rule: str, allowed: str) -> None:
        self.key, self.rule, self.allowed = key, rule, allowed
        super().__init__(f"{key}: rule {rule!r}: {allowed}")


def canonical_name(name: str) -> str:
    """``name`` as in the unwrapped model: DDP's leading ``module.`` and wrapper segments removed."""
    parts = name.split(".")
    if parts[0] == "module":
        parts = parts[1:]
    return ".".join(part for part in parts if part not in WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class GroupRules:
    """The optimizer's rules (``optimizer.weight_decay``, ``no_decay``, ``lr_multipliers`` and Muon's ``muon``)."""

    weight_decay: float
    no_decay: tuple[str, ...] = ()
    lr_multipliers: Mapping[str, float] = None  # type: ignore[assignment]
    muon: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "no_decay", tuple(self.no_decay))
        object.__setattr__(self, "muon", tuple(self.muon))
        object.__setattr__(self, "lr_multipliers", dict(self.lr_multipliers or {}))

    def all_rules(self) -> list[tuple[str, str]]:
        """(config key, rule) for every rule, in config order."""
        keys = [("optimizer.no_decay", r) for r in self.no_decay]
        keys += [("optimizer.lr_multipliers", r) for r in self.lr_multipliers]
        return keys + [("optimizer.muon", r) for r in self.muon]


@dataclass(frozen=True)
class GroupKey:
    """What a parameter's group is; parameters with equal keys share a torch parameter group. Whether a group
    decays, not the decay's value, tells groups apart: a checkpoint's groups stay the same when
    ``optimizer.weight_decay`` changes (or is 0)."""

    decays: bool
    lr_rule: str | None  # the lr_multipliers rule that matched (None: none did)
    lr_multiplier: float
    muon: bool

    @property
    def label(self) -> str:
        parts = ["muon"] if self.muon else []
        parts.append("decay" if self.decays else "no_decay")
        if self.lr_rule is not None:
            parts.append(f"lr x{self.lr_multiplier:g} ({self.lr_rule})")
        return ", ".join(parts)


def matches(rule: str, name: str, role: str) -> bool:
    """Whether ``rule`` (a role or a glob over names) names the parameter ``name`` of role ``role``."""
    return rule == role if rule in ROLES else fnmatchcase(name, rule)


def lr_rule_of(name: str, role: str, rules: GroupRules) -> str | None:
    """The ``lr_multipliers`` rule that sets the learning rate of parameter ``name`` of ``role``: a glob naming it
    (more specific, so it wins over the role), else its role if listed; None: neither. Two globs naming one
    parameter put it in two groups: an error."""
    globs = [rule for rule in rules.lr_multipliers if rule not in ROLES and fnmatchcase(name, rule)]
    if len(globs) > 1:
        raise GroupRuleError(
            "optimizer.lr_multipliers",
            globs[1],
            f"parameter {name} is also named by rule {globs[0]!r}; a parameter is in one learning-rate group: "
            "make the globs disjoint",
        )
    if globs:
        return globs[0]
    return role if role in rules.lr_multipliers else None


def group_key(name: str, role: str, ndim: int, rules: GroupRules) -> GroupKey:
    """The group of parameter ``name`` (canonical) of ``role`` and ``ndim`` dimensions under ``rules``."""
    muon = any(matches(rule, name, role) for rule in rules.muon)
    if muon and ndim < 2:
        rule = next(rule for rule in rules.muon if matches(rule, name, role))
        raise GroupRuleError(
            "optimizer.muon",
            rule,
            f"it names parameter {name} ({role}, {ndim}-D); Muon updates matrices (or stacks of them): name roles "
            "matrix, expert, head or embedding, or globs over matrices",
        )
    lr_rule = lr_rule_of(name, role, rules)
    multiplier = float(rules.lr_multipliers[lr_rule]) if lr_rule else 1.0
    return GroupKey(
        decays=not any(matches(rule, name, role) for rule in rules.no_decay),
        lr_rule=lr_rule if multiplier != 1.0 else None,
        lr_multiplier=multiplier,
        muon=muon,
    )


def role_of(name: str, roles: Mapping[str, str]) -> str:
    """The role of the (possibly wrapped) parameter ``name``, from the roles of the unwrapped model."""
    canonical = canonical_name(name)
    if canonical not in roles:
        raise KeyError(f"parameter {name} (as {canonical}) is not in the model's roles; a wrapper renamed it")
    return roles[canonical]


def param_groups(
    named_parameters: Iterable[tuple[str, nn.Parameter]], roles: Mapping[str, str], rules: GroupRules, lr: float
) -> list[dict[str, Any]]:
    """torch parameter groups for this rank's trainable parameters: one per ``GroupKey``, in order of first use,
    each with its ``weight_decay`` and ``lr`` (``lr * lr_multiplier``), plus ``lr_multiplier`` where it is not 1 and
    ``use_muon`` where Muon updates the group. Keys are added only where needed, so a checkpoint of the earlier
    fixed groups (matrices decay, vectors do not) still loads. Frozen parameters are left out."""
    groups: dict[GroupKey, dict[str, Any]] = {}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        key = group_key(canonical_name(name), role_of(name, roles), param.dim(), rules)
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": rules.weight_decay if key.decays else 0.0}
            if key.lr_multiplier != 1.0:
                groups[key] |= {"lr": lr * key.lr_multiplier, "lr_multiplier": key.lr_multiplier}
            if key.muon:
                groups[key]["use_muon"] = True
        groups[key]["params"].append(param)
    return list(groups.values())


def base_lr(optimizer: Any) -> float:
    """The schedule's current learning rate without any group's multiplier."""
    group = optimizer.param_groups[0]
    return float(group["lr"]) / float(group.get("lr_multiplier", 1.0))


KERNEL_KEYS = ("fused", "foreach")  # torch's choice of update kernel, stored in every param group


@contextlib.contextmanager
def kernels_kept(optimizer: Any) -> Iterator[None]:
    """Load a checkpoint inside this: the kernel the optimizer was built with stays. A saved param group carries
    the kernel choice of the layout that saved it (or of a version before fused AdamW), and loading it would switch
    this layout's, e.g. the fused kernel onto sharded DTensors it was not chosen for."""
    kept = [{key: group[key] for key in KERNEL_KEYS if key in group} for group in optimizer.param_groups]
    yield
    for group, kernels in zip(optimizer.param_groups, kept, strict=True):
        group.update(kernels)


@dataclass
class GroupSummary:
    """One resolved group of the whole model, as printed at start and saved in the run directory."""

    group: str
    rules: list[str]
    tensors: int
    parameters: int
    names: list[str]


def resolve(model: nn.Module, roles: Mapping[str, str], rules: GroupRules) -> tuple[list[GroupSummary], list[str]]:
    """The groups of the whole (unwrapped) model under ``rules`` and one warning per rule matching no parameter.
    Raises ``GroupRuleError`` for a parameter in two learning-rate groups or a Muon rule on a vector."""
    by_key: dict[GroupKey, GroupSummary] = {}
    used: set[tuple[str, str]] = set()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        role = roles[name]
        key = group_key(name, role, param.dim(), rules)
        hits = [(k, r) for k, r in rules.all_rules() if matches(r, name, role)]
        used.update(hits)
        # In the table, only the learning-rate rule that applies (a role at its default 1 is none).
        hits = [(k, r) for k, r in hits if k != "optimizer.lr_multipliers" or r == key.lr_rule]
        summary = by_key.setdefault(key, GroupSummary(key.label, [], 0, 0, []))
        summary.rules += [rule for _, rule in hits if rule not in summary.rules]
        summary.tensors += 1
        summary.parameters += param.numel()
        summary.names.append(name)
    warnings = [
        f"{key}: rule {rule!r} matches no parameter: it is not a role ({', '.join(ROLES)}), so it is a glob over "
        "parameter names (e.g. layers.0.* or *.wq.weight) and none has such a name"
        for key, rule in rules.all_rules()
        if (key, rule) not in used and rule not in ROLES  # a role this model lacks (bias in Llama) is not a typo
    ]
    return list(by_key.values()), warnings


def describe(summaries: Sequence[GroupSummary], optimizer_name: str) -> str:
    """The groups as a table for the start-up log."""
    rows = [(s.group, ", ".join(s.rules) or "(default)", f"{s.tensors}", f"{s.parameters:,}") for s in summaries]
    header = ("group", "rules", "tensors", "parameters")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    lines = [f"parameter groups ({optimizer_name}):"]
    for row in [header, *rows]:
        lines.append(
            "  "
            + "  ".join(
                cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def save(summaries: Sequence[GroupSummary], run_dir: str) -> Path:
    """``<run_dir>/param_groups.json``: every group with its rules, counts and parameter names."""
    path = Path(run_dir) / GROUPS_FILE
    path.write_text(json.dumps([s.__dict__ for s in summaries], indent=1))
    return path


def announce(model: nn.Module, roles: Mapping[str, str], rules: GroupRules, optimizer_name: str, run_dir: str) -> None:
    """Log the whole model's groups as a table and save them in ``run_dir`` (a rule matching nothing was warned
    about once, by validation before any rank started)."""
    summaries, _ = resolve(model, roles, rules)
    log.info(describe(summaries, optimizer_name))
    save(summaries, run_dir)
