"""What every test shares: the marks its folder gives it (``distributed/``: real gloo ranks; ``integration/``:
``train.py`` or a tool in a subprocess; ``unit/``: neither), so ``pytest -m "not distributed and not integration"``
is the fast subset; and the session's tiny Hugging Face Llama, saved once per worker, only read by its tests.

``pytest`` runs on two pytest-xdist workers with ``--dist loadscope`` (pyproject's addopts): a module's tests run
together on one worker, so a module-scoped fixture (a prepared run, a warm interpreter) is made once and the
SLURM tests share the two-node cluster one at a time. Session fixtures are made once per worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import save_tiny_hf_llama

FOLDER_MARKS = {"distributed": pytest.mark.distributed, "integration": pytest.mark.integration}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        mark = FOLDER_MARKS.get(item.path.parent.name)
        if mark is not None:
            item.add_marker(mark)


@pytest.fixture(scope="session")
def tiny_hf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ``LlamaForCausalLM`` saved with ``save_pretrained`` (fp32) and its tokenizer; tests must not change it."""
    return save_tiny_hf_llama(tmp_path_factory.mktemp("tiny_hf_llama"))
