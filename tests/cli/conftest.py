import pytest


@pytest.fixture(scope="session")
def strict_run(tmp_path_factory):
    """One strict run of the embedded default, shared read-only by tests."""
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    out = tmp_path_factory.mktemp("runs") / "strict"
    execute(RunSpec(), out)
    return out
