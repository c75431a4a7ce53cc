"""Every rank's part of a TP/SP record is checked (docs/distributed.md, "Every rank checked").

A fault planted in rank 1's own computation (``rank_faults``) of a replicated output — TP rank
1's finish of the row-parallel attention-out GEMM, which rank 0 (the writer) computes right —
is a finding of the faulty run alone: ``diff`` names the operator, block, step and rank 1
("ranks disagree"), against a one-process run and against itself, and exits 1. Under
``--sp-attention ulysses`` a change in rank 1's head slice is named rank 1's (every rank's
digest partial of the attention output is kept; a run of the same layout shows whose differs).
"""

from __future__ import annotations

import pytest

from drifttool.artifact import open_run
from drifttool.diff import diff_runs
from drifttool.distributed.plan import ParallelDims as P
from tests.distributed.layout_runs import run_one
from tests.distributed.rank_faults import run_planted

FIELDS = dict(batch=1, steps=2, capture="L1")
SP_FIELDS = dict(FIELDS, height=16 * 4, width=16 * 32)  # 128 image rows: one 64-row block per SP rank


@pytest.fixture(scope="module")
def tp_fault(tmp_path_factory):
    return run_planted(P(tp=2), tmp_path_factory.mktemp("tp_fault") / "bad", FIELDS, "attn_out_rank1")


def test_ranks_that_disagree_are_a_finding_of_one_run(tp_fault, cli):
    report = diff_runs(open_run(tp_fault), open_run(tp_fault))
    fd = report.first_drift
    assert report.verdict.value == "drift", report.reason
    assert (fd.op, fd.block, fd.step, fd.branch, fd.sample) == \
        ("attn_out_bias_gemm", 0, 0, "cond", 0), report.reason
    assert fd.owner_a == fd.owner_b == 1 and fd.disagree_b == [1] and fd.origin_kind == "ranks"
    rec = [r for r in open_run(tp_fault).ops_table().to_pylist()
           if (r["op"], r["block"], r["step"], r["stream"], r["branch"]) ==
           ("attn_out_bias_gemm", 0, 0, "img", "cond")][0]
    assert rec["rank_disagree"] == [1] and len(rec["rank_digests"]) == 2
    assert rec["rank_digests"][0] != rec["rank_digests"][1]
    code, out = cli("diff", tp_fault, tp_fault)
    assert code == 1 and "ranks disagree at rollout step 0 cond block 0 img attn_out_bias_gemm" \
        in " ".join(out.split()), out


def test_rank1_fault_in_a_replicated_output_names_rank_1(tp_fault, tmp_path):
    report = diff_runs(open_run(run_one(tmp_path / "one", None, FIELDS)), open_run(tp_fault))
    fd = report.first_drift
    assert report.verdict.value == "drift", report.reason
    assert (fd.op, fd.block, fd.step, fd.branch, fd.sample) == \
        ("attn_out_bias_gemm", 0, 0, "cond", 0), report.reason
    assert fd.disagree_b == [1] and fd.owner_b == 1 and fd.rank_b == 0
    assert fd.origin_kind == "ranks" and fd.origin
    assert report.reason.startswith(
        "ranks disagree at rollout step 0 cond block 0 img attn_out_bias_gemm#0 sample 0 (owning "
        "rank 0 in run A, 1 in run B; ranks disagree in run B: rank 1 ≠ rank 0, its writer)"), \
        report.reason


@pytest.mark.slow
def test_ulysses_head_slice_fault_is_rank_1s(tmp_path):
    dims = P(sp=2, sp_attention="ulysses")
    clean = run_planted(dims, tmp_path / "clean", SP_FIELDS, "")
    bad = run_planted(dims, tmp_path / "bad", SP_FIELDS, "ulysses_rank1")
    report = diff_runs(open_run(clean), open_run(bad))
    fd = report.first_drift
    assert (fd.op, fd.block, fd.step, fd.stream) == ("joint_attention_fused", 0, 0, "joint"), report.reason
    assert "owning rank 1; the rank whose part of it differs; written by rank 0" in report.reason, \
        report.reason
    assert fd.part_rank_b == 1 and fd.owner_b == 1 and fd.rank_b == 0 and fd.origin
    # against one process (no partials to compare) the writer is named, and the note says why
    alone = diff_runs(open_run(run_one(tmp_path / "one", None, SP_FIELDS)), open_run(bad))
    assert alone.first_drift.op == "joint_attention_fused" and alone.first_drift.part_rank_b is None
    assert any(n.startswith("run B: under --sp-attention ulysses every SP rank computed its heads")
               for n in alone.notes), alone.notes


@pytest.mark.slow
def test_sp_rank1_copy_of_the_text_rows_is_checked(tmp_path):
    bad = open_run(run_planted(P(sp=2), tmp_path / "bad", SP_FIELDS, "agrs_text_rank1"))
    report = diff_runs(bad, bad)
    fd = report.first_drift
    assert (fd.op, fd.block, fd.step, fd.stream) == ("joint_attention_fused", 0, 0, "joint"), \
        report.reason
    assert fd.disagree_b == [1] and fd.owner_b == 1 and fd.origin_kind == "ranks"
