import pytest


@pytest.fixture(scope="session")
def strict_run(tmp_path_factory):
    """One strict run of the embedded default, shared read-only by tests."""
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    out = tmp_path_factory.mktemp("runs") / "strict"
    execute(RunSpec(), out)
    return out


@pytest.fixture
def runs(strict_run, tmp_path):
    """Two copies of the shared strict run, ``a`` and ``b`` (the shared one stays untouched
    whatever a test writes)."""
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(strict_run, a)
    shutil.copytree(strict_run, b)
    return a, b


@pytest.fixture
def fake_matrix(tmp_path):
    """A probe matrix of four results (PASS, FINDING with a NaN drift, PENDING, ERROR), as
    ``probes.runner.run_matrix`` returns it, without running any probe."""
    from drifttool.probes.runner import Matrix, ProbeResult

    def result(name, status, **kw):
        return ProbeResult(name=name, factor="f", kind="mismatch", change="c", expected="drift",
                           expected_op="op", status=status, **kw)

    return Matrix(out=str(tmp_path / "m"), baseline=str(tmp_path / "m" / "runs" / "baseline"),
                  settings={"fixture": "tiny-t2i"}, seconds=1.5, baseline_seconds=0.5, results=[
                      result("repeat", "PASS", verdict="identical", seconds=0.25),
                      result("gelu_exact", "FINDING", verdict="drift", v_t=float("nan"),
                             first_drift="rollout step 0 cond block 0 img mlp_up_gemm_gelu#0",
                             reasons=["first drift at mlp_up_gemm_gelu, expected final_adaln_out"]),
                      result("fp8", "PENDING", reasons=["needs a GPU"]),
                      result("broken", "ERROR", reasons=["RuntimeError: boom"])])
