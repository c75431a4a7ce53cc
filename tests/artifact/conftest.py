import pytest
from typer.testing import CliRunner

from drifttool.cli.app import app


@pytest.fixture
def cli():
    """Invoke the drifttool CLI in-process; returns (exit_code, stdout + stderr)."""
    runner = CliRunner()

    def invoke(*args: str):
        res = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
        return res.exit_code, res.output

    return invoke
