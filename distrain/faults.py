"""Fault injection for tests of failure handling: ``DISTRAIN_INJECT_FAULT=<kind>:<rank>:<step>``.

Kinds: ``raise`` (an exception in that rank), ``kill`` (SIGKILL to itself), both after optimizer step ``step``
completed on rank ``rank``. Read once per process; unset in normal use, where the check is one comparison.
"""

from __future__ import annotations

import os
import signal

from distrain.launch import restarted_attempt

ENV_VAR = "DISTRAIN_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """The exception raised by an injected ``raise`` fault."""


def _parse(spec: str | None) -> tuple[str, int, int] | None:
    if not spec:
        return None
    kind, rank, step = spec.split(":")
    if kind not in ("raise", "kill"):
        raise ValueError(f"{ENV_VAR}={spec!r}: kind must be raise or kill")
    return kind, int(rank), int(step)


_FAULT = _parse(os.environ.get(ENV_VAR))


def maybe_inject_fault(rank: int, step: int) -> None:
    """Fire the configured fault if this is its rank and step (and it is not a restarted attempt)."""
    if _FAULT is None or (rank, step) != _FAULT[1:] or restarted_attempt():
        return
    if _FAULT[0] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected fault on rank {rank} after step {step}")
