"""Muon under DeepSpeed ZeRO: distrain's Muon groups handed to DeepSpeed's own ``MuonWithAuxAdam``.

DeepSpeed does the distributed work itself. ZeRO 1/2: the reduced gradient of a Muon matrix is copied whole to
every rank whose partition holds part of it, which orthogonalises it (momentum kept per partition) while filling its
flat gradient partition; ZeRO-3 does the same in its per-sub-group update. The optimizer step then applies weight
decay and the update to the fp32 partitions; the other parameters get ``torch.optim.AdamW`` on theirs.

Two conventions differ from distrain's Muon and are folded into the groups so that one ``optimizer.lr`` means the
same under every strategy. DeepSpeed scales an orthogonalised update by ``sqrt(max(1, rows / cols))`` (Keller
Jordan's convention), distrain by ``0.2 * sqrt(max(rows, cols))``: each matrix shape gets its own group whose ``lr``
carries the ratio (and ``lr_multiplier`` with it, so the logged base rate stays ``optimizer.lr``), and whose
``weight_decay`` is divided by it, so the decay per step, ``lr * weight_decay``, is distrain's. DeepSpeed's
Newton-Schulz (``ns_method="standard"``: the same quintic, 5 steps, Nesterov) runs in bf16 wherever its accelerator
supports bf16, CPU included, where distrain's runs in fp32: losses agree with distrain's Muon to bf16 precision,
not to fp32's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from distrain.optim.muon import Muon, update_scale

DEEPSPEED_NS_STEPS = 5  # fixed in DeepSpeed's ZeRO paths
ADAMW_KEYS = ("betas", "eps")


def deepspeed_scale(shape: torch.Size) -> float:
    """The factor DeepSpeed's Muon applies to an orthogonalised update of this shape."""
    rows, cols = shape[-2], shape[-1]
    return math.sqrt(rows / cols) if rows > cols else 1.0


def deepspeed_muon(optimizer: Muon) -> Any:
    """DeepSpeed's ``MuonWithAuxAdam`` over ``optimizer``'s parameters, groups and hyperparameters (before any
    step: ``optimizer``'s state is not carried over). Muon parameters are tagged ``use_muon``, which is how ZeRO
    finds them."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    groups = []
    for group in optimizer.param_groups:
        multiplier = group.get("lr_multiplier", 1.0)
        if not group["use_muon"]:
            groups.append(_group(group, group["params"], multiplier, use_muon=False))
            continue
        by_shape: dict[torch.Size, list[torch.nn.Parameter]] = {}
        for param in group["params"]:
            by_shape.setdefault(param.shape, []).append(param)
        for shape, params in by_shape.items():
            ratio = update_scale(shape) / deepspeed_scale(shape)
            groups.append(_group(group, params, multiplier * ratio, use_muon=True, decay_ratio=ratio))
    for group in groups:
        for param in group["params"]:
            param.use_muon = group["use_muon"]
    return MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW)


def _group(
    group: dict[str, Any], params: list[Any], multiplier: float, *, use_muon: bool, decay_ratio: float = 1.0
) -> dict[str, Any]:
    base_lr = group["lr"] / group.get("lr_multiplier", 1.0)
    made = {
        "params": params,
        "use_muon": use_muon,
        "lr": base_lr * multiplier,
        "weight_decay": group["weight_decay"] / decay_ratio,
    }
    if multiplier != 1.0:
        made["lr_multiplier"] = multiplier
    if use_muon:
        return made | {"momentum": group["momentum"], "ns_method": "standard"}
    return made | {key: group[key] for key in ADAMW_KEYS}
