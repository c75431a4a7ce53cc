"""Exception classes.

``DriftToolError`` is a *user* error (bad input, unsupported configuration, unreadable artifact):
the CLI prints its message and exits 2 without a traceback. Anything else is a bug and keeps its
traceback (the split Polygraphy draws between its user-error class and internal errors).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


class DriftToolError(Exception):
    """A user-facing error: bad input, unreadable artifact, unsupported configuration."""


class UnsupportedConfigError(DriftToolError):
    """A strict configuration that drifttool cannot honour (TF32 on, wrong dtype, shape, backend).

    Raised instead of falling back silently (RFC "Unsupported strict configurations fail closed").
    """


class SigmaTableError(UnsupportedConfigError):
    """An image size whose sigma table is not finite (``setting_checks.check_sigma_table``):
    ``why`` (the scheduler's reason) and ``steps`` (the run's step count) for callers that name
    the size another way (an edit run's ``--image-area``)."""

    def __init__(self, message: str, *, why: str, steps: int) -> None:
        super().__init__(message)
        self.why, self.steps = why, steps


class CheckpointError(DriftToolError):
    """A checkpoint whose keys or shapes do not match the model (lists every offending key)."""


class ArtifactError(DriftToolError):
    """A trajectory artifact that is missing, truncated, corrupt or of an unknown schema version."""


class FixtureError(DriftToolError):
    """A sealed fixture that is missing, tampered with, or whose replay does not reproduce."""


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Name ``path`` in an ``OSError`` raised while writing it that names no file: a full disk
    (``ENOSPC``), a quota, an I/O error surface from ``write``, ``flush`` or ``close`` (and from
    pyarrow's writers) without a file name; re-raised as ``OSError(errno, reason, path)`` so the
    CLI prints ``error: PATH: reason`` (``cli._errors``). An error that names its file passes."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e) or type(e).__name__, os.fspath(path)) from e


_LEFT_INCOMPLETE = "drifttool_left_incomplete"
"""Attribute of an exception: the artifact directories it left ``complete: false``."""


def note_left_incomplete(error: BaseException, path: str | os.PathLike) -> None:
    """Record on ``error`` (an interruption or failure that stopped a run) that the artifact at
    ``path`` was closed ``complete: false`` because of it (``left_incomplete`` reads it back)."""
    paths = getattr(error, _LEFT_INCOMPLETE, [])
    if os.fspath(path) not in paths:
        setattr(error, _LEFT_INCOMPLETE, [*paths, os.fspath(path)])


def left_incomplete(error: BaseException) -> list[str]:
    """The artifact directories ``error`` left ``complete: false`` that still exist (a
    temporary re-run removed since is not named), in the order they were closed."""
    return [p for p in getattr(error, _LEFT_INCOMPLETE, []) if os.path.isdir(p)]
