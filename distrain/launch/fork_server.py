"""The server CPU ranks fork from (multiprocessing's ``forkserver``), safe against the signals a job receives.

Ranks are not forked from the launcher itself: its elastic agent serves the rendezvous store from a thread while
ranks start, and a child forked while another thread holds a lock can hang or crash. The fork server is a fresh
single-threaded interpreter that imports ``distrain.trainer.rank`` once, so each rank starts in milliseconds.

The server also imports ``distrain.launch.fork_server_signals``, which makes it ignore the stop signals a scheduler may
send to every process of a job (SLURM's ``--signal`` and ``scancel --signal``, ``timeout``, a process-group kill):
killed, the server would take its children's exit-status pipes with it, and the launcher would take live ranks,
still saving a checkpoint, for dead ones. It still exits by itself when the launcher does. Each rank restores the
default actions (:func:`restore_stop_signals`) before installing its own handlers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

# What the launcher forwards to its ranks (SIGINT aside: the server ignores it already, as multiprocessing does).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_started_with: dict[str, str] | None = None  # this process's environment when it started the server


def restore_stop_signals() -> None:
    """The default action for every stop signal (a forked rank inherits the server's ignoring them), and Python's
    KeyboardInterrupt for SIGINT (which a server started with SIGINT ignored, as in a background job, passes on)."""
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def start_fork_server(entrypoint: Callable[..., Any]) -> None:
    """Start the server ranks fork from, importing this module, ``distrain.trainer.rank`` and ``entrypoint``'s module.

    Once per process while the environment stays as it is: the server and its ranks keep the environment it started
    with, so a later call with another environment (the next job of a multirun run in this process, with its own
    ``hydra.job.env_set``) restarts it.
    """
    global _started_with
    environment = dict(os.environ)
    if _started_with is not None and _started_with != environment:
        forkserver._forkserver._stop()
    modules = ["distrain.launch.fork_server_signals", "distrain.trainer.rank", entrypoint.__module__]
    multiprocessing.set_forkserver_preload(list(dict.fromkeys(modules)))
    forkserver.ensure_running()
    _started_with = environment


def shadowing_package(cwd: Path | None = None) -> str | None:
    """Why the ranks would run another distrain than this launcher, or None: a ``distrain/`` package in the working
    directory (an older checkout) that is not this one. The fork server puts the working directory first on its
    module path (Python 3.11's forkserver does not take the launcher's), so its ranks would import that copy."""
    here = Path(__file__).resolve().parents[1]
    found = (cwd or Path.cwd()) / "distrain"
    if not (found / "__init__.py").is_file() or found.resolve() == here:
        return None
    return (
        f"the working directory holds another distrain package ({found}), which the ranks would import instead of "
        f"this launcher's ({here}); run train.py from another directory, or from that checkout"
    )
