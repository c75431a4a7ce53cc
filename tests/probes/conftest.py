"""The tiny-preset probe matrix, run once per session through ``drifttool probe`` (in-process).

Every test in this folder reads the same output directory: ``matrix.json`` (the results), the
per-probe diff reports and run directories, and the heatmaps.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from drifttool.cli.app import app


@pytest.fixture(scope="session")
def matrix_run(tmp_path_factory):
    """(exit code, console output, output dir, matrix.json as a dict)."""
    out = tmp_path_factory.mktemp("probe") / "tiny"
    res = CliRunner().invoke(app, ["probe", "--preset", "tiny", "-o", str(out)],
                             catch_exceptions=False)
    data = json.loads((out / "matrix.json").read_text())
    return res.exit_code, res.output, out, data


@pytest.fixture(scope="session")
def results(matrix_run):
    """``{probe name: result dict}``."""
    return {r["name"]: r for r in matrix_run[3]["results"]}
