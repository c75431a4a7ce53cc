"""diff_runs on synthetic runs: identical, planted drift located exactly, incomparable,
inconclusive, levels, alignment independent of position."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest
import torch

from drifttool.artifact import open_run
from drifttool.artifact import schema as S
from drifttool.artifact.writer import ArtifactWriter
from drifttool.diff import DiffReport, Verdict, diff_runs, exit_code
from drifttool.diff.location import RowRef

from diff_synthetic_runs import ARCH


def diff(a, b) -> DiffReport:
    return diff_runs(open_run(a), open_run(b))


def test_identical(make_run):
    r = diff(make_run("a"), make_run("b"))
    assert r.verdict is Verdict.IDENTICAL and r.exit_code == 0
    assert r.first_drift is None and r.context == []
    assert r.counts["ops"].matched == r.counts["ops"].a == 3 * 2 * 2 * 3 * 2  # steps*cfg*blk*ops*B
    assert r.counts["ops"].differ == 0 and r.counts["steps"].differ == 0
    assert r.identical_through == ("rollout", 2)
    assert all(s.identical and s.carried_in is False for s in r.steps)


def test_a_run_against_itself_is_identical_and_says_so(make_run, tmp_path):
    a = make_run("a")
    (tmp_path / "link").symlink_to(a)
    for other in (a, tmp_path / "link", tmp_path / "a" / ".." / "a"):
        r = diff(a, other)
        assert r.verdict is Verdict.IDENTICAL and r.exit_code == 0
        assert r.notes[0].startswith("run A and run B are the same directory"), r.notes
    assert not any("same directory" in n for n in diff(a, make_run("b")).notes)


def test_planted_image_row_located_exactly(make_run):
    # sample 1, joint row 5 + 4 = image patch n=4 -> (i, j) = divmod(4, 3) = (1, 1)
    plant = {"step": 1, "block": 1, "op": "joint_attn", "sample": 1, "row": 5 + 4, "add": 1e-3}
    r = diff(make_run("a"), make_run("b", plant=plant))
    assert r.verdict is Verdict.DRIFT and r.exit_code == 1
    fd = r.first_drift
    assert (fd.kind, fd.phase, fd.step, fd.branch, fd.block, fd.stream, fd.op, fd.call, fd.sample,
            fd.rank_a, fd.rank_b) == ("op", "rollout", 1, "cond", 1, "joint", "joint_attn", 0, 1, 0, 0)
    assert fd.origin
    assert fd.rows.n_differ == 1 and fd.rows.n_rows == 5 + 6
    assert fd.rows.first == [RowRef(row=9, kind="img", i=1, j=1)]
    step0, step1, step2 = r.steps
    assert step0.identical and not step1.identical
    assert step1.carried_in is False  # born in step 1 ...
    assert step2.carried_in is True  # ... and carried into step 2 through x_t
    assert (step1.first_op.block, step1.first_op.op, step1.first_op.branch) == (1, "joint_attn",
                                                                               "cond")
    assert r.identical_through == ("rollout", 0)
    v = step1.worst("v_t")
    # both CFG branches carry the +1e-3, so v = uncond + 4 (cond - uncond) moves by 1e-3
    assert v.identical is False and v.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert v.rel_l2 > 0


def test_one_ulp_absorbed_downstream_is_still_found(make_run):
    # a 1-ULP change in the last block can round away in x_next: the op record still shows it
    plant = {"step": 1, "block": 1, "op": "joint_attn", "sample": 1, "row": 9}
    r = diff(make_run("a"), make_run("b", plant=plant))
    assert r.verdict is Verdict.DRIFT and r.first_drift.rows.n_differ == 1
    assert r.steps[1].worst("v_t").identical is False


def test_planted_text_row_located(make_run):
    plant = {"step": 0, "block": 0, "op": "txt_mlp", "sample": 0, "row": 2}
    r = diff(make_run("a"), make_run("b", plant=plant))
    fd = r.first_drift
    assert (fd.step, fd.block, fd.stream, fd.op, fd.sample) == (0, 0, "txt", "txt_mlp", 0)
    assert fd.rows.first == [RowRef(row=2, kind="txt", pos=2)] and fd.rows.n_rows == 3


def test_drift_in_padding_is_invisible(make_run):
    # sample 0 has 3 valid text rows; row 4 of its txt output is padding, dropped by the layout
    plant = {"step": 0, "block": 0, "op": "txt_mlp", "sample": 0, "row": 4}
    r = diff(make_run("a"), make_run("b", plant=plant))
    assert r.verdict is Verdict.IDENTICAL


def test_l1_drift_has_no_rows(make_run):
    plant = {"step": 1, "block": 0, "op": "img_mlp", "sample": 0, "row": 0}
    r = diff(make_run("a", level="L1"), make_run("b", level="L1", plant=plant))
    assert r.verdict is Verdict.DRIFT and r.first_drift.op == "img_mlp"
    assert r.first_drift.rows is None
    assert any("row digests not compared" in n for n in r.notes)


def test_mixed_levels_compare_at_common_level(make_run):
    plant = {"step": 1, "block": 0, "op": "img_mlp", "sample": 0, "row": 0}
    r = diff(make_run("a", level="L2"), make_run("b", level="L1", plant=plant))
    assert r.level == "L1" and "capture_level: L2 != L1" in r.context
    assert r.first_drift.op == "img_mlp" and r.first_drift.rows is None
    # L0 against L2: ops cannot be compared, the step records still locate the drift
    r = diff(make_run("c", level="L0"), make_run("d", level="L2", plant=plant))
    assert "ops" not in r.counts and r.first_drift.kind == "step"
    assert (r.first_drift.step, r.first_drift.op) == (1, "v_t")


def test_step_only_drift_noise(make_run):
    r = diff(make_run("a", level="L0"), make_run("b", level="L0", noise_seed=2))
    assert r.verdict is Verdict.DRIFT
    fd = r.first_drift
    assert (fd.kind, fd.step, fd.op, fd.branch, fd.sample) == ("step", 0, "x_next", "cfg", 0)
    assert "inputs.noise: differs (dtype, shape or bytes)" in r.context
    kl0 = r.steps[0].kl
    assert [k.kl for k in kl0] == [0.0, 0.0]  # mu does not depend on this step's noise
    assert r.steps[1].carried_in is True


def test_kl_formula(make_run):
    plant = {"step": 0, "block": 1, "op": "joint_attn", "sample": 1, "row": 7, "add": 1e-3}
    a, b = make_run("a"), make_run("b", plant=plant)
    r = diff(a, b)
    ta, tb = open_run(a).steps_table().to_pylist(), open_run(b).steps_table().to_pylist()

    def get(rows, q, sample):
        row = next(x for x in rows if (x["step"], x["quantity"], x["sample"], x["branch"])
                   == (0, q, sample, "cfg"))
        return torch.frombuffer(bytearray(row["data"]), dtype=torch.float32).double(), row

    mu_a, row = get(ta, "mu", 1)
    mu_b, _ = get(tb, "mu", 1)
    std_t, _ = get(ta, "std_t", 1)
    s = float(std_t) * math.sqrt(row["sigma"] - row["sigma_next"])
    want = float(((mu_a - mu_b) ** 2).mean()) / (2 * s * s)
    kl = {k.sample: k for k in r.steps[0].kl}
    assert want > 0 and kl[1].kl == pytest.approx(want, rel=1e-12)
    assert kl[1].noise_scale == pytest.approx(s) and kl[0].kl == 0.0
    x = r.steps[0].worst("x_next")
    assert x.max_abs == pytest.approx(float((mu_a - mu_b).abs().max()), rel=1e-6)


def test_incomparable_arch_names_field(make_run):
    other = {"arch": {**ARCH, "depth": 60}, "weights": "w0", "scheduler": {"num_steps": 3}}
    r = diff(make_run("a"), make_run("b", fingerprint=other))
    assert r.verdict is Verdict.INCOMPARABLE and r.exit_code == 3
    assert r.incomparable == ["fingerprint.arch.depth: 2 != 60"]
    assert "fingerprint.arch.depth" in r.reason and r.steps == []


def test_other_fingerprint_fields_listed_but_diffed(make_run):
    other = {"arch": dict(ARCH), "weights": "w1", "scheduler": {"num_steps": 3}}
    r = diff(make_run("a"), make_run("b", fingerprint=other))
    assert r.verdict is Verdict.IDENTICAL
    assert r.context == ['fingerprint.weights: "w0" != "w1"']


def test_incomparable_schema_version(make_run, monkeypatch):
    a, b = make_run("a"), make_run("b")
    m = json.loads((b / "manifest.json").read_text())
    v = S.SCHEMA_VERSION
    m["schema_version"] = v + 1
    (b / "manifest.json").write_text(json.dumps(m))
    monkeypatch.setattr(S, "SUPPORTED_SCHEMA_VERSIONS", frozenset({v, v + 1}))
    r = diff(a, b)
    assert r.verdict is Verdict.INCOMPARABLE and r.incomparable == [f"schema_version: {v} != {v + 1}"]


def test_incomparable_unknown_level(make_run):
    a, b = make_run("a"), make_run("b")
    m = json.loads((b / "manifest.json").read_text())
    del m["capture_level"]
    (b / "manifest.json").write_text(json.dumps(m))
    r = diff(a, b)
    assert r.verdict is Verdict.INCOMPARABLE and "capture_level of run B" in r.incomparable[0]


def test_inconclusive_truncated_run(make_run):
    a, b = make_run("a"), make_run("b", crash_after=2)
    ops = b / "ops.rank0.arrows"  # a crashed run keeps its streams
    ops.write_bytes(ops.read_bytes()[:-50])  # cut inside the last (step 1) batch
    r = diff(a, b)
    assert r.verdict is Verdict.INCONCLUSIVE and exit_code(r.verdict) == 3
    assert r.identical_through == ("rollout", 0)  # step 1 lost its op records
    assert "identical through rollout step 0" in r.reason and "run B is incomplete" in r.reason
    assert any("ops.rank0.arrows: truncated after 1 complete batch (" in n for n in r.notes), r.notes
    assert r.counts["ops"].only_a > 0 and r.counts["ops"].only_b == 0


def test_inconclusive_missing_tail(make_run):
    r = diff(make_run("a"), make_run("b", crash_after=2))
    assert r.verdict is Verdict.INCONCLUSIVE and r.identical_through == ("rollout", 1)
    assert r.steps[2].missing == r.counts["ops"].only_a + r.counts["steps"].only_a


def test_inconclusive_when_incomplete_even_if_records_match(make_run):
    r = diff(make_run("a", crash_after=2), make_run("b", crash_after=2))
    assert r.counts["ops"].only_a == r.counts["ops"].only_b == 0
    assert r.verdict is Verdict.INCONCLUSIVE and r.identical_through == ("rollout", 1)
    assert "run A is incomplete" in r.reason


def test_drift_before_truncation_is_drift(make_run):
    plant = {"step": 0, "block": 1, "op": "img_mlp", "sample": 0, "row": 3}
    r = diff(make_run("a"), make_run("b", crash_after=2, plant=plant))
    assert r.verdict is Verdict.DRIFT and r.first_drift.origin
    assert r.first_drift.step == 0 and r.first_drift.op == "img_mlp"


def _rewrite(src, dst, transform):
    """Copy run ``src`` to ``dst`` with its op table transformed (through the writer)."""
    run = open_run(src)
    w = ArtifactWriter(dst, manifest={k: v for k, v in run.manifest.items()
                                      if k not in ("files", "complete", "schema_version")})
    w.write_inputs(run.inputs())
    for batch in transform(run.ops_table()).to_batches():
        w.write_ops(batch, rank=0)
    for batch in run.steps_table().to_batches():
        w.write_steps(batch)
    w.write_trace(run.trace_rows())
    w.close(complete=True)
    return dst


def test_alignment_ignores_position(make_run, tmp_path):
    a = make_run("a")
    b = _rewrite(a, tmp_path / "b", lambda t: t.take(pa.array(list(range(t.num_rows))[::-1])))
    r = diff(a, b)
    assert r.verdict is Verdict.IDENTICAL and r.counts["ops"].matched == r.counts["ops"].a


def test_missing_record_is_inconclusive_and_not_positional(make_run, tmp_path):
    a = make_run("a")
    b = _rewrite(a, tmp_path / "b", lambda t: pa.concat_tables([t.slice(0, 5), t.slice(6)]))
    r = diff(a, b)
    assert r.verdict is Verdict.INCONCLUSIVE
    assert (r.counts["ops"].only_a, r.counts["ops"].only_b, r.counts["ops"].differ) == (1, 0, 0)
    assert r.steps[0].missing == 1 and r.identical_through is None


def test_missing_record_before_drift_is_not_called_origin(make_run, tmp_path):
    plant = {"step": 1, "block": 0, "op": "img_mlp", "sample": 0, "row": 1}
    b = make_run("b", plant=plant)
    a = _rewrite(make_run("a"), tmp_path / "a2", lambda t: t.slice(1))  # A lost its first record
    r = diff(a, b)
    assert r.verdict is Verdict.DRIFT and r.first_drift.step == 1
    assert not r.first_drift.origin and "1 unmatched records precede it" in r.reason


def test_json_is_strict_and_complete(make_run):
    plant = {"step": 1, "block": 1, "op": "joint_attn", "sample": 1, "row": 9}
    r = diff(make_run("a"), make_run("b", plant=plant))
    data = json.loads(r.to_json())
    assert data["verdict"] == "drift"
    assert data["first_drift"]["rows"]["first"][0] == {"row": 9, "kind": "img", "pos": None,
                                                       "i": 1, "j": 1}
    assert data["steps"][1]["first_op"]["op"] == "joint_attn"
    assert DiffReport(verdict=Verdict.DRIFT, reason="", run_a="", run_b="",
                      identical_through=None).to_dict()["verdict"] == "drift"


def test_exit_codes():
    assert [exit_code(v) for v in Verdict] == [0, 1, 3, 3]
