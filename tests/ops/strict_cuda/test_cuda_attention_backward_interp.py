"""The strict CUDA attention backward (``kernels/attention_backward.py``, wired into
``joint_attention_fused`` by ``strict_cuda/attention_backward.py``; contract ``grad.cuda1``) under
Triton's interpreter, FP32 on CPU tensors.

Checked: dQ, dK, dV against FP64 autograd of the same masked attention (odd text lengths, image
lengths not multiples of 64, a key mask reaching into the image keys); raw-byte invariance of a
sample's gradients to its batch companions (alone vs at position 2 of 3 with other prompts) and to
prompt padding (``text_len`` padded past a 64-row boundary, NaN in every padded Q/K/V slot and in
the padded rows' output gradient); masked positions' gradients exactly +0; repetition; the dQ rows
independent of the query tile, and dK, dV of the keys a dK/dV program holds; D's stated order
(torch reproduces its bytes); P recomputed bit for bit (dV against the unfused softmax's P); the
forward's bytes unchanged when a gradient is wanted; the fail-closed refusals. Tiny shapes: the
interpreter is slow. The GPU's own bytes: ``tests/gpu/test_strict_cuda_attention_backward.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import impls
from drifttool.ops.strict_cuda import attention as A
from drifttool.ops.strict_cuda import backward as bw
from drifttool.ops.strict_trees import tree_sum
from references import ops as ref
from tests.conftest import assert_same_bytes, bits
from tests.strict_cuda_cases import joint

AB = pytest.importorskip("drifttool.ops.strict_cuda.kernels.attention_backward")
H = 2
TOL = 2e-5
"""Scaled error |got − FP64| / (1 + |FP64|): FP32 throughout (products, exp2, sums over ≤ 140 keys
or query rows of O(1) terms) bounds the error by a few hundred FP32 ulps (≈ 1e-5); a wrong order,
mask or scale is off by O(1)."""


def op(name: str):
    """The registered strict CUDA function itself (its constraints ask for CUDA tensors)."""
    return impls(name, "strict", "cuda")[0].fn


def rn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def grads(q, k, v, km, text_len, do):
    """(o, dq, dk, dv) through the registered ``joint_attention_fused`` and autograd."""
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o = op("joint_attention_fused")(*leaves, km, text_len=text_len)
    o.backward(do)
    return (o.detach(), *(t.grad for t in leaves))


def fp64_grads(q, k, v, km, do):
    """FP64 autograd of the masked attention; the output gradient of masked rows taken as 0."""
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    o = ref.joint_attention_fused(*leaves, km)
    live = torch.ones(q.shape[:2], dtype=torch.float64) if km is None else km.double()
    return torch.autograd.grad(o, leaves, do.double() * live[:, :, None, None])


def assert_plus_zero(t: torch.Tensor, what: str) -> None:
    assert t.numel() > 0 and torch.equal(bits(t), torch.zeros_like(bits(t))), f"{what}: not all +0"


@pytest.mark.parametrize("lens,text_len,n_img,dh", [([5, 3, 5], 5, 70, 16), ([70], 70, 67, 32)],
                         ids=["b3_l5_n70_dh16", "b1_l70_n67_dh32"])
def test_grads_match_fp64_and_masked_positions_get_plus_zero(lens, text_len, n_img, dh):
    q, k, v, km = joint(lens, text_len, n_img, H, dh, seed=dh)
    km[0, text_len + 3] = False  # the mask reaches into the image keys (their masked path)
    do = rn(*q.shape, seed=dh + 1)
    _, dq, dk, dv = grads(q, k, v, km, text_len, do)
    for name, got, want in zip(("dQ", "dK", "dV"), (dq, dk, dv), fp64_grads(q, k, v, km, do)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        err = ((got.double() - want).abs() / (1 + want.abs())).max().item()
        assert err <= TOL, f"{name}: max scaled error {err:.3g} > {TOL:g}"
        assert_plus_zero(got[~km], f"{name} at masked positions")


@pytest.fixture(scope="module")
def padded_batch():
    """Batch of 3 (valid text 20, 3, 7) padded to 70 text slots, 67 image tokens, Dh 16; NaN in
    every padded Q/K/V slot and in the padded rows' output gradient; and its gradients."""
    lmax, n_img = 70, 67
    q, k, v, km = joint([20, 3, 7], lmax, n_img, H, 16, seed=5, nan_pads=True)
    q = q.masked_fill(~km[:, :, None, None], float("nan"))
    do = rn(*q.shape, seed=6).masked_fill(~km[:, :, None, None], float("nan"))
    return (q, k, v, km, lmax, do), grads(q, k, v, km, lmax, do)


def test_batch_and_padding_invariance_in_raw_bytes(padded_batch):
    (q, k, v, km, lmax, do), (o, dq, dk, dv) = padded_batch
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    for name, g in zip(("dQ", "dK", "dV"), (dq, dk, dv)):
        assert_plus_zero(g[~km], f"{name} at padded positions")
    alone = grads(q[2:], k[2:], v[2:], km[2:], lmax, do[2:])
    for name, a, b in zip(("dQ", "dK", "dV"), alone[1:], (dq, dk, dv)):
        assert_same_bytes(a, b[2:], f"sample 2: {name} alone vs at position 2 of 3, same padding")
    for i, n in ((2, 7), (0, 20)):  # unpadded (text_len = its prompt length), no mask
        keep = torch.cat([torch.arange(n), torch.arange(lmax, lmax + q.shape[1] - lmax)])
        _, *single = grads(*(t[i:i + 1, keep] for t in (q, k, v)), None, n, do[i:i + 1, keep])
        for name, a, b in zip(("dQ", "dK", "dV"), single, (dq, dk, dv)):
            assert_same_bytes(a, b[i:i + 1, keep], f"sample {i}: {name} unpadded alone vs padded to {lmax} in a batch")


