"""What a default run prints: one short line of the main numbers per logged step, a small summary table naming the
run directory, no line over 200 characters (the full summary stays in summary.json)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading

import pytest
from helpers import FAST, REPO, run_train

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

MAX_LINE = 200


def test_a_default_run_prints_short_lines_and_a_summary_table(tmp_path):
    env = {"WANDB_MODE": None, "WANDB_API_KEY": None, "HOME": str(tmp_path)}  # the default logger, offline
    result = run_train(["trainer.max_steps=20", "hydra.run.dir=run"], tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    longest = max(lines, key=len)
    assert len(longest) <= MAX_LINE, longest

    step_lines = [line for line in lines if " | loss " in line]
    assert [line.split("step ")[1].split(" |")[0] for line in step_lines] == ["10/20", "20/20"]
    for field in ("lr ", "grad ", " tok/s", "mfu ", "mem ", "eta "):
        assert all(field in line for line in step_lines), field
    assert "val " in step_lines[-1]

    run_dir = (tmp_path / "run").resolve()
    summary = json.loads((run_dir / "summary.json").read_text())
    table = lines[lines.index(next(line for line in lines if "run summary" in line)) :]
    rows = {row.split("  ")[1].strip(): row.split("  ", 2)[2].strip() for row in table[1:] if row.startswith("  ")}
    assert rows["run directory"] == str(run_dir)
    assert rows["val loss"] == f"{summary['final_val_loss']:.4g}"
    assert rows["steps"] == "20"
    assert "metrics" in summary and "model_state_bytes" in summary  # everything else is in the file


def on_a_terminal(args, cwd, env=None, columns=150):
    """``train.py <args>`` with stdout and stderr on a pseudo-terminal ``columns`` wide: (exit code, what it drew)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    drawn = bytearray()

    def read_all():
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed
                return
            if not chunk:
                return
            drawn.extend(chunk)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    process = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args], cwd=cwd, stdin=subprocess.DEVNULL, stdout=follower,
        stderr=follower, env={**os.environ, **(env or {})},
    )  # fmt: skip
    code = process.wait(timeout=300)
    os.close(follower)
    reader.join(timeout=10)
    os.close(leader)
    return code, drawn.decode(errors="replace")


@pytest.mark.parametrize("fault", [None, "raise:0:4"], ids=["completes", "fails"])
def test_on_a_terminal_the_bar_sits_below_whole_log_lines(fault, tmp_path):
    """Every log line, and a failure's report, is drawn on its own line, never glued to the bar's text. One rank,
    in this process: the failure is reported while the bar would still be drawn."""
    args = [*FAST, "parallelism=single", "trainer.max_steps=8", "trainer.log_every=2", "hydra.run.dir=run"]
    code, drawn = on_a_terminal(args, tmp_path, env={"DISTRAIN_INJECT_FAULT": fault} if fault else {})
    assert code == (1 if fault else 0), drawn[-3000:]
    segments = [segment for line in drawn.split("\n") for segment in line.split("\r")]
    assert any("train:" in segment and "it/s" in segment for segment in segments), drawn[-3000:]
    bars = [segment for segment in segments if "it/s" in segment]
    glued = [bar for bar in bars if bar[bar.index("it/s") :].partition("]")[2].strip()]  # text after the bar's end
    assert not glued, glued
    assert sum(" | loss " in segment for segment in segments) == (2 if fault else 4)
