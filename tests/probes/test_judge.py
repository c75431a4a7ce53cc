"""A failed expectation is a finding, reported and turned into a non-zero exit, never hidden."""

from __future__ import annotations

import pytest

from drifttool.diff.report import DiffReport
from drifttool.fixture import load_fixture
from drifttool.probes.catalog import probe
from drifttool.probes.runner import ERROR, FINDING, Matrix, judge, run_probe
from drifttool.probes.spec import Expectation
from drifttool.settings import RunSpec

# The whole tiny probe matrix (one session fixture, 1–3 min on 2 cores): .ci/run's slow step.
pytestmark = pytest.mark.slow

FIXTURE_MODEL = load_fixture("tiny-t2i").model_dir


def _report(matrix_run, name) -> DiffReport:
    from drifttool.artifact.reader import open_run
    from drifttool.diff.compare import diff_runs

    out = matrix_run[2]
    return diff_runs(open_run(out / "runs" / "baseline"), open_run(out / "runs" / name))


def test_wrong_operator_wrong_row_and_unexpected_drift_are_findings(matrix_run):
    rep = _report(matrix_run, "gelu_exact")
    p = probe("gelu_exact")
    assert judge(p, rep) == []
    wrong = p.with_(expect=Expectation(verdict="drift", op="mlp_down_gemm", block=1))
    why = judge(wrong, rep)
    assert any("expected mlp_down_gemm" in w for w in why) and any("block 0" in w for w in why)
    as_control = probe("repeat").with_(name="gelu_as_control")
    assert "expected identical, got drift" in judge(as_control, rep)[0]
    s = probe("ulp_img_mlp_down")
    rows = s.with_(expect=Expectation(verdict="drift", op="mlp_down_gemm", rows=("img (0, 0)",)))
    assert "differing rows" in judge(rows, _report(matrix_run, "ulp_img_mlp_down"))[0]


def test_a_finding_is_reported_with_its_reasons(matrix_run, tmp_path):
    out = matrix_run[2]
    bad = probe("qk_norm_no_gain").with_(
        expect=Expectation(verdict="drift", op="multi_axis_rope"))
    r = run_probe(bad, RunSpec(), out / "runs" / "baseline", tmp_path, FIXTURE_MODEL)
    assert r.status == FINDING and not r.ok and r.first_op == "qk_rmsnorm"
    assert "first drift at qk_rmsnorm, expected multi_axis_rope" in r.reasons


def test_a_probe_that_raises_is_an_error_finding(matrix_run, tmp_path):
    def broken():
        raise RuntimeError("variant exploded")

    p = probe("gelu_exact").with_(name="broken", variants={"mlp_up_gemm_gelu": ("broken", broken)})
    r = run_probe(p, RunSpec(), matrix_run[2] / "runs" / "baseline", tmp_path, FIXTURE_MODEL)
    assert r.status == ERROR and not r.ok
    assert "variant exploded" in r.reasons[0]
    m = Matrix(out=str(tmp_path), baseline="b", settings={}, results=[r], seconds=0.0,
               baseline_seconds=0.0)
    assert m.exit_code == 1 and m.findings == [r]
