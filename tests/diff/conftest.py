"""Fixtures of the diff tests (the run builder lives in ``diff_synthetic_runs``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diff_synthetic_runs import build_run


@pytest.fixture
def make_run(tmp_path):
    """``make_run(name, **kw)`` -> path of a synthetic run under ``tmp_path``."""

    def make(name: str, **kw: Any) -> Path:
        return build_run(tmp_path / name, **kw)

    return make
