"""benchmarks/peers.py runs: the minimal DDP loop, Lightning and Accelerate train the same thing (same model, data,
seeds and schedule: identical final losses), distrain the same model and optimizer on its own sampler."""

import re
import subprocess
import sys

import pytest
from helpers import REPO


def test_peers_benchmark_trains_the_same_model_under_every_framework(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    command = [sys.executable, str(REPO / "benchmarks" / "peers.py"), "--steps", "24", "--out-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "peers.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| ") and "x |" in line]
    losses = {row.split(" | ")[0].strip("| "): float(row.rsplit("|", 2)[1]) for row in rows}
    assert len(losses) == 4, losses
    peers = [loss for name, loss in losses.items() if not name.startswith("distrain")]
    assert max(peers) - min(peers) < 1e-3, losses  # one training, three frameworks
    distrain = next(loss for name, loss in losses.items() if name.startswith("distrain"))
    assert abs(distrain - peers[0]) < 0.1 * peers[0], losses  # same model and optimizer, its own sampler
    ratios = [float(value) for value in re.findall(r"\| ([0-9.]+)x", "\n".join(rows))]
    assert len(ratios) == 8 and all(ratio > 0 for ratio in ratios)
    assert (tmp_path / "peers.png").exists()