def test_repetition_dq_tile_and_forward_bytes(padded_batch):
    (q, k, v, km, lmax, do), (o, dq, dk, dv) = padded_batch
    again = grads(q, k, v, km, lmax, do)
    for name, a, b in zip(("o", "dQ", "dK", "dV"), again, (o, dq, dk, dv)):
        assert_same_bytes(a, b, f"{name}: repetition")
    plain = op("joint_attention_fused")(q, k, v, km, text_len=lmax)
    assert_same_bytes(o, plain, "forward with a gradient wanted (row states written) vs without")
    o2, ml = A._kernels().attention(q, k, v, km, text_len=lmax, with_stats=True)
    dq2, dk2, dv2 = AB.attention_grads(do, q, k, v, o2, ml, km, text_len=lmax, needs=(True, False, False),
                                       configs=(AB.DKV_CONFIG_FP32, (16, 2, 1)))
    assert dk2 is None and dv2 is None
    assert_same_bytes(dq2, dq, "dQ with 16-row query tiles vs the fixed configuration")
    _, dk3, dv3 = AB.attention_grads(do, q, k, v, o2, ml, km, text_len=lmax, needs=(False, True, True),
                                     configs=((*AB.DKV_CONFIG_FP32, 128), AB.DQ_CONFIG_FP32))
    assert_same_bytes(dk3, dk, "dK with 128 keys a program vs the fixed configuration")
    assert_same_bytes(dv3, dv, "dV with 128 keys a program vs the fixed configuration")


def test_row_deltas_are_the_stated_tree():
    q, k, v, km = joint([9, 4], 9, 70, H, 32, seed=7)
    o = A._kernels().attention(q, k, v, km, text_len=9)
    do = rn(*q.shape, seed=8)
    want = tree_sum(do * o, dim=-1).permute(0, 2, 1)  # [B,H,S]: fp32 products, pairwise tree over Dh
    want = want.masked_fill(~km[:, None, :], 0.0)
    assert_same_bytes(AB.deltas(do, o, km, text_len=9), want, "D = tree(dO·O), +0 at masked rows")


def test_probabilities_are_recomputed_bit_for_bit():
    """dV[:, j, h, 0] = Σ_i P[h, i, j]·dO[i, h, 0] with dO one-hot at one row per head: the
    backward's P of that row, exactly (the other products are +0); it equals the unfused
    softmax's P, the forward's probabilities."""
    L, n_img = 13, 70
    q, k, v, km = joint([13, 6], L, n_img, H, 16, seed=9)
    kern = A._kernels()
    o, ml = kern.attention(q, k, v, km, text_len=L, with_stats=True)
    p = kern.softmax(kern.scores(q, k, text_len=L), km, text_len=L)  # [B,H,S,S]
    rows = (4, L + 40)  # head 0: a text row; head 1: an image row in the second tile
    do = torch.zeros_like(q)
    for h, i in enumerate(rows):
        do[:, i, h, 0] = 1.0
    dq, dk, dv = AB.attention_grads(do, q, k, v, o, ml, km, text_len=L, needs=(False, False, True))
    assert dq is None and dk is None
    for h, i in enumerate(rows):
        assert_same_bytes(dv[:, :, h, 0], p[:, h, i, :], f"head {h}, row {i}: dV column = the forward's P")


def test_only_the_fused_operator_is_trainable_and_refusals():
    docs = Path(__file__).parents[3] / "docs" / "strict-arithmetic.md"
    assert AB.KERNEL_ID in docs.read_text(encoding="utf-8"), "the docs name the kernel and its configuration"
    assert "joint_attention_fused" in bw.TRAINABLE
    assert bw.grad_contract_id("joint_attention_fused") == "qwenimage.joint_attention_fused.grad.cuda1"
    x = torch.ones(1, 3, 1, 16, requires_grad=True)
    for name in ("joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm"):
        refuse = [c for c in impls(name, "strict", "cuda")[0].constraints if c.name == "forward only"]
        assert refuse and "joint_attention_fused" in refuse[0]({"scores": x}), name
    km = torch.ones(1, 3, dtype=torch.bool)
    args = {"q": x[:, :2], "k": x.detach(), "v": x.detach(), "key_mask": km}
    assert "joint self-attention layout" in A.GRAD_LAYOUT(args)
    assert A.GRAD_LAYOUT({**args, "key_mask": None}) is None
    with torch.no_grad():
        assert A.GRAD_LAYOUT(args) is None
    q, k, v, km = joint([3], 3, 20, 1, 16, seed=10)
    o, ml = A._kernels().attention(q, k, v, km, text_len=3, with_stats=True)
    with pytest.raises(UnsupportedConfigError, match="joint self-attention layout"):
        AB.attention_grads(o[:, :5], q[:, :5], k, v, o[:, :5], ml[..., :5], km, text_len=3)
    with pytest.raises(UnsupportedConfigError, match="float16"):
        AB.attention_grads(o, q.half(), k.half(), v.half(), o, ml, km, text_len=3)
    with pytest.raises(UnsupportedConfigError, match="row states"):
        AB.attention_grads(o, q, k, v, o, ml[:, :, :1], km, text_len=3)
