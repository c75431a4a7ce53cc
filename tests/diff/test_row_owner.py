"""The rank that computed the first differing row (``FirstDrift.row_rank_a/row_rank_b``): in an
SP layout the record is written by SP coordinate 0 from the gathered tensor, but its image rows
were computed by the SP rank of their shard; the diff names that rank, beside the writer."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from drifttool.artifact import open_run
from drifttool.diff import diff_runs, render
from drifttool.diff.location import FirstDrift
from drifttool.diff.owners import mesh_rank, row_owner, sp_row_spans
from drifttool.distributed import plan as plan_mod
from drifttool.distributed import ring
from drifttool.distributed.plan import ParallelDims
from tests.distributed.layout_runs import run_layout, run_one

SP2 = {"kind": "parallel", "tp": 1, "sp": 2, "cfg_parallel": 1, "sp_attention": "agrs",
       "world_size": 2}
IMG = dict(img_h=10, img_w=35)  # 350 image tokens: SP2 shards [0, 192) and [192, 350)


def _rec(stream="img", block=0, rank=0, txt_len=0, **kw):
    return {"stream": stream, "block": block, "rank": rank, "txt_len": txt_len, **IMG, **kw}


def _text(report) -> str:
    console = Console(record=True, width=250, color_system=None)
    render(report, console)
    return console.export_text()


# -- the mapping -------------------------------------------------------------------------------
def test_row_spans_and_mesh_rank_agree_with_the_distributed_package():
    for sp in (1, 2, 4, 8):
        for n in [*range(0, 1300, 13), 6889]:
            assert sp_row_spans(n, sp) == ring.sp_row_spans(n, sp), (n, sp)
    for tp, sp, cfg in ((1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 4, 2), (4, 2, 1)):
        dims = ParallelDims(tp=tp, sp=sp, cfg=cfg)
        for c in range(cfg):
            for s in range(sp):
                for t in range(tp):
                    coords = {"cfg": c, "sp": s, "tp": t}
                    assert mesh_rank(tp, sp, coords) == plan_mod.mesh_rank(dims, coords)


def test_image_rows_map_to_their_sp_shard():
    assert sp_row_spans(350, 2) == [(0, 192), (192, 350)]
    assert row_owner(SP2, _rec(), 0) == 0
    assert row_owner(SP2, _rec(), 191) == 0
    assert row_owner(SP2, _rec(), 192) == 1
    assert row_owner(SP2, _rec(), 349) == 1
    assert row_owner(SP2, _rec(block=-1, op="latent_proj_gemm"), 200) == 1  # img_in
    assert row_owner(SP2, _rec(block=2, op="latent_proj_gemm"), 200) == 1  # proj_out (depth 2)
    sp4 = {**SP2, "sp": 4, "world_size": 4}  # [(0, 128), (128, 192), (192, 320), (320, 350)]
    assert [row_owner(sp4, _rec(), r) for r in (0, 127, 128, 191, 192, 319, 320, 349)] == \
        [0, 0, 1, 1, 2, 2, 3, 3]


def test_joint_rows_are_text_then_image():
    rec = _rec(stream="joint", txt_len=7, op="joint_attn_qk_gemm")  # B.SK: rows = queries
    assert row_owner(SP2, rec, 0) == 0 and row_owner(SP2, rec, 6) == 0  # text: replicated -> SP 0
    assert row_owner(SP2, rec, 7 + 191) == 0
    assert row_owner(SP2, rec, 7 + 192) == 1
    ulysses = {**SP2, "sp_attention": "ulysses"}  # rows traded for heads: no single rank
    assert row_owner(ulysses, rec, 7 + 192) is None
    assert row_owner(ulysses, _rec(), 192) == 1  # the image stream stays row-sharded


def test_cfg_and_tp_coordinates():
    # CFG2 x SP2: the writer of the uncond branch is rank 2 (cfg 1, sp 0); its row 192 is rank 3
    cfg = {**SP2, "cfg_parallel": 2, "world_size": 4}
    assert row_owner(cfg, _rec(rank=2), 192) == 3 and row_owner(cfg, _rec(rank=2), 5) == 2
    assert row_owner(cfg, _rec(rank=0), 192) == 1
    # TP2 x SP2: ranks (sp, tp) = 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1); TP coordinate 0 is named
    tp = {**SP2, "tp": 2, "world_size": 4}
    assert row_owner(tp, _rec(), 192) == 2 and row_owner(tp, _rec(), 0) == 0


def test_not_applicable_is_none():
    assert row_owner({"kind": "single", "world_size": 1}, _rec(), 200) is None
    assert row_owner(None, _rec(), 200) is None
    assert row_owner({"kind": "parallel", "tp": 2, "sp": 1, "cfg_parallel": 1}, _rec(), 200) is None
    assert row_owner({"kind": "sample_parallel", "world_size": 2}, _rec(), 200) is None
    assert row_owner(SP2, _rec(stream="txt", txt_len=7, img_h=None, img_w=None), 3) is None
    assert row_owner(SP2, _rec(block=-2, op="flow_sde_step_logp"), 200) is None  # sampler
    assert row_owner(SP2, _rec(img_h=None, img_w=None), 200) is None  # no grid: no row map


def _fd(**kw) -> FirstDrift:
    base = dict(kind="op", rank_a=0, rank_b=0, component="mmdit", phase="rollout", step=0,
                sigma=1.0, branch="cond", block=0, op_pos=10, stream="img", op="multi_axis_rope",
                call=0, index=0, role="output", sample=0, dtype=("bfloat16", "bfloat16"),
                shape=([350, 2, 16], [350, 2, 16]), digest=("0", "1"), nonfinite=(0, 0),
                maxabs=(1.0, 1.0), origin=True, origin_kind="record")
    return FirstDrift(**{**base, **kw})


def test_words():
    assert _fd().owning_rank() == "owning rank 0"
    one = _fd(row_rank_b=1)
    assert (one.owner_a, one.owner_b) == (0, 1)
    assert one.owning_rank() == ("owning rank 0 in run A, 1 in run B (run B: the SP rank of its "
                                 "first differing row; written by rank 0)")
    assert one.where().endswith("sample 0 (owning rank 0 in run A, 1 in run B; run B: the SP "
                                "rank of its first differing row; written by rank 0)")
    both = _fd(row_rank_a=1, row_rank_b=1)
    assert both.owning_rank() == ("owning rank 1 (the SP rank of its first differing row; "
                                  "written by rank 0)")


# -- a real SP2 run with a planted fault on rank 1 ---------------------------------------------
FIELDS = dict(batch=1, capture="L2", height=160, width=560, steps=2)  # 10 x 35 patches


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory):
    """(one process, SP2 with ``sp_rope_no_offset``): rank 1 rotates its rows from position 0."""
    root = tmp_path_factory.mktemp("row_owner")
    one = run_one(root / "one", None, FIELDS)
    par = run_layout(ParallelDims(sp=2), root / "sp2", None, FIELDS, faults=("sp_rope_no_offset",))
    return one, par


def test_sp_fault_names_the_rank_that_computed_the_row(sp_runs):
    one, par = sp_runs
    report = diff_runs(open_run(one), open_run(par))
    fd = report.first_drift
    assert report.verdict.value == "drift" and fd.origin_kind == "record"
    assert (fd.op, fd.step, fd.block, fd.stream, fd.branch) == ("multi_axis_rope", 0, 0, "img",
                                                                 "cond")
    # exactly rank 1's rows differ: tokens [192, 350), the first of them patch (5, 17)
    lo, hi = sp_row_spans(350, 2)[1]
    assert (fd.rows.n_rows, fd.rows.n_differ) == (350, hi - lo)
    assert fd.rows.first[0].row == lo and str(fd.rows.first[0]) == "img (5, 17)"
    assert (fd.rank_a, fd.rank_b) == (0, 0)  # both written by rank 0 (SP coordinate 0)
    assert (fd.row_rank_a, fd.row_rank_b) == (None, 1)
    assert "owning rank 0 in run A, 1 in run B; run B: the SP rank of its first differing row; " \
           "written by rank 0" in report.reason
    doc = json.loads(report.to_json())["first_drift"]
    assert (doc["rank_a"], doc["rank_b"], doc["row_rank_a"], doc["row_rank_b"]) == (0, 0, None, 1)
    text = _text(report)
    assert "│ owning rank │ 0 (run A), 1 (run B: SP rank of the first differing row)" in text
    assert "│ written by  │ 0 (run A), 0 (run B)" in text


def test_the_other_direction_and_a_layout_against_itself(sp_runs):
    one, par = sp_runs
    fd = diff_runs(open_run(par), open_run(one)).first_drift
    assert (fd.row_rank_a, fd.row_rank_b, fd.owner_a, fd.owner_b) == (1, None, 1, 0)
    assert diff_runs(open_run(par), open_run(par)).first_drift is None
