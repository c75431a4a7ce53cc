"""Strict CUDA unfused LoRA (``lora=`` of the four block GEMMs, contract cuda1) under Triton's
interpreter, on CPU FP32.

What the interpreter proves of the logic: the GEMM's epilogue merge with an activation and an N-D
x equals act(pre + fp32(s)·t) done by separate kernel calls and torch FP32 operations (bytes); the
adapted operators' forward and backward (dX, dW, db, dA, dB) match the same formula in FP64 torch;
B = 0 (peft's init) gives the bytes of the operator without ``lora``; within a run a sample's y and
dX do not depend on its batch companions, and the batch's dA / dB equal ``tree_sum_stack`` of the
per-sample ones; the ledger's sink gets the factors' partials; the registration (kernel ids) and
the factor checks. The GPU's own bytes: ``tests/gpu/test_strict_cuda_lora_unfused.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.ops import strict_math
from drifttool.ops.registry import impls
from drifttool.ops.strict.grad import attach_grad_sink, detach_grad_sinks
from drifttool.ops.strict_cuda import linear as cuda_linear
from drifttool.ops.strict_trees import tree_sum_stack
from tests.conftest import assert_same_bytes
from tests.strict_cuda_cases import gelu_tanh_f32_order

gemm = pytest.importorskip("drifttool.ops.strict_cuda.kernels.gemm")

OPS = {  # op: (K, N) of the adapted projection
    "attn_out_bias_gemm": (96, 96),
    "mlp_up_gemm_gelu": (96, 160),
    "mlp_down_gemm": (160, 96),
}
R, S = 4, 1.75  # rank, scale


def op(name: str):
    """The registered strict CUDA function itself (its constraints ask for CUDA tensors)."""
    return impls(name, "strict", "cuda")[0].fn


def rn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def factors(n: int, k: int, seed: int, zero_b: bool = False):
    a = rn(R, k, seed=seed, scale=1 / math.sqrt(k))
    bl = torch.zeros(n, R) if zero_b else rn(n, R, seed=seed + 1, scale=0.3)
    return a, bl


def assert_close(y: torch.Tensor, r: torch.Tensor, what: str, tol: float = 2e-5) -> None:
    err = (y.double() - r).abs() / (1 + r.abs())
    assert err.max().item() <= tol, f"{what}: max scaled error {err.max().item():.3g} > {tol:g}"


def fp64(name, x, w, b, a, bl, s):
    """The contract's formula in FP64 torch: act(x·Wᵀ + b + s·((x·Aᵀ)·Bᵀ))."""
    pre = x @ w.T + b + s * ((x @ a.T) @ bl.T)
    return F.gelu(pre, approximate="tanh") if name == "mlp_up_gemm_gelu" else pre


# ---------------------------------------------------------------------------------------------
# the kernel's merge epilogue


@pytest.mark.parametrize("act", [None, "gelu_tanh", "gelu_tanh_f32", "silu"])
def test_merge_with_activation_on_nd_x_is_the_separate_operations(act):
    u, bl = rn(2, 13, R, seed=1), rn(70, R, seed=2, scale=0.5)  # u [B, S, r], B [N, r]
    pre = rn(2, 13, 70, seed=3, scale=2.0)  # [B, S, N] fp32
    t = gemm.linear(u, bl)  # the same kernel's u·Bᵀ, [2, 13, 70]
    merged = pre + torch.tensor(S, dtype=torch.float32) * t  # product, then sum, each rounded
    want = {None: lambda v: v, "gelu_tanh": strict_math.gelu_tanh32, "gelu_tanh_f32": gelu_tanh_f32_order,
            "silu": strict_math.silu32}[act](merged)
    got = gemm.linear(u, bl, merge_into=pre, scale=S, act=act, out_dtype=torch.float32)
    assert got.shape == (2, 13, 70)
    assert_same_bytes(got, want, f"merge + {act} vs separate operations")


# ---------------------------------------------------------------------------------------------
# the operators vs FP64


@pytest.mark.parametrize("name", sorted(OPS))
def test_adapted_forward_and_backward_match_fp64(name):
    k, n = OPS[name]
    x = rn(2, 11, k, seed=10)
    w, b = rn(n, k, seed=11, scale=1 / math.sqrt(k)), rn(n, seed=12, scale=0.1)
    a, bl = factors(n, k, seed=13)
    gy = rn(2, 11, n, seed=15)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b, a, bl)]
    y = op(name)(*leaves[:3], lora=(leaves[3], leaves[4], S))
    y.backward(gy)
    ref = [t.double().requires_grad_(True) for t in (x, w, b, a, bl)]
    want = fp64(name, *ref, S)
    want.backward(gy.double())
    assert y.dtype == torch.float32 and y.shape == (2, 11, n)
    assert_close(y, want.detach(), f"{name} y")
    for got, r, what in zip(leaves, ref, ("dX", "dW", "db", "dA", "dB")):
        assert got.grad.dtype == torch.float32, what
        assert_close(got.grad, r.grad, f"{name} {what}")


