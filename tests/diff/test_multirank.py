"""Runs whose records are owned by several ranks (samples split across ranks, as sample-parallel
rollout does) align with single-process runs: identity holds no rank, "first" is the program
position, and the report names the owning rank in each run (issue #9 item 4)."""

from __future__ import annotations

import json

import pyarrow.compute as pc
from rich.console import Console

from drifttool.artifact import open_run
from drifttool.diff import Verdict, diff_runs, render

PLANT = {"step": 1, "block": 1, "op": "joint_attn", "sample": 1, "row": 9, "add": 1e-3}


def _text(report) -> str:
    console = Console(record=True, width=300, color_system=None)
    render(report, console)
    return console.export_text()


def test_two_rank_run_is_identical_to_one_process(make_run):
    a = open_run(make_run("a", owners={0: 0, 1: 1}))
    b = open_run(make_run("b"))
    assert a.manifest["files"]["ops"] == ["ops.rank0.parquet", "ops.rank1.parquet"]
    ops = a.ops_table()
    owned = {(r["sample"], r["rank"]) for r in ops.select(["sample", "rank"]).to_pylist()}
    assert owned == {(0, 0), (1, 1)}  # really split: sample 1 lives on rank 1 only
    assert set(b.ops_table().column("rank").to_pylist()) == {0}
    # the per-rank counters overlap: seq cannot order records across ranks
    seq0 = set(pc.filter(ops["seq"], pc.equal(ops["rank"], 0)).to_pylist())
    seq1 = set(pc.filter(ops["seq"], pc.equal(ops["rank"], 1)).to_pylist())
    assert seq0 & seq1
    for x, y in ((a, b), (b, a)):
        r = diff_runs(x, y)
        assert r.verdict is Verdict.IDENTICAL, r.reason
        assert r.counts["ops"].matched == ops.num_rows and r.counts["ops"].only_a == 0
        assert r.counts["steps"].matched == a.steps_table().num_rows


def test_swapped_owners_are_identical(make_run):
    r = diff_runs(open_run(make_run("a", owners={0: 1, 1: 0})),
                  open_run(make_run("b", owners={0: 0, 1: 1})))
    assert r.verdict is Verdict.IDENTICAL, r.reason


def test_drift_planted_on_rank_1_names_its_owning_rank(make_run):
    a = open_run(make_run("a", owners={0: 0, 1: 1}, plant=PLANT))
    b = open_run(make_run("b"))
    r = diff_runs(a, b)
    assert r.verdict is Verdict.DRIFT
    fd = r.first_drift
    assert (fd.step, fd.block, fd.op, fd.sample, fd.branch) == (1, 1, "joint_attn", 1, "cond")
    assert (fd.rank_a, fd.rank_b) == (1, 0)
    assert fd.origin_kind == "record" and fd.rows.n_differ == 1
    assert "(owning rank 1 in run A, 0 in run B)" in r.reason
    first = json.loads(r.to_json())["first_drift"]
    assert (first["rank_a"], first["rank_b"], first["component"]) == (1, 0, "mmdit")
    out = _text(r)
    assert "│ owning rank │ 1 (run A), 0 (run B)" in out
    assert r.steps[1].first_op.rank == 1
    # the other way round: the single-process run is A
    r2 = diff_runs(b, a)
    assert (r2.first_drift.rank_a, r2.first_drift.rank_b) == (0, 1)
    assert (r2.first_drift.step, r2.first_drift.block, r2.first_drift.op) == (1, 1, "joint_attn")


def test_first_drift_does_not_depend_on_which_rank_owns_which_sample(make_run):
    # two drifts: sample 0 in block 1 and sample 1 in block 0 of step 1; program order puts
    # block 0 first, whichever rank owns sample 1 and whatever its per-rank seq says
    plants = [{"step": 1, "block": 1, "op": "joint_attn", "sample": 0, "row": 9, "add": 1e-3},
              {"step": 1, "block": 0, "op": "txt_mlp", "sample": 1, "row": 1, "add": 1e-3}]
    b = open_run(make_run("b"))
    seen = set()
    for name, owners in (("one", None), ("split", {0: 0, 1: 1}), ("swap", {0: 1, 1: 0}),
                         ("all1", {0: 1, 1: 1})):
        a = open_run(make_run(name, owners=owners, plant=plants))
        fd = diff_runs(a, b).first_drift
        seen.add((fd.step, fd.branch, fd.block, fd.stream, fd.op, fd.sample, fd.origin_kind))
        assert fd.rank_a == (owners or {0: 0, 1: 0})[1] and fd.rank_b == 0
    assert seen == {(1, "cond", 0, "txt", "txt_mlp", 1, "record")}


def test_records_replicated_on_every_rank_are_compared_once(make_run):
    a = open_run(make_run("a", owners={0: 0, 1: 1}, sigma_table=True))
    b = open_run(make_run("b", sigma_table=True))
    assert sorted(a.ops_table().filter(pc.equal(a.ops_table()["sample"], -1))["rank"]
                  .to_pylist()) == [0, 1]
    for x, y, side in ((a, b, "A"), (b, a, "B")):
        r = diff_runs(x, y)
        assert r.verdict is Verdict.IDENTICAL, r.reason
        assert f"run {side}: 1 record replicated on several ranks with equal digests, compared " \
               "once (the lowest rank's)" in r.notes
    # the same run without replicas has no such note
    assert not any("replicated" in n for n in diff_runs(b, b).notes)


def test_replicas_that_disagree_are_reported(make_run):
    a = open_run(make_run("a", owners={0: 0, 1: 1}, sigma_table=True, sigma_bump_rank=1))
    b = open_run(make_run("b", sigma_table=True))
    r = diff_runs(a, b)
    assert r.verdict is not Verdict.IDENTICAL
    assert "run A: 1 records computed on several ranks disagree between the ranks (all kept: " \
           "they pair by occurrence)" in r.notes


def test_equal_positions_on_two_ranks_order_by_sample_not_rank(make_run):
    # one op drifts in both samples; sample 0 lives on rank 1 and sample 1 on rank 0, and both
    # ranks number their records alike (equal seq): the program order names sample 0
    plants = [{"step": 1, "block": 0, "op": "img_mlp", "sample": s, "row": 2, "add": 1e-3}
              for s in (1, 0)]
    b = open_run(make_run("b"))
    for name, owners in (("swap", {0: 1, 1: 0}), ("split", {0: 0, 1: 1})):
        fd = diff_runs(open_run(make_run(name, owners=owners, plant=plants)), b).first_drift
        assert (fd.step, fd.block, fd.op, fd.sample, fd.branch) == (1, 0, "img_mlp", 0, "cond")
        assert (fd.rank_a, fd.rank_b) == (owners[0], 0)
