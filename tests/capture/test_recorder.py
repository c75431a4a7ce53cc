"""Recorder: levels, one record per sample, row digests, seq order, per-step batches, step bytes."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from drifttool.artifact import open_run
from drifttool.artifact.writer import ArtifactWriter
from drifttool.capture.digest import digest, row_digests
from drifttool.capture.recorder import Recorder, record_parts
from drifttool.errors import UnsupportedConfigError


def site(step=0, op="qk_rmsnorm", stream="joint", block=3, **kw):
    return {"phase": "rollout", "step": step, "sigma": 0.9, "branch": "cond", "block": block,
            "samples": [5, 6], "txt_lens": [1, 2], "img_grid": (1, 2), "rank": 0, "op": op,
            "stream": stream, "call": 0, "op_pos": 0, **kw}


def joint_out():
    return torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)  # [B, 2 + 1*2, C]


def step(rec, i, **extra):
    rec.record_step(phase="rollout", step=i, sigma=1.0 - i / 4, sigma_next=1.0 - (i + 1) / 4,
                    sample=0, branch="cfg",
                    quantities={"x_t": torch.full((2, 3), float(i)), "logp_t": torch.tensor(-0.5),
                                **extra})


def test_l0_ignores_ops_keeps_steps():
    rec = Recorder("L0")
    rec.capture(site(), joint_out(), "BS.")
    step(rec, 0)
    rec.close(complete=True)
    assert rec.ops_table().num_rows == 0 and rec.steps_table().num_rows == 2


def test_l1_one_record_per_sample_no_rows():
    rec = Recorder("L1")
    out = joint_out()
    rec.capture(site(), out, "BS.", index=1)
    rec.flush()
    t = rec.ops_table().to_pylist()
    assert [r["sample"] for r in t] == [5, 6]
    # the canonical row axis (S) is part of the digest at every level, rows kept or not
    assert t[0]["digest"] == digest(torch.cat([out[0, :1], out[0, 2:]]), row_axis=0)  # txt_len 1 of pad 2
    assert t[1]["digest"] == digest(out[1], row_axis=0)
    assert t[0]["shape"] == [3, 3] and t[0]["dtype"] == "float32" and t[0]["index"] == 1
    assert t[0]["role"] == "output" and t[0]["row_digests"] is None and t[0]["txt_len"] is None
    assert (t[0]["block"], t[0]["stream"], t[0]["op"], t[0]["sigma"]) == (3, "joint",
                                                                          "qk_rmsnorm", 0.9)
    assert t[1]["maxabs"] == 23.0 and t[1]["nonfinite"] == 0
    assert t[1]["l2"] == pytest.approx(float(out[1].double().norm()))


def test_l2_row_digests_and_row_map():
    rec = Recorder("L2")
    out = joint_out()
    rec.capture(site(), out, "BS.")
    rec.flush()
    r0, r1 = rec.ops_table().to_pylist()
    canon0 = torch.cat([out[0, :1], out[0, 2:]])
    assert r0["row_digests"] == row_digests(canon0).tolist()
    assert r0["digest"] == digest(canon0, row_axis=0)
    l1 = Recorder("L1")
    l1.capture(site(), out, "BS.")
    l1.flush()
    assert l1.ops_table().column("digest").to_pylist() == [r0["digest"], r1["digest"]]  # L1 == L2
    assert (r0["txt_len"], r0["img_h"], r0["img_w"], r1["txt_len"]) == (1, 1, 2, 2)
    rec.capture(site(op="norm", stream="none"), torch.ones(3), ".")  # no S axis: no rows
    rec.flush()
    assert rec.ops_table().to_pylist()[-1]["row_digests"] is None


def test_seq_is_shared_and_batches_follow_steps(tmp_path):
    w = ArtifactWriter(tmp_path / "run", manifest={"fingerprint": {}})
    rec = Recorder("L1", w)
    for i in range(3):
        rec.capture(site(step=i), joint_out(), "BS.")
        step(rec, i)  # no explicit flush: the next step's first record flushes this one
    rec.close(complete=True)
    run = open_run(tmp_path / "run")
    assert run.complete and run.manifest["capture_level"] == "L1"
    ops, steps = run.ops_table(), run.steps_table()
    assert len(ops.to_batches()) == 3 and len(steps.to_batches()) == 3
    seqs = sorted(ops.column("seq").to_pylist() + steps.column("seq").to_pylist())
    assert seqs == list(range(3 * 4))
    assert steps.column("seq").to_pylist()[:2] == [2, 3]  # after the step's two op records
    assert pq.read_table(tmp_path / "run" / "ops.rank0.parquet").num_rows == 6  # plain pyarrow


def test_step_records_keep_bytes():
    rec = Recorder("L0")
    x = torch.tensor([[1.0, -0.0], [float("nan"), 2.0]])
    step(rec, 1, v_t=x.to(torch.bfloat16))
    rec.flush()
    rows = {r["quantity"]: r for r in rec.steps_table().to_pylist()}
    v = rows["v_t"]
    assert v["data"] == x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert (v["dtype"], v["shape"], v["nonfinite"]) == ("bfloat16", [2, 2], 1)
    assert v["digest"] == digest(x.to(torch.bfloat16))
    assert rows["logp_t"]["shape"] == [] and rows["logp_t"]["sigma_next"] == 0.5
    assert math.isnan(v["l2"])


def test_errors():
    with pytest.raises(UnsupportedConfigError, match="capture level"):
        Recorder("L9")
    rec = Recorder("L1")
    with pytest.raises(TypeError, match="not a Tensor"):
        rec.record_step(phase="rollout", step=0, sigma=1.0, sigma_next=0.5, sample=0,
                        branch="cfg", quantities={"x_t": np.zeros(3)})
    rec.close(complete=True)
    with pytest.raises(RuntimeError, match="closed"):
        rec.capture(site(), joint_out(), "BS.")


def test_context_manager_marks_incomplete_on_error(tmp_path):
    with pytest.raises(KeyError):
        with Recorder("L1", ArtifactWriter(tmp_path / "r", manifest={"fingerprint": {}})) as rec:
            rec.capture(site(), joint_out(), "BS.")
            raise KeyError("boom")
    run = open_run(tmp_path / "r")
    assert not run.complete and run.ops_table().num_rows == 2  # flushed on close


def test_capture_through_registry_call(monkeypatch):
    """``ops.registry.call`` hands outputs to ``capture`` with the runtime's site."""
    from drifttool.ops import registry
    from drifttool.runtime import Mode, Runtime

    # a throw-away operator in a copy of the registry, restored after the test
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setattr(registry, "_IMPLS", dict(registry._IMPLS))
    name = "test_recorder_identity_op"
    registry.declare(registry.OpSpec(name=name, contract=f"test.{name}.v1", differentiable=False,
                                     dtypes=(torch.float32,), summary="identity, for this test"))
    registry.implements(name, "production", kernel="test")(lambda x: x * 1.0)
    rec = Recorder("L2")
    rt = Runtime(mode=Mode.AUTO, recorder=rec)
    with rt.scope(phase="rollout", step=4, sigma=0.25, branch="uncond", samples=[7],
                  txt_lens=[2], img_grid=(1, 1)):
        with rt.scope(block=2):
            registry.call(rt, name, torch.ones(1, 3, 2), stream="joint", layout="BS.")
            registry.call(rt, name, torch.ones(1, 3, 2), stream="joint", layout="BS.")
    rec.flush()
    rows = rec.ops_table().to_pylist()
    assert [(r["step"], r["branch"], r["block"], r["call"], r["sample"], r["txt_len"])
            for r in rows] == [(4, "uncond", 2, 0, 7, 2), (4, "uncond", 2, 1, 7, 2)]