def test_adapted_qkv_matches_fp64_with_one_projection_unadapted():
    d, heads = 96, 4
    x = rn(2, 9, d, seed=20)
    wb = [(rn(d, d, seed=21 + 2 * i, scale=1 / math.sqrt(d)), rn(d, seed=22 + 2 * i, scale=0.1)) for i in range(3)]
    fq, fv = factors(d, d, seed=30), factors(d, d, seed=32)
    gs = [rn(2, 9, heads, d // heads, seed=40 + i) for i in range(3)]
    xs = x.clone().requires_grad_(True)
    ps = [t.clone().requires_grad_(True) for pair in wb for t in pair]
    fs = [t.clone().requires_grad_(True) for t in (*fq, *fv)]
    outs = op("qkv_bias_gemm")(xs, *ps, heads, lora=((fs[0], fs[1], S), None, (fs[2], fs[3], S)))
    torch.autograd.backward(outs, gs)
    xr = x.double().requires_grad_(True)
    pr = [t.double().requires_grad_(True) for pair in wb for t in pair]
    fr = [t.double().requires_grad_(True) for t in (*fq, *fv)]
    lo = {0: fr[0:2], 2: fr[2:4]}
    want = [(xr @ pr[2 * i].T + pr[2 * i + 1] + (S * ((xr @ lo[i][0].T) @ lo[i][1].T) if i in lo else 0))
            .unflatten(-1, (heads, -1)) for i in range(3)]
    torch.autograd.backward(want, [g.double() for g in gs])
    for o, r in zip(outs, want):
        assert_close(o, r.detach(), "q/k/v")
    for got, r, what in zip((xs, *ps, *fs), (xr, *pr, *fr),
                            ("dX", "dWq", "dbq", "dWk", "dbk", "dWv", "dbv", "dAq", "dBq", "dAv", "dBv")):
        assert_close(got.grad, r.grad, f"qkv {what}")


# ---------------------------------------------------------------------------------------------
# raw bytes within a run


def _run(name, x, w, b, lora, gy):
    """(y, dX, [dA, dB]) of one call with autograd (factors' grads where given)."""
    xs = x.clone().requires_grad_(True)
    fs = None if lora is None else [t.clone().requires_grad_(True) for t in lora[:2]]
    y = op(name)(xs, w, b, **({} if fs is None else {"lora": (*fs, S)}))
    y.backward(gy)
    return y.detach(), xs.grad, ([] if fs is None else [f.grad for f in fs])


@pytest.mark.parametrize("name", sorted(OPS))
def test_zero_b_is_the_plain_operators_bytes(name):
    k, n = OPS[name]
    x, gy = rn(3, 13, k, seed=50), rn(3, 13, n, seed=51)
    w, b = rn(n, k, seed=52, scale=1 / math.sqrt(k)), rn(n, seed=53, scale=0.1)
    y0, dx0, _ = _run(name, x, w, b, None, gy)
    y, dx, (da, db_) = _run(name, x, w, b, factors(n, k, seed=54, zero_b=True), gy)
    assert_same_bytes(y, y0, f"{name}: y with B = 0 vs without lora")
    assert_same_bytes(dx, dx0, f"{name}: dX with B = 0 vs without lora")
    assert torch.all(da == 0) and db_.abs().sum() > 0  # dA = Bᵀ·… = 0; dB = dt·u is not


def test_zero_b_qkv_is_the_plain_operators_bytes():
    d, heads = 96, 4
    x = rn(2, 9, d, seed=60)
    ps = [rn(d, d, seed=61 + i, scale=0.1) if i % 2 == 0 else rn(d, seed=61 + i, scale=0.1) for i in range(6)]
    gs = [rn(2, 9, heads, d // heads, seed=70 + i) for i in range(3)]
    got = []
    for lora in (None, tuple((*factors(d, d, seed=80 + i, zero_b=True), S) for i in range(3))):
        xs = x.clone().requires_grad_(True)
        outs = op("qkv_bias_gemm")(xs, *ps, heads, **({} if lora is None else {"lora": lora}))
        torch.autograd.backward(outs, gs)
        got.append(([o.detach() for o in outs], xs.grad))
    for i in range(3):
        assert_same_bytes(got[1][0][i], got[0][0][i], f"qkv output {i} with B = 0")
    assert_same_bytes(got[1][1], got[0][1], "qkv dX with B = 0")


@pytest.mark.parametrize("name", sorted(OPS))
def test_a_samples_bytes_do_not_depend_on_the_batch(name):
    k, n = OPS[name]
    x, gy = rn(3, 13, k, seed=90), rn(3, 13, n, seed=91)
    w, b = rn(n, k, seed=92, scale=1 / math.sqrt(k)), rn(n, seed=93, scale=0.1)
    lora = factors(n, k, seed=94)
    y, dx, (da, db_) = _run(name, x, w, b, lora, gy)
    ones = [_run(name, x[i:i + 1], w, b, lora, gy[i:i + 1]) for i in range(3)]
    for i in range(3):
        assert_same_bytes(y[i:i + 1], ones[i][0], f"{name}: y of sample {i} of 3 vs alone")
        assert_same_bytes(dx[i:i + 1], ones[i][1], f"{name}: dX of sample {i} of 3 vs alone")
    assert_same_bytes(da, tree_sum_stack([o[2][0] for o in ones]), f"{name}: dA = tree of the samples'")
    assert_same_bytes(db_, tree_sum_stack([o[2][1] for o in ones]), f"{name}: dB = tree of the samples'")


def test_ledger_sinks_on_the_factors_get_the_partials_of_their_gradients():
    k, n = OPS["mlp_down_gemm"]
    x, gy = rn(3, 7, k, seed=100), rn(3, 7, n, seed=101)
    w, b = rn(n, k, seed=102, scale=1 / math.sqrt(k)), rn(n, seed=103, scale=0.1)
    lora = factors(n, k, seed=104)
    _, _, want = _run("mlp_down_gemm", x, w, b, lora, gy)
    fs = [t.clone().requires_grad_(True) for t in lora]
    got = {}
    keys = [attach_grad_sink(f, lambda dy, xx, partials=None, i=i: got.setdefault(i, partials(dy, xx)))
            for i, f in enumerate(fs)]
    try:
        op("mlp_down_gemm")(x, w, b, lora=(*fs, S)).backward(gy)
    finally:
        detach_grad_sinks(keys)
    assert fs[0].grad is None and fs[1].grad is None  # both went to the sinks
    for i, what in enumerate(("dA", "dB")):
        assert got[i].shape == (3, *lora[i].shape)
        assert_same_bytes(tree_sum_stack(list(got[i])), want[i], f"{what}: tree of the sink's partials")


# ---------------------------------------------------------------------------------------------
# registration and refusals


def test_adapted_calls_have_their_own_kernel_id_and_the_plain_one_is_unchanged():
    for name in (*OPS, "qkv_bias_gemm"):
        plain, adapted = impls(name, "strict", "cuda")
        assert plain.fn is adapted.fn and adapted.kernel == plain.kernel + cuda_linear.LORA_SUFFIX
        assert plain.contract == adapted.contract == f"qwenimage.{name}.cuda1"
    assert impls("attn_out_bias_gemm", "strict", "cuda")[0].kernel == cuda_linear.KERNEL == gemm.KERNEL_ID


def _why(name, *args, **kw):
    """The reasons the two registrations give for a call (device constraints skipped: CPU tensors)."""
    out = []
    for impl in impls(name, "strict", "cuda"):
        bound = impl.binder.bind(args, kw)
        out.append([c(bound) for c in impl.constraints[3:]])
    return out


def test_factor_checks_and_the_registration_a_call_selects():
    x, w, b = rn(1, 5, 96, seed=110), rn(64, 96, seed=111), rn(64, seed=112)
    a, bl = factors(64, 96, seed=113)
    plain, adapted = _why("mlp_down_gemm", x, w, b)
    assert all(r is None for r in plain) and "no lora given" in adapted[1]
    plain, adapted = _why("mlp_down_gemm", x, w, b, lora=(a, bl, S))
    assert "lora given" in plain[1] and all(r is None for r in adapted)
    assert "must be float32" in _why("mlp_down_gemm", x, w, b, lora=(a.bfloat16(), bl, S))[1][2]
    assert "do not fit" in _why("mlp_down_gemm", x, w, b, lora=(a[:, :90], bl, S))[1][2]
    assert "do not fit" in _why("mlp_down_gemm", x, w, b, lora=(a, bl[:, :3], S))[1][2]
    ws = [rn(96, 96, seed=114 + i) for i in range(6)]
    qa = factors(96, 96, seed=120)
    assert _why("qkv_bias_gemm", x, *ws, 4, lora=(None, None, None))[0][-1] is None  # no adapter: plain
    assert _why("qkv_bias_gemm", x, *ws, 4, lora=(None, (*qa, S), None))[1][-2:] == [None, None]
    assert "tuple of 3 entries" in _why("qkv_bias_gemm", x, *ws, 4, lora=(*qa, S))[1][-1]
    assert "must be (A, B, scale)" in _why("mlp_down_gemm", x, w, b, lora=(None,))[1][2]  # not taken as none
    assert "must be a python float" in _why("mlp_down_gemm", x, w, b, lora=(a, bl, None))[1][2]
