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


def test_call_counters_are_kept_per_component():
    """The text encoder's, the transformer's and the VAE's calls of one operator name in one
    phase, step, branch and block count apart: each component's first call is call 0, op_pos 0,
    and interleaving them changes no component's identities."""
    ops = ["latent_pack_unpack", "rms_norm", "latent_pack_unpack"]
    alone = {}
    for comp in ("text_encoder", "mmdit", "vae"):
        rt = Runtime(mode="auto")
        with rt.scope(component=comp, step=-1, block=-1):
            alone[comp] = _sites(rt, ops)
    rt = Runtime(mode="auto")
    mixed = {c: [] for c in alone}
    for op in ops:
        for comp in ("vae", "text_encoder", "mmdit"):
            with rt.scope(component=comp, step=-1, block=-1):
                mixed[comp] += _sites(rt, [op])
    assert mixed == alone
    assert alone["mmdit"] == [("latent_pack_unpack", 0, 0, ()), ("rms_norm", 0, 1, ()),
                              ("latent_pack_unpack", 1, 2, ())]
