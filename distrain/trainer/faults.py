"""Fault injection for tests of failure handling: ``DISTRAIN_INJECT_FAULT=<kind>:<rank>:<step>[:<point>]``, and a
slow rank for tests of straggler detection: ``DISTRAIN_INJECT_DELAY=<rank>:<seconds>`` (a sleep in every step).

Kinds: ``raise`` (an exception in that rank), ``kill`` (SIGKILL to itself), ``stop`` (SIGSTOP to itself: a rank
that stops responding) or ``spin`` (an endless loop, as a bug in user code would be). Points: ``step`` (default:
after optimizer step ``step`` completed on rank ``rank``), ``save`` (while checkpoint ``step`` is being written: its
shards are on disk, its manifest is not) or ``update`` (in the middle of applying step ``step``'s update). Read
once per process, at first use, and never fired in a restarted attempt; unset in normal use, where the check is one
comparison.
"""

from __future__ import annotations

import functools
import os
import signal
import time

from distrain.launch.ranks import restarted_attempt

ENV_VAR = "DISTRAIN_INJECT_FAULT"
DELAY_ENV_VAR = "DISTRAIN_INJECT_DELAY"
_WHEN = {"step": "after step", "save": "while saving checkpoint", "update": "while applying the update of step"}
POINTS = tuple(_WHEN)
KINDS = ("raise", "kill", "stop", "spin")


class InjectedFault(RuntimeError):
    """The exception raised by an injected ``raise`` fault."""


def _parse(spec: str | None) -> tuple[str, int, int, str] | None:
    if not spec:
        return None
    kind, rank, step, *point = spec.split(":")
    point = point[0] if point else "step"
    if kind not in KINDS or point not in POINTS:
        raise ValueError(f"{ENV_VAR}={spec!r}: expected {'|'.join(KINDS)}:<rank>:<step>[:{'|'.join(POINTS)}]")
    return kind, int(rank), int(step), point


@functools.cache
def _configured() -> tuple[tuple[str, int, int, str] | None, tuple[float, ...] | None]:
    """The fault and the delay, read at their first use in this process (not at import: a process forked from an
    interpreter that imported this module, as the tests' warm one is, still reads its own environment)."""
    delay = os.environ.get(DELAY_ENV_VAR)
    return _parse(os.environ.get(ENV_VAR)), tuple(float(x) for x in delay.split(":")) if delay else None


def maybe_inject_delay(rank: int) -> None:
    """Sleep in this step if this rank is the one configured to be slow (counted as its compute time)."""
    delay = _configured()[1]
    if delay is not None and rank == int(delay[0]):
        time.sleep(delay[1])


def maybe_inject_fault(rank: int, step: int, point: str = "step") -> None:
    """Fire the configured fault if this is its rank, step and point (and not a restarted attempt)."""
    fault = _configured()[0]
    if fault is None or (rank, step, point) != fault[1:] or restarted_attempt():
        return
    if fault[0] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault[0] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    while fault[0] == "spin":
        pass
    raise InjectedFault(f"injected fault on rank {rank} {_WHEN[point]} {step}")
