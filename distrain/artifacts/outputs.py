"""Inspector of the paths a command will write: output files and directories, and trackers' local stores.

What it establishes, before anything is written: the path can be made (no existing part of it is a file, the
nearest existing directory is writable), it is of the kind the command writes (a file, or a directory) when it
exists, and a file the command did not write is never replaced: the refusal names the file and the flag that
allows replacing it. Nothing here writes or creates anything.
"""

from __future__ import annotations

import os
from pathlib import Path

from distrain.errors import ArtifactError


def check_writable(path: str | Path, *, directory: bool) -> Path:
    """``path`` (resolved) can be written as a ``directory`` (or a file): every existing part of it is a directory,
    the nearest existing one is writable, and ``path`` itself, if it exists, is of that kind."""
    path = Path(path).expanduser().absolute()
    if path.exists():
        if directory and not path.is_dir():
            raise ArtifactError(str(path), "is a file; a directory is written here")
        if not directory and path.is_dir():
            raise ArtifactError(str(path), "is a directory; a file is written here")
        writable = path  # an existing file is written (or appended to) in place
    else:
        writable = nearest_existing(path)
        if not writable.is_dir():
            raise ArtifactError(str(writable), f"is a file, so {path} cannot be created below it")
    if not os.access(writable, os.W_OK | (os.X_OK if writable.is_dir() else 0)):
        raise ArtifactError(str(writable), "is not writable by this user")
    return path


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor or ".")


def refuse_replacing(file: Path, *, writer: str, flag: str) -> None:
    """``file`` would be replaced and ``writer`` did not write it: one line naming it and ``flag``."""
    raise ArtifactError(str(file), f"exists and was not written by {writer}; not replaced (pass {flag} to replace it)")
