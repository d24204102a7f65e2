"""Fault injection for tests of failure handling: ``DISTRAIN_INJECT_FAULT=<kind>:<rank>:<step>[:<point>]``, and a
slow rank for tests of straggler detection: ``DISTRAIN_INJECT_DELAY=<rank>:<seconds>`` (a sleep in every step).

Kinds: ``raise`` (an exception in that rank), ``kill`` (SIGKILL to itself), ``stop`` (SIGSTOP to itself: a rank
that stops responding) or ``spin`` (an endless loop, as a bug in user code would be). Points: ``step`` (default:
after optimizer step ``step`` completed on rank ``rank``), ``save`` (while checkpoint ``step`` is being written: its
shards are on disk, its manifest is not) or ``update`` (in the middle of applying step ``step``'s update). Read
once per process and never fired in a restarted attempt; unset in normal use, where the check is one comparison.
"""

from __future__ import annotations

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


_FAULT = _parse(os.environ.get(ENV_VAR))
_DELAY = tuple(float(x) for x in os.environ[DELAY_ENV_VAR].split(":")) if os.environ.get(DELAY_ENV_VAR) else None


def maybe_inject_delay(rank: int) -> None:
    """Sleep in this step if this rank is the one configured to be slow (counted as its compute time)."""
    if _DELAY is not None and rank == int(_DELAY[0]):
        time.sleep(_DELAY[1])


def maybe_inject_fault(rank: int, step: int, point: str = "step") -> None:
    """Fire the configured fault if this is its rank, step and point (and not a restarted attempt)."""
    if _FAULT is None or (rank, step, point) != _FAULT[1:] or restarted_attempt():
        return
    if _FAULT[0] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if _FAULT[0] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    while _FAULT[0] == "spin":
        pass
    raise InjectedFault(f"injected fault on rank {rank} {_WHEN[point]} {step}")
