"""The ``optimizer`` group's schemas and the ``scheduler`` block (``distrain.optim``).

Every optimizer takes the same parameter-group rules (``distrain.optim.groups``): ``no_decay`` lists the rules whose
parameters get no weight decay, ``lr_multipliers`` maps a rule to a factor on the learning rate. A rule is a role the
model spec gives a parameter (embedding, head, norm, bias, matrix, expert, vector) or a glob over parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distrain.config.choices import choices
from distrain.optim.groups import ROLES

Decay = choices("Decay", "cosine", "linear", "constant", "wsd")
DecayShape = choices("DecayShape", "linear", "cosine", "1-sqrt")


@dataclass(kw_only=True)
class GroupRulesConfig:
    """Parameter groups by rule, shared by every optimizer."""

    weight_decay: float = 0.0
    no_decay: list[str] = field(default_factory=lambda: ["norm", "bias"])  # rules whose parameters never decay
    # rule -> factor on the learning rate. Every role is listed (at 1) so that `optimizer.lr_multipliers.head=0.5`
    # needs no `+`; a glob is added in YAML or as `+optimizer.lr_multipliers.<glob>=<factor>`.
    lr_multipliers: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROLES, 1.0))


@dataclass(kw_only=True)
class AdamWConfig(GroupRulesConfig):
    """AdamW with decoupled weight decay (on every parameter but those ``no_decay`` names)."""

    _target_: str = "distrain.optim.optimizers.adamw"
    _partial_: bool = True
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass(kw_only=True)
class SGDConfig(GroupRulesConfig):
    _target_: str = "distrain.optim.optimizers.sgd"
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False


@dataclass(kw_only=True)
class MuonConfig(AdamWConfig):
    """Muon for the parameters the ``muon`` rules name (default: the hidden matrices), AdamW for the rest, in one
    optimizer. Muon's update is scaled to AdamW's update RMS (``0.2 * sqrt(max(rows, cols))``), so both share ``lr``
    and ``weight_decay`` and the schedule."""

    _target_: str = "distrain.optim.optimizers.muon"
    muon: list[str] = field(default_factory=lambda: ["matrix"])  # rules whose (2-D) parameters Muon updates
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    bucket_mb: float = 32.0  # matrices are exchanged in buckets of about this many MiB per rank


@dataclass(kw_only=True)
class SchedulerConfig:
    """Linear warm-up, then a decay to ``min_lr_ratio * lr`` at ``trainer.max_steps``: cosine, linear, none
    (constant) or wsd (constant until the last ``decay_fraction`` of the steps, then ``decay_shape``)."""

    _target_: str = "distrain.optim.schedule.warmup_decay_schedule"
    _partial_: bool = True
    warmup_steps: int = 20
    decay: Decay = Decay.cosine  # cosine | linear | constant | wsd
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: the share of trainer.max_steps spent decaying
    decay_shape: DecayShape = DecayShape.linear  # wsd: linear | cosine | 1-sqrt
