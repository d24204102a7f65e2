"""Entry points run as real processes without paying Python's imports each time: a server interpreter imports the
heavy modules once (torch, transformers, hydra, distrain's entry points), then forks one child per run.

Each child is its own process, as ``python train.py ...`` or ``python -m module ...`` would be: its own session
(killed as a group on timeout), working directory, environment, ``sys.argv`` and standard streams (files the caller
reads back), and its exit status; it runs the script or module as ``__main__``. What differs from a cold start is
only that the modules the server imported are already imported, with the environment the server started with: runs
whose environment changes what those modules read at import time must start cold (``helpers.run_in_own_group``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SERVER = r"""
import json, os, runpy, signal, sys, traceback

for name in sys.argv[1:]:
    __import__(name)
status_files = {}  # child pid -> where its exit status goes


def reap(signum, frame):
    # The exit status as subprocess reports it (-N for a signal), written when the child is gone.
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = status_files.pop(pid, None)
        if path:
            with open(path + ".partial", "w") as file:
                file.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".partial", path)


signal.signal(signal.SIGCHLD, reap)


def run(request):
    code = 1
    try:
        os.setsid()
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's handler is not the child's
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        args = request["args"]
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.modules.pop(args[1], None)  # run as __main__ afresh, as `python -m` does (its imports stay)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finish(code)


def finish(code):
    # What interpreter exit does, in its order: wait for the threads left running, run the exit handlers, flush
    # the streams. Not the collection of every object (a second with torch imported): os._exit skips it.
    import atexit, threading

    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # the child cannot be reaped before it is known
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        run(request)
    status_files[pid] = request["status"]
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    sys.stdout.write(f"{pid}\n")
    sys.stdout.flush()
"""


class WarmPython:
    """A server interpreter that has imported ``modules`` with ``env``; ``run`` forks a child per command."""

    def __init__(self, modules: list[str], env: dict[str, str]) -> None:
        self.env = dict(env)
        self.server = subprocess.Popen(
            [sys.executable, "-c", SERVER, *modules],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        self.lock = threading.Lock()
        self.scratch = Path(tempfile.mkdtemp(prefix="warm_python_"))
        self.count = 0

    def run(self, args: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str, str]:
        """``python *args`` in ``cwd`` with ``env``: (exit status, or None when killed after ``timeout``; stdout;
        stderr)."""
        with self.lock:
            self.count += 1
            files = {name: str(self.scratch / f"{self.count}.{name}") for name in ("stdout", "stderr", "status")}
            request = {"args": args, "cwd": str(cwd), "env": env, **files}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            pid = int(self.server.stdout.readline())
        status = Path(files["status"])
        deadline = time.monotonic() + timeout
        code: int | None = None
        try:
            while not status.is_file():  # written by the server once the child has exited
                if time.monotonic() > deadline:
                    _kill_group(pid)
                    break
                time.sleep(0.02)
            else:
                code = int(status.read_text())
            _wait_for_group(pid)
        except BaseException:  # pytest-timeout, Ctrl-C: the child has a session of its own and would live on
            _kill_group(pid)
            raise
        stdout, stderr = (Path(files[name]).read_text(errors="replace") for name in ("stdout", "stderr"))
        return code, stdout, stderr

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)
        shutil.rmtree(self.scratch, ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_for_group(pid: int, timeout: float = 10.0) -> None:
    """Until no process of the child's session is left (a rank it started may outlive it by a moment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    _kill_group(pid)
