"""The probe matrix under a launch (``run_matrix(dist=, parallel=)``: what ``torchrun -m drifttool
probe --tp 2`` runs): every run of the matrix on every rank in the layout, rank 0 judging. It
judges as one process does — the same statuses and first-drift operators — for an operator
variant, a transformed checkpoint (written by rank 0), a spec change and the replay control; a
probe the layout refuses (a production mode under TP; a variant of a row-parallel GEMM, whose
tree the TP rule finishes itself) is PENDING with the refusal, never a pass.
"""

from __future__ import annotations

import pytest

from drifttool.distributed.plan import ParallelDims
from drifttool.settings import RunSpec
from drifttool.probes.catalog import IDENTICAL, catalog
from drifttool.probes.runner import PENDING, baseline_settings, run_matrix
from drifttool.probes.spec import Probe
from tests.distributed.plan_ranks import on_ranks

NAMES = ("gelu_exact", "stream_weights_swapped", "cfg_sequential", "replay")
NOT_UNDER_TP = "ulp_img_mlp_down"  # a variant of the row-parallel mlp_down_gemm: refused under TP
REFUSED = Probe(name="production_mode", factor="mode", kind="invariant",
                change="the production family (TP/SP run strict only)", spec={"mode": "auto"},
                expect=IDENTICAL)


def _probes() -> list[Probe]:
    settings, depth, _ = baseline_settings(RunSpec())
    return [p for p in catalog(settings, depth) if p.name in NAMES + (NOT_UNDER_TP,)]


def _rows(matrix) -> dict:
    return {r.name: (r.status, r.first_op, r.verdict) for r in matrix.results}


def matrix_rank(ctx, dims, arg):
    """Rank body: the matrix of ``NAMES`` (plus the refused probe) under ``dims``."""
    m = run_matrix(_probes() + [REFUSED], arg, dist=ctx, parallel=dims)
    if ctx.rank != 0:
        assert m is None
        return None
    assert m.settings["launch"] == "on 2 ranks, tp 2 × sp 1 × cfg 1" and m.settings["layout"]["tp"] == 2
    return _rows(m), {r.name: r.reasons for r in m.results if r.status == PENDING}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _rows(run_matrix(_probes(), tmp_path_factory.mktemp("probes") / "one"))


@pytest.mark.slow  # about 20 s on 2 cores: two probe matrices
def test_matrix_under_tp2_judges_as_one_process(one_process, tmp_path):
    got = on_ranks(ParallelDims(tp=2), "tests.probes.test_probe_launch:matrix_rank", tmp_path / "tp2")
    rows, pending = got[0]
    assert got[1] is None
    assert sorted(pending) == sorted([REFUSED.name, NOT_UNDER_TP]), pending
    assert "TP/SP layouts run the strict family only" in pending[REFUSED.name][0]
    assert "row-parallel mlp_down_gemm" in pending[NOT_UNDER_TP][0]  # refused, never silently dropped
    assert one_process.pop(NOT_UNDER_TP)[0] == "PASS"
    for name in pending:
        rows.pop(name)
    assert rows == one_process and len(rows) == len(NAMES)
    assert all(status == "PASS" for status, _, _ in rows.values()), rows
    assert (tmp_path / "tp2" / "work" / "stream_weights_swapped" / "transformer").is_dir()
