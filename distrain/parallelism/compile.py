"""``compile=true``: torch.compile of every transformer block (default) or of the whole model.

``apply_compile`` runs once on the unwrapped model, after activation checkpointing and before any strategy wraps
it, and compiles in place (``nn.Module.compile``), so no module or parameter is renamed and checkpoints stay
interchangeable with eager runs. Compilation is lazy: the first forward traces each compiled module as it is then,
inside tensor parallelism's DTensor hooks and after FSDP's parameter all-gather hooks (which dynamo runs eagerly,
outside the graph). That is torchtitan's order (tensor parallelism, activation checkpointing, compile, FSDP) without
re-wrapping anything. Compiling per block lets every block reuse one graph (parameters are graph inputs), keeps
FSDP's per-block all-gathers between graphs, and compiles in seconds; ``compile_scope=model`` traces the whole
model at once (under DDP its gradients are then ready only when the whole backward graph ends: no overlap).

Strategies whose engine owns the module's execution (DeepSpeed's ZeRO hooks, pipeline schedules) declare
``compile_unsupported``; train.py then warns and runs them eagerly.

Graph breaks (places where dynamo had to fall back to Python) are counted by dynamo per process;
``compile_report`` reads them after training and train.py logs them and writes them to summary.json.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass

from torch import nn

from distrain.models.spec import spec_of


def apply_compile(model: nn.Module, scope: str, backend: str) -> list[str]:
    """Compile ``model``'s blocks (``scope="blocks"``: its spec's units, the whole model when the spec names no
    blocks) or ``model`` itself in place with ``backend``; returns the module paths of the compiled modules."""
    if scope == "model":
        model.compile(backend=backend)
        return [""]
    spec = spec_of(model)
    for block in spec.units(model):
        block.compile(backend=backend)
    return spec.unit_names(model)


def backend_problem(backend: str, device_type: str) -> str | None:
    """Why ``backend`` cannot compile here (None when it can): unknown backends, and inductor on CPU without the
    C++ compiler it generates kernels for."""
    import torch._dynamo

    if backend not in torch._dynamo.list_backends(exclude_tags=()):  # debug ones (eager, aot_eager) included
        return f"a torch.compile backend: one of {', '.join(sorted(torch._dynamo.list_backends()))}, aot_eager, eager"
    if backend == "inductor" and device_type == "cpu" and not (shutil.which("g++") or shutil.which("c++")):
        return "a backend that needs no C++ compiler (aot_eager): inductor on cpu compiles C++ and no g++ is installed"
    return None


@dataclass(frozen=True)
class CompileReport:
    """What dynamo did in this process: graphs compiled, graph breaks and their most frequent reasons."""

    graphs: int
    graph_breaks: int
    break_reasons: list[str]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        text = f"torch.compile: {self.graphs} graph(s), {self.graph_breaks} graph break(s)"
        return text + "".join(f"\n  graph break: {reason}" for reason in self.break_reasons)


def compile_report(max_reasons: int = 10) -> CompileReport:
    """Graphs and graph breaks dynamo has recorded in this process so far (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    reasons = [_one_line(reason) for reason, _ in breaks.most_common(max_reasons)]
    return CompileReport(
        graphs=int(counters["stats"]["unique_graphs"]), graph_breaks=sum(breaks.values()), break_reasons=reasons
    )


def _one_line(reason: str) -> str:
    """Dynamo's headline plus its explanation, when it gives one: the headline alone rarely names the culprit."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
    if explanation is None:
        return lines[0] if lines else reason
    return f"{lines[0]}: {explanation.removeprefix('Explanation:').strip()}"
