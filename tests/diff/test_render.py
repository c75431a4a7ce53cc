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
    rep = diff_runs(open_run(make_run("c")), open_run(make_run("d", plant=plant)))
    ops, steps = rep.counts["ops"], rep.counts["steps"]
    assert 0 < ops.differ < ops.matched and 0 < steps.differ < steps.matched  # paired: equal or not
    assert (f"records: steps {steps.matched} paired ({steps.matched - steps.differ} equal, "
            f"{steps.differ} differ), 0 only A, 0 only B; ops {ops.matched} paired "
            f"({ops.matched - ops.differ} equal, {ops.differ} differ), 0 only A, 0 only B") in out
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


def _step(step, missing=0, sigma=0.5):
    from drifttool.diff.report import StepDrift

    return StepDrift(phase="rollout", step=step, sigma=sigma, sigma_next=0.25,
                     identical=not missing, carried_in=None, first_op=None, ops_differ=0,
                     missing=missing)


def test_per_step_legend_explains_step_minus_one_and_one_run_only_cells():
    """The records made before the first step (step -1) show as ``before 0``, their sigma as
    ``-`` (it was ``-1`` and ``nan``), and the legend says what they are."""
    from drifttool.diff.report import DiffReport, Verdict

    def rendered(steps):
        return text(DiffReport(verdict=Verdict.INCONCLUSIVE, reason="r", run_a="a", run_b="b",
                               steps=steps))

    plain = rendered([_step(0), _step(1)])
    assert "step before 0:" not in plain and "N+M?" not in plain
    out = rendered([_step(-1, sigma=float("nan")), _step(0), _step(1, missing=3)])
    lines = out.splitlines()
    row = next(ln.split() for ln in lines if ln.split()[:1] == ["1"])
    assert row[-1] == "0+3?"
    before = next(ln.split() for ln in lines if ln.split()[:2] == ["before", "0"])
    assert before[2] == "-" and "nan" not in out
    table_end = max(i for i, ln in enumerate(lines) if ln.split()[:1] in (["before"], ["0"], ["1"]))
    legend = [ln.strip() for ln in lines[table_end + 1:] if ln.strip()]
    assert legend[0].startswith("step before 0: records made before the first step (the sigma table")
    assert legend[1].startswith("ops ≠ N+M?: N differing operator records, and M records")
    assert "step before 0:" not in rendered([_step(0, missing=1)])


def test_a_footnote_belongs_to_a_marked_cell(make_run):
    """Notes under the per-step table ("* quantity: note") are those of the cells shown (the worst
    sample and branch), each marked "*"; a note on a record the table does not show is left out."""
    plant = {"step": 1, "block": 1, "op": "joint_attn", "sample": 1, "row": 9, "add": 1e-3}
    rep = diff_runs(open_run(make_run("a")), open_run(make_run("b", plant=plant)))
    shown = rep.steps[2].worst("v_t")
    hidden = next(q for s in rep.steps for q in s.quantities
                  if q.identical is False and q is not s.worst(q.quantity))
    shown.note, hidden.note = "a planted note", "a hidden note"
    out = text(rep)
    assert "  * v_t: a planted note" in out and "a hidden note" not in out, out
    row = next(ln.split() for ln in out.splitlines() if ln.split()[:1] == ["2"])
    assert row[3].endswith("*"), row


def test_context_lines_say_null_and_missing_in_the_manifests_words():
    """A recorded null reads ``null`` (JSON's word; not Python's ``None``), an absent key
    ``<missing>``."""
    from drifttool.diff.context import dict_differences

    lines = dict_differences({"inputs": {"cpu": None, "gone": 1}}, {"inputs": {"cpu": "AVX512"}}, "fp")
    assert lines == ['fp.inputs.cpu: null != "AVX512"', "fp.inputs.gone: 1 != <missing>"], lines
