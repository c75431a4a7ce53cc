"""Rendered report: the lines a person reads (verdict, first drift, per step)."""

from __future__ import annotations

from rich.console import Console

from drifttool.artifact import open_run
from drifttool.diff import diff_runs, render


def text(report) -> str:
    console = Console(record=True, width=200, color_system=None)
    render(report, console)
    return console.export_text()


def test_render_drift(make_run):
    plant = {"step": 1, "block": 1, "op": "joint_attn", "sample": 1, "row": 9, "add": 1e-3}
    out = text(diff_runs(open_run(make_run("a")), open_run(make_run("b", plant=plant))))
    lines = out.splitlines()
    assert lines[0].startswith("DRIFT  first drift at rollout step 1 cond block 1 joint "
                               "joint_attn#0 sample 1 (owning rank 0); origin (every earlier record "
                               "matches)")
    assert "│ rows        │ 1 of 11 differ: img (1, 1)" in out
    assert "│ origin      │ yes (every earlier record matches)" in out
    step_rows = [ln.split() for ln in lines if ln.strip().split()[:1] in (["0"], ["1"], ["2"])]
    assert step_rows[0][:9] == ["0", "1", "=", "=", "=", "=", "=", "0", "0"]
    assert step_rows[1][:3] == ["1", "0.667", "="] and step_rows[2][2] == "0.000333"  # carried
    assert ["rollout", "1", "=", "cond", "1", "joint", "joint_attn#0", "1"] in [
        ln.split() for ln in lines]
    assert ["rollout", "2", "≠", "cond", "0", "img", "img_mlp#0", "1"] in [
        ln.split() for ln in lines]


def test_render_identical_and_incomparable(make_run):
    out = text(diff_runs(open_run(make_run("a")), open_run(make_run("b"))))
    assert out.startswith("IDENTICAL  identical at L2: step records, operator outputs and their "
                          "row digests; all 120 records are bitwise identical")
    fp = {"arch": {"depth": 3}, "weights": "w0"}
    out = text(diff_runs(open_run(make_run("c")), open_run(make_run("d", fingerprint=fp))))
    assert out.startswith("INCOMPARABLE  cannot align: fingerprint.arch.depth: 2 != 3")
    assert "  - fingerprint.arch.dim: 8 != <missing>" in out


def test_headline_names_the_level_the_verdict_covers(make_run):
    # a change absorbed before any step boundary is invisible at L0: say what was compared
    plant = {"step": 0, "block": 0, "op": "txt_mlp", "sample": 0, "row": 2}
    a, b = make_run("a", level="L0"), make_run("b", level="L0", plant=plant)
    out = text(diff_runs(open_run(a), open_run(b)))
    assert out.splitlines()[0] == ("IDENTICAL  identical at L0: step boundaries only; all 48 "
                                   "records are bitwise identical")
    out = text(diff_runs(open_run(make_run("c", level="L1")), open_run(make_run("d"))))
    assert out.splitlines()[0] == (
        "IDENTICAL  identical at L1: step records and operator outputs, without row digests; "
        "all 120 records are bitwise identical")
    r = diff_runs(open_run(make_run("e", level="L0")), open_run(make_run("f", crash_after=2)))
    assert r.to_dict()["covers"] == "step boundaries only" and r.to_dict()["level"] == "L0"
    assert r.reason.startswith("no drift at L0: step boundaries only in 32 common records, but "
                               "run B is incomplete")
