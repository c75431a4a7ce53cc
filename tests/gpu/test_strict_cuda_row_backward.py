"""The strict CUDA backward of the row operators (contract ``grad.cuda1``; ``strict_cuda/
row_backward.py``) on the GPU (H200, sm_90), through the registry.

The backward does the strict CPU backward's arithmetic in its order (pairwise trees over the row,
FP64 rstd, contract-v2 row sums of the per-sample gradients, FP32 without FMA), so every gradient
of qk_rmsnorm, adaln_modulation, adaln_gate_residual and multi_axis_rope must EQUAL strict CPU's
bytes, and txt_in's norm gradients given the same GEMM gradient; txt_in's whole backward (its
GEMM's N order is cuda1's) is checked against FP64. Also: gradients do not change with batch
size, batch position, prompt padding or repetition at full width (d = 3072, 6889 image rows,
batch 3; 24 heads × 128). Each cross-device comparison prints one line
``strict-cuda-grad-vs-cpu <op> <grad> <shape> <dtype>: max|Δ| ... bytes equal ...``.
Skipped without CUDA; run with ``python -m pytest tests/gpu/test_strict_cuda_row_backward.py -n 0 -s``.
"""

from __future__ import annotations

import time

import pytest
import torch

from references import ops as ref
from tests.conftest import assert_same_bytes, bits

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implementation
from drifttool.ops.strict import adaln, embed
from drifttool.ops.strict_cuda import row_backward as rb
from drifttool.ops.strict_cuda import rows as R
from drifttool.ops.strict_trees import tree_sum_stack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

D, HEADS, DH, DJ, N_IMG = 3072, 24, 128, 3584, 6889


def _g(seed, *shape, dtype=torch.float32, scale=1.0, shift=0.0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype=dtype, device=device)


def cuda(op):
    return implementation(op, "strict", "cuda")


def cpu(op):
    return implementation(op, "strict", "cpu")


def _grads(fn, inputs, go, wrt, device):
    leaves = [t.detach().to(device).requires_grad_(i in wrt) if isinstance(t, torch.Tensor) and not t.is_complex()
              else (t.to(device) if isinstance(t, torch.Tensor) else t) for i, t in enumerate(inputs)]
    y = fn(*leaves)
    y.backward(go.to(device))
    return [leaves[i].grad for i in wrt]


def _freqs(s, half, seed):
    return torch.polar(_g(seed, s, half).abs() + 0.5, _g(seed + 1, s, half) * 50).to(torch.complex64)


