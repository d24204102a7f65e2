"""compile=true on one process: in-place compilation that renames nothing, and graph breaks reported."""

import torch
from torch import nn

from distrain.models.gpt import GPT
from distrain.parallelism.compile import apply_compile, compile_report


class PrintsMidway(nn.Module):
    """A module dynamo cannot trace in one graph: printing is a side effect it leaves to Python."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        print("midway", end="")
        return self.second(x)


def reset_dynamo() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def test_graph_breaks_are_counted_with_their_reason(capsys):
    reset_dynamo()
    model = PrintsMidway()
    model.compile(backend="eager")
    model(torch.randn(2, 8))
    report = compile_report()
    assert report.graphs == 2 and report.graph_breaks == 1, report
    assert "print" in report.break_reasons[0]
    assert "1 graph break(s)" in report.describe() and report.break_reasons[0] in report.describe()


def test_blocks_compile_in_place_to_one_graph_without_breaks_and_keep_names():
    reset_dynamo()
    torch.manual_seed(0)
    model = GPT(vocab_size=64, max_seq_len=16, d_model=32, n_layers=3, n_heads=4)
    names = list(model.state_dict())
    tokens = torch.randint(0, 64, (2, 16))
    eager = model(tokens)
    assert apply_compile(model, "blocks", "aot_eager") == ["blocks.0", "blocks.1", "blocks.2"]
    compiled = model(tokens)
    assert list(model.state_dict()) == names  # checkpoints stay interchangeable with eager runs
    torch.testing.assert_close(compiled, eager)
    report = compile_report()
    assert report.graphs == 1 and report.graph_breaks == 0, report  # every block reuses the first block's graph
