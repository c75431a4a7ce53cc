"""Operator variants: each changes exactly what it says, the sensitivity plant hits one element."""

from __future__ import annotations

import torch

import drifttool.ops  # noqa: F401
from drifttool.ops.registry import call, implementation
from drifttool.probes import variants as V
from drifttool.runtime import Runtime


def _rt(**variants):
    return Runtime(mode="strict", variants={v.op: (v.name, v) for v in variants.values()})


def test_flip_lowest_bit_is_one_ulp():
    for dt, it in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        t = torch.tensor([[1.0, -3.5], [0.25, 7.0]], dtype=dt)
        u = V.flip_lowest_bit(t, (1, 0))
        bt, bu = t.view(it), u.view(it)
        assert (bt != bu).nonzero().tolist() == [[1, 0]]
        assert abs(int(bt[1, 0]) - int(bu[1, 0])) == 1  # adjacent representable values
        assert t[1, 0].item() == 0.25  # the input is untouched


def test_rope_rotate_half_pairs_x_j_with_x_j_plus_half():
    x = torch.randn(1, 3, 2, 8)
    ang = torch.rand(3, 4)
    freqs = torch.polar(torch.ones_like(ang), ang)  # [S, Dh/2] complex64
    v = V.RopeRotateHalf()
    rt = _rt(rope=v)
    y = call(rt, "multi_axis_rope", x, freqs, stream="img")
    c, s = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., :4], x[..., 4:]
    want = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    assert torch.allclose(y, want, atol=1e-6)
    assert not torch.allclose(y, implementation("multi_axis_rope", "strict")(x, freqs), atol=1e-3)


def test_latent_pack_helpers_are_inverse():
    x = torch.arange(2 * 3 * 64, dtype=torch.float32).reshape(2, 3, 64)
    assert torch.equal(V._channels_first(V._channels_last(x)), x)
    y = V._channels_last(x)
    # channel c*4 + dy*2 + dx moves to dy*2C + dx*C + c (C = 16)
    assert y[0, 0, 1 * 16 + 0 * 16 + 0].item() == x[0, 0, 0 * 4 + 0 * 2 + 1].item()
    assert y[0, 0, 2 * 16 + 5].item() == x[0, 0, 5 * 4 + 1 * 2 + 0].item()


def test_qk_norm_no_gain_equals_gain_of_ones():
    x = torch.randn(2, 5, 2, 16)
    gain = 1 + 0.1 * torch.randn(16)
    y = call(_rt(v=V.QKNormNoGain()), "qk_rmsnorm", x, gain, stream="img")
    assert torch.equal(y, implementation("qk_rmsnorm", "strict")(x, torch.ones(16)))


def test_plant_ulp_changes_one_element_at_the_chosen_site():
    v = V.PlantUlp("mlp_down_gemm", step=1, block=0, call=1, sample=7, branch="uncond", row=2,
                   rest=(3,))
    rt = _rt(v=v)
    x = torch.randn(4, 5, 8)
    w, b = torch.randn(6, 8), torch.randn(6)
    base = implementation("mlp_down_gemm", "strict")(x, w, b)
    with rt.scope(step=1, block=0, samples=[3, 7, 3, 7], branch=("cond", "cond", "uncond", "uncond")):
        y0 = call(rt, "mlp_down_gemm", x, w, b, stream="img")  # call 0: untouched
        y1 = call(rt, "mlp_down_gemm", x, w, b, stream="txt")  # call 1: planted
    assert torch.equal(y0, base) and v.planted == 1
    diff = (y1 != base).nonzero().tolist()
    assert diff == [[3, 2, 3]]  # row 3 = (sample 7, uncond)
