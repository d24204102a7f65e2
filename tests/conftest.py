"""What every test shares: the marks its folder gives it (``distributed/``: real gloo ranks; ``integration/``:
``train.py`` or a tool in a subprocess; ``unit/``: neither), so ``pytest -m "not distributed and not integration"``
is the fast subset; how tests share pytest-xdist's workers; and the session's tiny Hugging Face Llama, saved once per
worker and only read by the tests using it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import save_tiny_hf_llama

FOLDER_MARKS = {"distributed": pytest.mark.distributed, "integration": pytest.mark.integration}


# Modules whose tests run one after another on one pytest-xdist worker: the SLURM tests share the two-node cluster.
SERIAL_MODULES = {"test_slurm"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        mark = FOLDER_MARKS.get(item.path.parent.name)
        if mark is not None:
            item.add_marker(mark)
        if item.path.stem in SERIAL_MODULES or uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


def uses_module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture made once per module (a prepared run, a warm interpreter): under pytest -n
    (pyproject's default) such tests go to one worker together (``--dist loadgroup``), so the fixture is made once."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info is not None else ()
    return any(chain[-1].scope in ("module", "class", "package") for chain in definitions if chain)


@pytest.fixture(scope="session")
def tiny_hf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ``LlamaForCausalLM`` saved with ``save_pretrained`` (fp32) and its tokenizer; tests must not change it."""
    return save_tiny_hf_llama(tmp_path_factory.mktemp("tiny_hf_llama"))
