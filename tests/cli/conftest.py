import pytest
from typer.testing import CliRunner

from drifttool.cli.app import app


@pytest.fixture
def cli():
    """Invoke the drifttool CLI in-process; returns (exit_code, output)."""
    runner = CliRunner()

    def invoke(*args: str):
        res = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
        return res.exit_code, res.output

    return invoke


@pytest.fixture(scope="session")
def strict_run(tmp_path_factory):
    """One strict run of the embedded default, shared read-only by tests."""
    from drifttool.runner import RunSpec, execute

    out = tmp_path_factory.mktemp("runs") / "strict"
    execute(RunSpec(), out)
    return out
