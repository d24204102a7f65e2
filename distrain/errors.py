"""Failures with a known cause and a known remedy, reported to the user as one line instead of a traceback.

A rank that raises a ``RunError`` fails the job like any other exception (the launcher stops the other ranks);
train.py then prints ``distrain: <message>`` alone, because the message already says what happened and what to do.
"""

from __future__ import annotations

_RUN_ERROR_NAMES: set[str] = set()
RUN_ERROR_FILE = "run_error_rank{rank}.txt"  # in the run directory: a RunError a rank raised, for the launcher


class RunError(RuntimeError):
    """A failure the user acts on (a full disk, a rank that stopped responding, a checkpoint holding code)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _RUN_ERROR_NAMES.add(cls.__name__)


class CheckpointSpaceError(RunError):
    """The checkpoint directory's file system has too little free space for a checkpoint."""

    def __init__(self, directory: str, needed: str, free_bytes: int, *, during_write: bool) -> None:
        when = "ran out of space while saving" if during_write else "has too little free space for"
        super().__init__(
            f"checkpoint directory {directory} {when} a checkpoint: it needs {needed} bytes, {free_bytes:,} are "
            "free; the previous checkpoint is kept (free space, then resume with checkpoint.resume=auto)"
        )


class ArtifactError(RunError, ValueError):
    """A file or directory a user handed us that cannot be used: ``where`` (its path, or the config key or flag
    that named it), what is wrong with it. Raised by the inspectors of ``distrain.artifacts`` before any rank
    starts; raised inside a rank (data found damaged while reading it) it ends the job with this one line."""

    def __init__(self, where: str, problem: str) -> None:
        self.where, self.problem = str(where), problem
        super().__init__(f"{where}: {problem}")


class UnresponsiveRankError(RunError):
    """A peer stopped taking part in collectives (stopped, hung, or spinning in user code)."""


def run_error_line(message: str) -> str | None:
    """The user-facing line of a failure recorded by the launcher as ``"<ExceptionName>: <text>"``, when the
    exception was a ``RunError``; None for any other failure (whose traceback is then worth showing)."""
    name, _, text = message.partition(": ")
    return text.strip() if name in _RUN_ERROR_NAMES else None


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (its type's name when empty), cut to ``limit`` characters: what a
    one-line report quotes of a library's error."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return line if limit is None else line[:limit]
