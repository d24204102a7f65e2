"""The code base stays ruff-clean (lint rules and formatting from pyproject.toml)."""

import shutil
import subprocess

import pytest
from helpers import REPO


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_ruff(command):
    ruff = shutil.which("ruff") or pytest.skip("ruff not installed (pip install -e '.[test]')")
    result = subprocess.run([ruff, *command], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
