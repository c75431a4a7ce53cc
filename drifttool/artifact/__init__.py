"""Trajectory artifact: Arrow schemas (``schema``), writer and reader. See ``schema`` for the layout."""

from drifttool.artifact.reader import Run, open_run
from drifttool.artifact.schema import SCHEMA_VERSION
from drifttool.artifact.writer import ArtifactWriter

__all__ = ["ArtifactWriter", "Run", "SCHEMA_VERSION", "open_run"]
