"""The public scope API of ``Runtime``: ``parts`` (one logical call run as several parts keeps the
identities of the unsplit call) and ``recomputation`` (a silent re-run of a forward)."""

from __future__ import annotations

from drifttool.capture.recorder import Recorder
from drifttool.runtime import Runtime


def _sites(rt, ops):
    return [(s["op"], s["call"], s["op_pos"], tuple(s["samples"] or ())) for s in
            (rt.site(op, "img") for op in ops)]


def test_parts_give_each_part_the_identities_of_the_unsplit_call():
    whole = Runtime(mode="auto")
    with whole.scope(step=0, block=0, samples=[0, 1, 2]):
        unsplit = _sites(whole, ["qkv_bias_gemm", "mlp_down_gemm", "mlp_down_gemm"])
        after_unsplit = _sites(whole, ["mlp_down_gemm"])
    rt = Runtime(mode="auto")
    with rt.scope(step=0, block=0, samples=[0, 1, 2]):
        with rt.parts() as part:
            with part(samples=[0, 1]):
                first = _sites(rt, ["qkv_bias_gemm", "mlp_down_gemm", "mlp_down_gemm"])
            with part(samples=[2]):
                second = _sites(rt, ["qkv_bias_gemm", "mlp_down_gemm", "mlp_down_gemm"])
        after = _sites(rt, ["mlp_down_gemm"])
    strip = [(op, c, p) for op, c, p, _ in unsplit]
    assert [(op, c, p) for op, c, p, _ in first] == strip
    assert [(op, c, p) for op, c, p, _ in second] == strip
    assert {s for *_, s in first} == {(0, 1)} and {s for *_, s in second} == {(2,)}
    assert [(op, c, p) for op, c, p, _ in after] == [(op, c, p) for op, c, p, _ in after_unsplit]


def test_recomputation_is_silent_and_keeps_the_forward_scope_and_dispatch():
    rt = Runtime(mode="strict", recorder=Recorder("L2"))
    with rt.scope(step=3, block=1, samples=[5]):
        rt.site("mlp_down_gemm", "img")
        again = rt.recomputation()
    assert again.recorder is None and again.trace is not rt.trace
    assert again.wants_internals() and rt.wants_internals()  # L2: expand as the forward did
    s = again.site("mlp_down_gemm", "img")  # fresh counters, the forward's scope
    assert (s["step"], s["block"], s["samples"], s["call"], s["op_pos"]) == (3, 1, [5], 0, 0)
    assert not Runtime(mode="strict", recorder=Recorder("L1")).recomputation().wants_internals()
