"""Identity of a record without rank (issue #9 item 4): the runtime's program position
``op_pos``, the ``component`` and owning ``rank`` columns, and the trace's rank and device."""

from __future__ import annotations

import pytest
import torch

from drifttool.artifact import schema as S
from drifttool.capture.recorder import Recorder
from drifttool.capture.trace import OperatorTrace
from drifttool.runtime import Runtime


def _sites(rt: Runtime, calls: list[tuple[str, str]]) -> list[tuple[int, int]]:
    return [(s["op_pos"], s["call"]) for s in (rt.site(op, st) for op, st in calls)]


def test_op_pos_counts_every_call_of_the_scope_and_restarts_per_scope():
    rt = Runtime(mode="auto")
    calls = [("a", "img"), ("b", "img"), ("a", "img"), ("a", "txt"), ("c", "joint")]
    with rt.scope(phase="rollout", step=0, branch="cond", block=0):
        assert _sites(rt, calls) == [(0, 0), (1, 0), (2, 1), (3, 0), (4, 0)]
    with rt.scope(phase="rollout", step=0, branch="cond", block=1):
        assert _sites(rt, calls[:2]) == [(0, 0), (1, 0)]
    with rt.scope(phase="rollout", step=0, branch="uncond", block=0):
        assert _sites(rt, calls[:2]) == [(0, 0), (1, 0)]
    with rt.scope(phase="rollout", step=1, branch="cond", block=0):
        assert _sites(rt, calls[:1]) == [(0, 0)]
    with rt.scope(phase="rollout", step=0, branch="cond", block=0):  # the scope again: continues
        assert _sites(rt, calls[:1]) == [(5, 2)]


def test_op_pos_of_batched_cfg_equals_each_sequential_branch():
    calls = [("a", "img"), ("b", "txt"), ("a", "img")]
    seq = Runtime(mode="auto")
    got = []
    for branch in ("cond", "uncond"):
        with seq.scope(step=2, branch=branch, block=3):
            got.append(_sites(seq, calls))
    bat = Runtime(mode="auto")
    with bat.scope(step=2, branch=["cond", "cond", "uncond", "uncond"], block=3):  # a list too
        batched = _sites(bat, calls)
    assert got == [batched, batched]


def test_component_and_owning_rank_columns():
    rt = Runtime(mode="auto")
    rec = Recorder("L1", rank=3)
    x = torch.randn(2, 5, 3)
    with rt.scope(step=0, branch="cond", block=1, samples=[4, 9], rank=1):
        site = rt.site("img_mlp", "img")
        assert site["component"] == S.DEFAULT_COMPONENT == "mmdit"
        rec.capture(site, x, "BS.")
    rec.record_step(phase="rollout", step=0, sigma=1.0, sigma_next=0.5, sample=4, branch="cfg",
                    rank=2, quantities={"x_t": x[0]})
    rec.flush()
    ops, steps = rec.ops_table().to_pylist(), rec.steps_table().to_pylist()
    # the recorder's rank owns the op records; the scope's rank is not consulted
    assert [(r["rank"], r["component"], r["op_pos"], r["sample"]) for r in ops] == [
        (3, "mmdit", 0, 4), (3, "mmdit", 0, 9)]
    assert [(r["rank"], r["component"]) for r in steps] == [(2, "mmdit")]
    assert "rank" not in S.OPS_KEY and "rank" not in S.STEPS_KEY
    assert "component" in S.OPS_KEY and "component" in S.STEPS_KEY


def test_capture_refuses_a_site_without_program_position_or_with_unknown_component():
    rec = Recorder("L1")
    rt = Runtime(mode="auto")
    with rt.scope(step=0, samples=[0]):
        site = rt.site("img_mlp", "img")
    with pytest.raises(ValueError, match=r"lacks identity field\(s\) \['op_pos'\]"):
        rec.capture({k: v for k, v in site.items() if k != "op_pos"}, torch.ones(1, 2), "B.")
    with pytest.raises(ValueError, match="unknown component 'unet'"):
        rec.capture({**site, "component": "unet"}, torch.ones(1, 2), "B.")
    rec.capture({**site, "component": "vae"}, torch.ones(1, 2), "B.")
    rec.flush()
    assert rec.ops_table().column("component").to_pylist() == ["vae"]


def test_gradient_records_number_their_position_per_block():
    rec = Recorder("L1", rank=1)
    for block, op in ((0, "attn.to_q.lora_A"), (0, "attn.to_q.lora_B"), (1, "attn.to_q.lora_A")):
        rec.capture_grad(phase="train", step=2, block=block, stream="img", op=op,
                         tensor=torch.ones(2, 3))
    rec.flush()
    rows = rec.ops_table().select(["block", "op_pos", "role", "rank"]).to_pylist()
    assert [(r["block"], r["op_pos"], r["role"], r["rank"]) for r in rows] == [
        (0, 0, "grad_weight", 1), (0, 1, "grad_weight", 1), (1, 0, "grad_weight", 1)]


def test_trace_records_rank_device_and_component_per_site():
    tr = OperatorTrace()
    kw = dict(contract="c.v1", requested="strict", actual="strict", kernel="k", fallback=False,
              reason="", declared=False)
    site = {"op": "qkv_bias_gemm", "block": 3, "stream": "img", "call": 0, "rank": 1}
    tr.record(site=site, **kw)  # device defaults to "cpu"; rank from the site
    tr.record(site=site, **kw)
    tr.record(site=site, device="cuda:0", rank=0, **kw)
    tr.record(site={**site, "component": "vae"}, device="cuda:1", **kw)
    rows = sorted(tr.rows(), key=lambda r: (r["rank"], r["component"]))
    assert [(r["rank"], r["device"], r["component"], r["calls"]) for r in rows] == [
        (0, "cuda:0", "mmdit", 1), (1, "cpu", "mmdit", 2), (1, "cuda:1", "vae", 1)]
    assert set(rows[0]) == set(S.TRACE_SCHEMA.names)
    tr.record(site=site, device="cuda:0", **kw)  # a site that moves device: keep the latest
    assert [r["device"] for r in tr.rows() if (r["rank"], r["component"]) == (1, "mmdit")] == [
        "cuda:0"]
