"""Trajectory artifact: Arrow schemas (``schema``), ``writer`` and ``reader``.

See ``drifttool.artifact.schema`` for the directory layout (design.md, "Artifact").
"""

from drifttool.artifact.reader import Run, open_run
from drifttool.artifact.schema import SCHEMA_VERSION

__all__ = ["ArtifactWriter", "Run", "SCHEMA_VERSION", "open_run"]


def __getattr__(name: str):
    """``ArtifactWriter`` is imported on first use: it needs torch, and reading (``diff``,
    ``trace``) must not pay for importing it."""
    if name == "ArtifactWriter":
        from drifttool.artifact.writer import ArtifactWriter  # lazy: reading needs no torch

        return ArtifactWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