def _cases(dtype, full):
    """(op, inputs, go, wrt) at the tiny fixture's widths or at full width; the second sample's
    gradient padded (trailing zero rows, as a padded prompt's)."""
    d, h, dh = (D, HEADS, DH) if full else (48, 3, 16)
    s, b = (N_IMG if full else 37), 2
    go_mod = _g(3, b, s, d, dtype=dtype)
    go_mod[1, s - 11:] = 0
    return [
        ("adaln_modulation", (_g(0, b, s, d, dtype=dtype, scale=3.0, shift=0.5), _g(1, b, d, dtype=dtype),
                              _g(2, b, d, dtype=dtype, scale=0.3)), go_mod, (0, 1, 2)),
        ("qk_rmsnorm", (_g(4, b, s, h, dh, dtype=dtype, scale=2.0), _g(5, dh, dtype=dtype, shift=1.0)),
         _g(6, b, s, h, dh, dtype=dtype), (0, 1)),
        ("adaln_gate_residual", (_g(7, b, s, d, dtype=dtype), _g(8, b, d, dtype=dtype), _g(9, b, s, d, dtype=dtype)),
         _g(10, b, s, d, dtype=dtype), (0, 1, 2)),
        ("multi_axis_rope", (_g(11, b, s, h, dh, dtype=dtype), _freqs(s, dh // 2, 12)),
         _g(14, b, s, h, dh, dtype=dtype), (0,)),
    ]


def measure(op, what, got, want):
    got = got.detach().cpu()
    same = (bits(got) == bits(want)).float().mean().item()
    diff = (got.double() - want.double()).abs()
    print(f"\nstrict-cuda-grad-vs-cpu {op} {what} {tuple(got.shape)} {str(got.dtype).removeprefix('torch.')}: "
          f"max|Δ| {diff[torch.isfinite(diff)].max().item():.3e}  bytes equal {same:.6f}")
    return same


# ----------------------------------------------------------------------------- equal to the CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("full", [False, True], ids=["tiny", "full-width"])
def test_row_grads_equal_strict_cpu_bytes(dtype, full):
    for op, inputs, go, wrt in _cases(dtype, full):
        got = _grads(cuda(op), inputs, go, wrt, "cuda")
        want = _grads(cpu(op), inputs, go, wrt, "cpu")
        for i, g, w in zip(wrt, got, want):
            assert g.device.type == "cuda"
            assert measure(op, f"d{i}", g, w) == 1.0, f"{op}: gradient of input {i} differs from strict CPU"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_txt_in_norm_grads_equal_cpu_given_the_gemm_grad_and_whole_backward_matches_fp64(dtype):
    e, gain = _g(20, 2, 211, DJ, dtype=dtype, scale=2.0), _g(21, DJ, dtype=dtype, shift=1.0)
    dy = _g(22, 2, 211, DJ)  # the FP32 gradient of the norm's output (what the GEMM's dX gives)
    dy[0, 150:] = 0
    got = rb.rms_gain_grads(dy.cuda(), e.cuda(), gain.cuda(), 1e-6, (True, True))
    xhat, rstd = embed.rms_parts(e.float(), 1e-6)
    want = embed.rms_gain_grads(dy, e, gain, xhat, rstd, (True, True))
    for what, g, w in zip(("de", "dgain"), got, want):
        assert measure("txt_in_rmsnorm_linear", what, g, w) == 1.0, f"txt_in {what} differs from strict CPU"
    w, b = _g(23, D, DJ, dtype=dtype, scale=0.02), _g(24, D, dtype=dtype)
    go = _g(25, 2, 211, D, dtype=dtype)
    grads = _grads(cuda("txt_in_rmsnorm_linear"), (e, gain, w, b), go, (0, 1, 2, 3), "cuda")
    leaves = [t.double().requires_grad_(True) for t in (e, gain, w, b)]
    fp64 = torch.autograd.grad(ref.txt_in_rmsnorm_linear(*leaves), leaves, go.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    for what, g, r in zip(("de", "dgain", "dw", "db"), grads, fp64):
        err = ((g.double().cpu() - r).abs() / (1 + r.abs())).max().item()
        print(f"\nstrict-cuda-grad-vs-fp64 txt_in_rmsnorm_linear {what} {str(dtype).removeprefix('torch.')}: {err:.3e}")
        assert err <= tol, f"txt_in {what}: scaled error {err:.3g} > {tol}"


# ----------------------------------------------------------------------------- invariance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_modulation_and_gate_grads_invariant_at_full_width(dtype):
    x = _g(30, 3, N_IMG, D, dtype=dtype, scale=2.0, device="cuda")
    shift, scale = _g(31, 3, D, dtype=dtype, device="cuda"), _g(32, 3, D, dtype=dtype, scale=0.3, device="cuda")
    y, gate = _g(33, 3, N_IMG, D, dtype=dtype, device="cuda"), _g(34, 3, D, dtype=dtype, device="cuda")
    go = _g(35, 3, N_IMG, D, dtype=dtype, device="cuda")
    mod, res = cuda("adaln_modulation"), cuda("adaln_gate_residual")
    full = _grads(mod, (x, shift, scale), go, (0, 1, 2), "cuda")
    again = _grads(mod, (x, shift, scale), go, (0, 1, 2), "cuda")
    gates = _grads(res, (x, gate, y), go, (1, 2), "cuda")
    for what, a, b in zip(("dx", "dshift", "dscale"), full, again):
        assert_same_bytes(a, b, f"{what}: repetition")
    for i in range(3):
        sl = slice(i, i + 1)
        alone = _grads(mod, (x[sl], shift[sl], scale[sl]), go[sl], (0, 1, 2), "cuda")
        for what, a, b in zip(("dx", "dshift", "dscale"), full, alone):
            assert_same_bytes(a[sl], b, f"{what}: sample {i} of 3 vs alone")
        g_alone = _grads(res, (x[sl], gate[sl], y[sl]), go[sl], (1, 2), "cuda")
        for what, a, b in zip(("dgate", "dy"), gates, g_alone):
            assert_same_bytes(a[sl], b, f"{what}: sample {i} of 3 vs alone")
    pad = 97  # prompt padding: trailing rows of zero gradient, arbitrary inputs
    xp = torch.cat([x[1:2], _g(36, 1, pad, D, dtype=dtype, device="cuda")], 1)
    gp = torch.cat([go[1:2], torch.zeros(1, pad, D, dtype=dtype, device="cuda")], 1)
    padded = _grads(mod, (xp, shift[1:2], scale[1:2]), gp, (0, 1, 2), "cuda")
    assert_same_bytes(padded[0][:, :N_IMG], full[0][1:2], "dx: padded vs unpadded")
    assert not padded[0][:, N_IMG:].any(), "dx of the padding rows"
    for what, a, b in zip(("dshift", "dscale"), padded[1:], full[1:]):
        assert_same_bytes(a, b[1:2], f"{what}: padded vs unpadded")


def test_qk_gain_grad_is_the_tree_of_per_sample_grads_at_full_width():
    x = _g(40, 3, N_IMG, HEADS, DH, dtype=torch.bfloat16, scale=2.0, device="cuda")
    gain, go = _g(41, DH, dtype=torch.bfloat16, device="cuda"), _g(42, 3, N_IMG, HEADS, DH, dtype=torch.bfloat16, device="cuda")
    qk = cuda("qk_rmsnorm")
    dx, dgain = _grads(qk, (x, gain), go, (0, 1), "cuda")
    ones = [_grads(qk, (x[i:i + 1], gain), go[i:i + 1], (0, 1), "cuda") for i in range(3)]
    for i in range(3):
        assert_same_bytes(dx[i:i + 1], ones[i][0], f"dx of sample {i} vs alone")
    # the FP32 per-sample partials are what the tree adds; compare them, then the cast total
    parts = [rb.sample_row_sums(go[i:i + 1], rb._k().norm_grads(x[i:i + 1], go[i:i + 1], 1e-6, gain=gain,
                                                                 dx_dtype=None, want_xhat=True)[1]) for i in range(3)]
    whole = rb.sample_row_sums(go, rb._k().norm_grads(x, go, 1e-6, gain=gain, dx_dtype=None, want_xhat=True)[1])
    assert_same_bytes(whole, torch.cat(parts), "per-sample dgain partials in batch 3 vs alone")
    assert_same_bytes(dgain, tree_sum_stack([p[0] for p in parts]).to(gain.dtype), "dgain = tree of the partials")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_final_adaln_grads_cpu_bytes_given_emb_fp64_and_invariance(dtype):
    """norm_out's backward at full width: dx equals strict CPU's given the forward's emb (the
    GEMM's K order is cuda1's, so emb itself is not the CPU's); dx, dw, db against FP64; every
    gradient of a sample alone equals its part of batch 3, and dw, db (FP32) are the pairwise tree
    of the samples' own."""
    n = 997
    x = _g(70, 3, n, D, dtype=dtype, scale=2.0, shift=0.3)
    temb, w, b = _g(71, 3, D, dtype=dtype), _g(72, 2 * D, D, dtype=dtype, scale=0.02), _g(73, 2 * D, dtype=dtype)
    go = _g(74, 3, n, D, dtype=dtype)
    go[2, 600:] = 0  # sample 2's prompt padding
    op = cuda("final_adaln_out")
    full = _grads(op, (x, temb, w, b), go, (0, 2, 3), "cuda")
    emb = R._final_emb(temb.cuda(), w.cuda(), b.cuda()).cpu()  # [3, 2D] FP32: the forward's
    scale1 = 1.0 + emb[:, :D]
    xhat, rstd = adaln.layer_norm_parts(x.float(), 1e-6)
    dx_cpu = adaln._modulate_grads(go.float(), xhat, rstd, scale1, (True, False, False))[0].to(dtype)
    assert measure("final_adaln_out", "dx", full[0], dx_cpu) == 1.0, "final_adaln_out dx differs from strict CPU"
    leaves = [t.double().requires_grad_(True) for t in (x, temb, w, b)]
    fp64 = torch.autograd.grad(ref.final_adaln_out(*leaves), [leaves[0], leaves[2], leaves[3]], go.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    for what, g, r in zip(("dx", "dw", "db"), full, fp64):
        err = ((g.double().cpu() - r).abs() / (1 + r.abs())).max().item()
        print(f"\nstrict-cuda-grad-vs-fp64 final_adaln_out {what} {str(dtype).removeprefix('torch.')}: {err:.3e}")
        assert err <= tol, f"final_adaln_out {what}: scaled error {err:.3g} > {tol}"
    ones = [_grads(op, (x[i:i + 1], temb[i:i + 1], w, b), go[i:i + 1], (0, 2, 3), "cuda") for i in range(3)]
    for i in range(3):
        assert_same_bytes(full[0][i:i + 1], ones[i][0], f"dx of sample {i} vs alone")
    if dtype == torch.float32:
        for k, what in ((1, "dw"), (2, "db")):
            assert_same_bytes(full[k], tree_sum_stack([o[k] for o in ones]), f"{what} = tree of the samples'")


# ----------------------------------------------------------------------------- refusals, speed


def test_unsupported_dtypes_fail_closed():
    x = _g(50, 1, 3, 16, device="cuda")
    k = rb._k()
    with pytest.raises(UnsupportedConfigError, match="float16"):
        k.norm_grads(x.half(), x.half(), 1e-6, gain=_g(51, 16, device="cuda"), dx_dtype=torch.float16)
    with pytest.raises(UnsupportedConfigError, match="float64"):
        k.row_sums(x.double(), None, torch.tensor([3], device="cuda"))


def test_speed_of_the_modulation_backward_is_printed():
    x = _g(60, 1, N_IMG, D, dtype=torch.bfloat16, device="cuda").requires_grad_(True)
    shift = _g(61, 1, D, dtype=torch.bfloat16, device="cuda").requires_grad_(True)
    scale = _g(62, 1, D, dtype=torch.bfloat16, device="cuda").requires_grad_(True)
    go = _g(63, 1, N_IMG, D, dtype=torch.bfloat16, device="cuda")

    def prod():
        y = torch.nn.functional.layer_norm(x.float(), (D,), eps=1e-6) * (1 + scale.float()[:, None]) + shift.float()[:, None]
        y.to(torch.bfloat16).backward(go)

    def strict():
        cuda("adaln_modulation")(x, shift, scale).backward(go)

    for name, fn in (("production", prod), ("strict", strict)):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        print(f"\nadaln_modulation backward {name}: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms")
