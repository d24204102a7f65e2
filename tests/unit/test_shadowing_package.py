"""A distrain/ package in the working directory that is not the launcher's is refused in one line: the fork
server's ranks would import it instead (Python 3.11's forkserver puts the working directory first)."""

import subprocess
import sys

from helpers import REPO

from distrain.launch.fork_server import shadowing_package


def test_another_checkout_in_the_working_directory_is_named(tmp_path):
    (tmp_path / "distrain").mkdir()
    (tmp_path / "distrain" / "__init__.py").write_text("")
    problem = shadowing_package(tmp_path)
    assert problem is not None and str(tmp_path / "distrain") in problem and "\n" not in problem
    assert shadowing_package(REPO) is None  # the launcher's own checkout
    assert shadowing_package(tmp_path / "distrain") is None  # no package there


def test_train_py_refuses_to_start_ranks_from_there(tmp_path):
    (tmp_path / "distrain").mkdir()
    (tmp_path / "distrain" / "__init__.py").write_text("raise SystemExit('the old copy was imported')\n")
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "data.corpus.max_bytes=200000", "trainer.max_steps=1",
         "distributed.nproc_per_node=2", "logger=none", "checkpoint=none"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "the working directory holds another distrain package" in result.stderr
    assert "Traceback" not in result.stderr
