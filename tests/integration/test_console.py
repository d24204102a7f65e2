"""The progress bar on a terminal: log lines and a failure's report are drawn whole above it, never onto it.
(What a default run prints without a terminal is checked on the README's default run, in test_train_py.py.)"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading

import pytest
from helpers import FAST, REPO

pytestmark = [pytest.mark.integration, pytest.mark.distributed]


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
