"""Trajectory artifact: Arrow schemas (``schema``), ``writer`` and ``reader``.

See ``drifttool.artifact.schema`` for the directory layout (design.md, "Artifact").
"""

from drifttool.artifact.reader import Run, open_run
from drifttool.artifact.schema import SCHEMA_VERSION
from drifttool.artifact.writer import ArtifactWriter

__all__ = ["ArtifactWriter", "Run", "SCHEMA_VERSION", "open_run"]