def _reachable_tensors(root):
    """Every tensor reachable from ``root`` through Python references."""
    import gc

    seen, todo, found = set(), [root], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        todo.extend(gc.get_referents(obj))
    return found


@pytest.mark.parametrize("level", ["L1", "L2"])
def test_started_digests_hold_no_tensor_of_the_output(level):
    """``record_parts`` keeps each part's identity, not its tensor: a recorded forward's log (a
    CUDA graph's, kept for the graph's life) and a chain's held records would otherwise keep
    every captured output or its canonical copy alive (a view part holds the output's storage):
    at L2 of a full-size forward, the attention internals of every block."""
    g = torch.Generator().manual_seed(7)
    out = torch.randn(2, 2 + 15 * 20, 257, generator=g)  # [B, 2 + 300, C]: parts over 2**16 elements
    want = [digest(torch.cat([out[0, :1], out[0, 2:]]), row_axis=0), digest(out[1], row_axis=0)]
    s = site(op="img_mod_linear", img_grid=(15, 20))
    parts = record_parts(s, out, "BS.", level)
    held = [t for t in _reachable_tensors(parts) if t.untyped_storage().nbytes() > 1 << 14]
    assert held == []  # the pending digests: a few words and (L2) one word per row
    assert [(p.sample, p.row_axis, p.rows.txt_len) for p, _ in parts] == [(5, 0, 1), (6, 0, 2)]
    rec = Recorder(level)
    rec.capture_digested(s, parts)
    rec.flush()
    assert rec.ops_table().column("digest").to_pylist() == want
