"""No code recognises an option of a config group by its name outside that option's own package: it asks what the
option declares (``distrain.parallelism.capabilities``) instead. The scan is itself tested on snippets it must flag
and snippets it must pass."""

from __future__ import annotations

import ast

from helpers import REPO

# A config group -> the package that owns its options (where comparing their names is the option's own business).
OWNERS = {
    "parallelism": "distrain/parallelism",
    "comm": "distrain/comm",
    "optimizer": "distrain/optim",
    "precision": "distrain/precision",
    "logger": "distrain/trackers",
    "checkpoint": "distrain/checkpoint",
    "model": "distrain/models",
    "data": "distrain/data",
}
# Names a strategy object is held under: getattr(strategy, "name") == "zero" is the same test.
STRATEGY_NAMES = {"strategy", "parallelism"}


def _group_of(node: ast.expr) -> str | None:
    """The config group whose option name ``node`` reads: ``cfg.parallelism.name``, ``saved.comm.name``,
    ``parallelism.name``, ``cfg["precision"]["name"]``, ``getattr(strategy, "name", None)``."""
    if isinstance(node, ast.Attribute) and node.attr == "name":
        base = node.value
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "name":
        base = node.value
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "name"
    ):
        base = node.args[0]
    else:
        return None
    if isinstance(base, ast.Attribute):
        word = base.attr
    elif isinstance(base, ast.Name):
        word = base.id
    elif isinstance(base, ast.Subscript) and isinstance(base.slice, ast.Constant):
        word = str(base.slice.value)
    else:
        return None
    return "parallelism" if word in STRATEGY_NAMES else word if word in OWNERS else None


def _target_group(node: ast.expr) -> str | None:
    """The config group whose ``_target_`` ``node`` reads (``cfg.optimizer._target_``), else None."""
    if isinstance(node, ast.Attribute) and node.attr == "_target_":
        base = node.value
        word = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else None
        return "parallelism" if word in STRATEGY_NAMES else word if word in OWNERS else None
    return None


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, group) of every recognition of a config group's option by name: its ``name`` compared (``==``,
    ``!=``, ``in``, ``not in``), or its ``_target_`` compared with a string or tested with ``endswith``/``startswith``
    (two targets compared with each other, a saved run's and this one's, recognise nothing)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            for side in sides:
                if group := _group_of(side):
                    found.append((node.lineno, group))
                elif (group := _target_group(side)) and any(isinstance(s, ast.Constant) for s in sides):
                    found.append((node.lineno, group))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("endswith", "startswith") and (group := _target_group(node.func.value)):
                found.append((node.lineno, group))
    return found


def test_no_option_is_recognised_by_name_outside_its_own_package():
    offenders = []
    for path in sorted((REPO / "distrain").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        for line, group in name_comparisons(path.read_text()):
            if not relative.startswith(OWNERS[group] + "/"):
                offenders.append(f"{relative}:{line} compares {group}'s option name (ask its capabilities)")
    assert offenders == []


def test_the_scan_flags_name_comparisons_and_passes_capability_questions():
    flagged = [
        'if cfg.parallelism.name == "zero": pass',
        'ok = saved.parallelism.name != "ddp"',
        'x = parallelism.name in ("single", "ddp")',
        'y = getattr(strategy, "name", None) == "zero"',
        'z = cfg.precision.name != "fp32"',
        'w = cfg["comm"]["name"] == "topk"',
        'v = cfg.optimizer._target_.endswith(".sgd")',
        'u = cfg.parallelism._target_ == "distrain.parallelism.zero.ZeroStrategy"',
    ]
    for snippet in flagged:
        assert name_comparisons(snippet), snippet
    passed = [
        "if capabilities_of(cfg.parallelism).one_rank: pass",
        'line = f"parallelism={cfg.parallelism.name}"',
        'same = shard.name == "x.bin"',
        "kept = path.name not in names",
        'dtype = cfg.precision.compute_dtype == "float16"',
        "same = saved.optimizer._target_ != cfg.optimizer._target_",
        'hydra = cfg.hydra.launcher._target_.endswith("SlurmLauncher")',
    ]
    for snippet in passed:
        assert not name_comparisons(snippet), snippet


def test_every_strategy_of_conf_declares_its_capabilities():
    """Each parallelism option's target declares capabilities (not only the defaults by omission)."""
    from omegaconf import OmegaConf

    from distrain.parallelism.capabilities import Capabilities, capabilities_of

    declared = {}
    for option in sorted((REPO / "conf" / "parallelism").glob("*.yaml")):
        text = option.read_text()
        target = next((line.split(":", 1)[1].strip() for line in text.splitlines() if "_target_" in line), None)
        schema = next(line for line in text.splitlines() if "/schema/parallelism/" in line)
        kind = schema.split("/schema/parallelism/")[1].split("@")[0]
        from distrain.config.schema import SCHEMAS

        target = target or SCHEMAS["parallelism"][kind]._target_
        declared[option.stem] = capabilities_of(OmegaConf.create({"_target_": target}))
        assert isinstance(declared[option.stem], Capabilities)
    assert declared["single"].one_rank and not declared["ddp"].one_rank
    assert declared["ddp"].comm_hooks and not declared["fsdp"].comm_hooks
    assert declared["zero"].checkpoint_format == "deepspeed" and declared["fsdp"].checkpoint_format == "dcp"
    assert declared["zero"].zero_stages == (1, 2, 3) and not declared["hybrid"].zero_stages
