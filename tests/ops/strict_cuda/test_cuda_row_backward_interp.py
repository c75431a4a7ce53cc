"""The strict CUDA backward of the row operators (``strict_cuda/row_backward.py``,
``kernels/rows_backward.py``; contract ``grad.cuda1``) under Triton's interpreter, on CPU FP32.

The kernels do the strict CPU backward's arithmetic in its order (pairwise trees over the row,
FP64 rstd, contract-v2 row sums, no FMA), so the interpreter's gradients must equal the CPU's
byte for byte; also: accuracy against FP64 gradients of ``references/`` (autograd in FP64), and
raw-byte invariance to batch size, position, prompt padding and rows per program. The GPU's own
bytes: ``tests/gpu/test_strict_cuda_row_backward.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import impls
from drifttool.ops.strict import adaln, attention, embed
from drifttool.ops.strict import grad as cpu_grad
from drifttool.ops.strict_cuda import backward as bw
from drifttool.ops.strict_cuda import row_backward as rb
from drifttool.ops.strict_cuda import rows as R
from drifttool.ops.strict_gemm import tiled_linear
from drifttool.ops.strict_trees import tree_sum_stack
from references import ops as ref
from tests.conftest import assert_same_bytes

K = pytest.importorskip("drifttool.ops.strict_cuda.kernels.rows_backward")


def _g(seed: int, *shape, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale + shift


def _grads(fn, inputs, go, wrt):
    """Run ``fn(*inputs)`` with gradients on the positions ``wrt``; backward of ``go`` → grads."""
    leaves = [t.detach().clone().requires_grad_(i in wrt) if isinstance(t, torch.Tensor) and not t.is_complex()
              else t for i, t in enumerate(inputs)]
    y = fn(*leaves)
    y.backward(go)
    return y.detach(), [leaves[i].grad for i in wrt]


def _fp64_grads(ref_fn, inputs, go, wrt):
    """Gradients of the FP64 reference (plain FP64 math, autograd in FP64)."""
    leaves = [t.detach().double().requires_grad_(i in wrt) if isinstance(t, torch.Tensor) and not t.is_complex()
              else t for i, t in enumerate(inputs)]
    y = ref_fn(*leaves)
    return torch.autograd.grad(y, [leaves[i] for i in wrt], go.double())


def _close(got, want, what, tol=2e-5):
    err = ((got.double() - want).abs() / (1 + want.abs())).max().item()
    assert err <= tol, f"{what}: max scaled error {err:.3g} > {tol:g}"


def _freqs(s, half, seed):
    return torch.polar(_g(seed, s, half).abs() + 0.5, _g(seed + 1, s, half) * 3).to(torch.complex64)


def _cases():
    """(op, CUDA fn, CPU fn, reference, inputs, go, wrt): awkward shapes; d = 1100 is a long row
    (P = 2048: two 1024-element tiles), 70 rows a tail block; sample 1's gradient padded."""
    go_ln = _g(3, 2, 70, 96)
    go_ln[1, 41:] = 0
    go_long = _g(7, 2, 5, 1100)
    x_q = _g(8, 2, 9, 3, 128, scale=2.0)
    return [
        ("adaln_modulation", R.adaln_modulation, adaln.adaln_modulation, ref.adaln_modulation,
         (_g(0, 2, 70, 96, scale=3.0, shift=0.5), _g(1, 2, 96), _g(2, 2, 96, scale=0.3)), go_ln, (0, 1, 2)),
        ("adaln_modulation long", R.adaln_modulation, adaln.adaln_modulation, ref.adaln_modulation,
         (_g(4, 2, 5, 1100, shift=-1.0), _g(5, 2, 1100), _g(6, 2, 1100, scale=0.3)), go_long, (0, 1, 2)),
        ("qk_rmsnorm", R.qk_rmsnorm, attention.qk_rmsnorm, ref.qk_rmsnorm,
         (x_q, _g(9, 128, shift=1.0)), _g(10, 2, 9, 3, 128), (0, 1)),
        ("qk_rmsnorm Dh=20", R.qk_rmsnorm, attention.qk_rmsnorm, ref.qk_rmsnorm,
         (_g(11, 3, 4, 2, 20), _g(12, 20)), _g(13, 3, 4, 2, 20), (0, 1)),
        ("adaln_gate_residual", R.adaln_gate_residual, adaln.adaln_gate_residual, ref.adaln_gate_residual,
         (_g(14, 3, 70, 96), _g(15, 3, 96), _g(16, 3, 70, 96)), _g(17, 3, 70, 96), (0, 1, 2)),
        ("multi_axis_rope", R.multi_axis_rope, attention.multi_axis_rope, ref.multi_axis_rope,
         (_g(18, 2, 9, 3, 16), _freqs(9, 8, 19)), _g(21, 2, 9, 3, 16), (0,)),
    ]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_grads_equal_strict_cpu_bytes_and_match_fp64(case):
    name, fn, cpu_fn, ref_fn, inputs, go, wrt = case
    y, got = _grads(fn, inputs, go, wrt)
    y_cpu, want = _grads(cpu_fn, inputs, go, wrt)
    assert_same_bytes(y, y_cpu, f"{name}: forward")
    fp64 = _fp64_grads(ref_fn, inputs, go, wrt)
    for i, g, w, r in zip(wrt, got, want, fp64):
        assert_same_bytes(g, w, f"{name}: gradient of input {i} vs strict CPU")
        _close(g, r, f"{name}: gradient of input {i} vs FP64", tol=2e-4 if name.startswith("adaln_mod") else 2e-5)


@pytest.fixture
def cpu_gemm(monkeypatch):
    """The strict CPU GEMM in the forward, and its backward (contract v2) in place of the CUDA
    GEMM's (whose N order differs by design), so the norm's backward is compared exactly."""
    def linear(x, w, b, *, out_dtype):
        return tiled_linear(x.float(), w.float(), None if b is None else b.float()).to(out_dtype)

    def linear_grads(dy, x, w, b, needs):
        dx, dw, db = cpu_grad.linear_grads(dy.float(), x, w.float(), needs)
        return dx, cpu_grad.cast_like(dw, w), cpu_grad.cast_like(db, b)

    monkeypatch.setattr(R, "_gemm", lambda: SimpleNamespace(linear=linear))
    monkeypatch.setattr(rb.bwd, "linear_grads", linear_grads)


def test_txt_in_grads_equal_strict_cpu_bytes_given_the_same_gemm(cpu_gemm):
    e, gain = _g(30, 2, 7, 1100, scale=2.0), _g(31, 1100, shift=1.0)
    w, b = _g(32, 48, 1100, scale=0.05), _g(33, 48)
    go = _g(34, 2, 7, 48)
    go[0, 5:] = 0  # prompt padding of sample 0
    inputs = (e, gain, w, b)
    y, got = _grads(R.txt_in_rmsnorm_linear, inputs, go, (0, 1, 2, 3))
    y_cpu, want = _grads(embed.txt_in_rmsnorm_linear, inputs, go, (0, 1, 2, 3))
    assert_same_bytes(y, y_cpu, "txt_in forward")
    fp64 = _fp64_grads(ref.txt_in_rmsnorm_linear, inputs, go, (0, 1, 2, 3))
    for what, g, wt, r in zip(("de", "dgain", "dw", "db"), got, want, fp64):
        assert_same_bytes(g, wt, f"txt_in {what} vs strict CPU")
        _close(g, r, f"txt_in {what} vs FP64", tol=1e-4)


def test_txt_in_grads_with_the_cuda_gemm_match_fp64():
    e, gain = _g(40, 2, 6, 80), _g(41, 80, shift=1.0)
    w, b = _g(42, 64, 80, scale=0.1), _g(43, 64)
    go = _g(44, 2, 6, 64)
    inputs = (e, gain, w, b)
    _, got = _grads(R.txt_in_rmsnorm_linear, inputs, go, (0, 1, 2, 3))
    fp64 = _fp64_grads(ref.txt_in_rmsnorm_linear, inputs, go, (0, 1, 2, 3))
    for what, g, r in zip(("de", "dgain", "dw", "db"), got, fp64):
        _close(g, r, f"txt_in {what} (CUDA GEMM) vs FP64", tol=1e-4)


def _final_inputs(seed, b=2, n=70, d=96):
    """x [b, n, d], temb [b, d], w [2d, d], b [2d] of final_adaln_out, and a gradient whose sample
    1 is padded after 41 rows."""
    go = _g(seed + 4, b, n, d)
    if b > 1:
        go[1, 41:] = 0
    return (_g(seed, b, n, d, scale=3.0, shift=0.5), _g(seed + 1, b, d), _g(seed + 2, 2 * d, d, scale=0.05),
            _g(seed + 3, 2 * d, scale=0.2)), go


def test_final_adaln_grads_equal_strict_cpu_bytes_given_the_same_gemm(cpu_gemm):
    inputs, go = _final_inputs(100)
    y, got = _grads(R.final_adaln_out, inputs, go, (0, 2, 3))
    y_cpu, want = _grads(adaln.final_adaln_out, inputs, go, (0, 2, 3))
    assert_same_bytes(y, y_cpu, "final_adaln_out forward")
    fp64 = _fp64_grads(ref.final_adaln_out, inputs, go, (0, 2, 3))
    for what, g, wt, r in zip(("dx", "dw", "db"), got, want, fp64):
        assert_same_bytes(g, wt, f"final_adaln_out {what} vs strict CPU")
        _close(g, r, f"final_adaln_out {what} vs FP64", tol=2e-4)


def test_final_adaln_grads_with_the_cuda_gemm_match_fp64_and_are_invariant():
    inputs, go = _final_inputs(110, b=3, n=37)
    _, full = _grads(R.final_adaln_out, inputs, go, (0, 2, 3))
    fp64 = _fp64_grads(ref.final_adaln_out, inputs, go, (0, 2, 3))
    for what, g, r in zip(("dx", "dw", "db"), full, fp64):
        _close(g, r, f"final_adaln_out {what} (CUDA GEMM) vs FP64", tol=2e-4)
    x, temb, w, b = inputs
    ones = [_grads(R.final_adaln_out, (x[i:i + 1], temb[i:i + 1], w, b), go[i:i + 1], (0, 2, 3))[1]
            for i in range(3)]
    for i in range(3):
        assert_same_bytes(full[0][i:i + 1], ones[i][0], f"dx of sample {i} vs alone")
    for k, what in ((1, "dw"), (2, "db")):
        assert_same_bytes(full[k], tree_sum_stack([o[k] for o in ones]), f"{what} = tree of batch-1 {what}s")
    # prompt padding: sample 1's gradient is zero after row 41; 20 more such rows change nothing
    xp = torch.cat([x[1:2], _g(115, 1, 20, x.shape[2])], 1)
    gp = torch.cat([go[1:2], torch.zeros(1, 20, x.shape[2])], 1)
    _, pad = _grads(R.final_adaln_out, (xp, temb[1:2], w, b), gp, (0, 2, 3))
    assert_same_bytes(pad[0][:, :37], ones[1][0], "dx: padded vs unpadded")
    for k, what in ((1, "dw"), (2, "db")):
        assert_same_bytes(pad[k], ones[1][k], f"{what}: padded vs unpadded")


def test_final_adaln_refuses_a_temb_gradient():
    found = impls("final_adaln_out", "strict", "cuda")[0]
    check = next(c for c in found.constraints if c.name == "temb without a gradient")
    (x, temb, w, b), _ = _final_inputs(120, b=1, n=3, d=16)
    assert check({"x": x, "temb": temb, "w": w, "b": b}) is None
    why = check({"x": x, "temb": temb.requires_grad_(), "w": w, "b": b})
    assert why is not None and "temb requires a gradient" in why
    with torch.no_grad():
        assert check({"x": x, "temb": temb, "w": w, "b": b}) is None


# ----------------------------------------------------------------------------- invariance


def test_row_sums_are_contract_v2_with_signed_zeros_and_many_blocks():
    """Sums of 600 rows (10 blocks, the last of 24 rows), 68 rows (a last block of 4 rows: its
    tree has 4 leaves, none padded, so a column of −0 sums to −0, as the CPU's; padded to 64
    leaves it would be +0) and 3 rows; the second sample half padded; 0 live rows → +0."""
    for rows in (600, 68, 3):
        t = _g(50 + rows, 2, rows, 70)
        t[:, :, 0] = -0.0
        t[1, rows // 2:] = 0
        got = rb.sample_row_sums(t)
        assert_same_bytes(got, cpu_grad.row_sum(t), f"{rows} rows vs grad.row_sum")
        assert torch.signbit(got[0, 0]) == (rows == 68), f"{rows} rows: the sign of the −0 column's sum"
    t, u = _g(56, 3, 3001, 5), _g(57, 3, 3001, 5)  # 47 blocks: segments of 6 and 5, the last block 57 rows
    t[2, 2900:] = 0
    assert_same_bytes(rb.sample_row_sums(t, u), cpu_grad.row_sum(t * u), "3001 rows of products")
    zero = K.row_sums(_g(1, 2, 5, 7), None, torch.tensor([0, 5]))
    assert not torch.signbit(zero[0]).any() and (zero[0] == 0).all()


def test_grads_do_not_depend_on_batch_position_or_padding():
    x, shift, scale = _g(60, 3, 37, 72, shift=0.3), _g(61, 3, 72), _g(62, 3, 72, scale=0.2)
    go = _g(63, 3, 37, 72)
    _, full = _grads(R.adaln_modulation, (x, shift, scale), go, (0, 1, 2))
    for i in range(3):
        _, alone = _grads(R.adaln_modulation, (x[i:i + 1], shift[i:i + 1], scale[i:i + 1]), go[i:i + 1], (0, 1, 2))
        for what, a, b in zip(("dx", "dshift", "dscale"), full, alone):
            assert_same_bytes(a[i:i + 1], b, f"{what}: sample {i} in batch 3 vs alone")
    # prompt padding: 29 trailing rows of zero gradient (arbitrary x) leave sample 1's grads as they were
    xp = torch.cat([x[1:2], _g(64, 1, 29, 72)], 1)
    gp = torch.cat([go[1:2], torch.zeros(1, 29, 72)], 1)
    _, pad = _grads(R.adaln_modulation, (xp, shift[1:2], scale[1:2]), gp, (0, 1, 2))
    assert_same_bytes(pad[0][:, :37], full[0][1:2], "dx: padded vs unpadded")
    for what, a, b in zip(("dshift", "dscale"), pad[1:], full[1:]):
        assert_same_bytes(a, b[1:2], f"{what}: padded vs unpadded")
    y, gate, g = _g(65, 3, 37, 72), _g(66, 3, 72), _g(67, 3, 37, 72)
    _, (dgate,) = _grads(R.adaln_gate_residual, (x, gate, y), g, (1,))
    _, (dgate2,) = _grads(R.adaln_gate_residual, (x[2:], gate[2:], y[2:]), g[2:], (1,))
    assert_same_bytes(dgate[2:], dgate2, "dgate: sample 2 of 3 vs alone")


def test_gain_grad_is_the_tree_of_per_sample_grads():
    x, gain, go = _g(70, 4, 5, 3, 128), _g(71, 128), _g(72, 4, 5, 3, 128)
    go[3, 2:] = 0
    _, (dx, dgain) = _grads(R.qk_rmsnorm, (x, gain), go, (0, 1))
    ones = [_grads(R.qk_rmsnorm, (x[i:i + 1], gain), go[i:i + 1], (0, 1))[1] for i in range(4)]
    assert_same_bytes(dgain, tree_sum_stack([o[1] for o in ones]), "dgain = tree of batch-1 dgain")
    halves = [_grads(R.qk_rmsnorm, (x[i:i + 2], gain), go[i:i + 2], (1,))[1][0] for i in (0, 2)]
    assert_same_bytes(dgain, tree_sum_stack(halves), "dgain = tree of aligned micro-batches")
    for i in range(4):
        assert_same_bytes(dx[i:i + 1], ones[i][0], f"dx of sample {i} vs alone")


@pytest.mark.parametrize("d", [128, 1100])
def test_norm_grads_do_not_depend_on_rows_per_program(d):
    x, go, gain = _g(80, 2, 7, d), _g(81, 2, 7, d), _g(82, d)
    scale = _g(83, 2, d, scale=0.2)
    for kw in (dict(gain=gain), dict(scale=scale)):
        base = K.norm_grads(x, go, 1e-6, dx_dtype=torch.float32, want_xhat=True, **kw)
        for per in (1, 4):
            other = K.norm_grads(x, go, 1e-6, dx_dtype=torch.float32, want_xhat=True, rows_per_program=per, **kw)
            assert_same_bytes(other[0], base[0], f"dx, {per} rows per program")
            assert_same_bytes(other[1], base[1], f"xhat, {per} rows per program")


# ----------------------------------------------------------------------------- fail closed


def test_unsupported_dtypes_and_shapes_fail_closed():
    x = _g(90, 1, 3, 16)
    with pytest.raises(UnsupportedConfigError, match="float16"):
        K.norm_grads(x.half(), x.half(), 1e-6, gain=_g(91, 16), dx_dtype=torch.float16)
    with pytest.raises(UnsupportedConfigError, match="float64"):
        K.row_sums(x.double(), None, torch.tensor([3]))
    with pytest.raises(UnsupportedConfigError, match="float16"):
        K.gate_grad(x.half(), _g(92, 1, 16).half(), torch.float16)
    with pytest.raises(UnsupportedConfigError, match="complex64"):
        K.rope_grad(x.reshape(1, 3, 1, 16), _freqs(3, 8, 93).to(torch.complex128), torch.float32)
    with pytest.raises(UnsupportedConfigError, match="do not match"):
        K.norm_grads(x, x, 1e-6, scale=_g(94, 2, 16), dx_dtype=torch.float32)


def test_row_operators_are_registered_trainable_with_grad_contracts():
    for name in ("qk_rmsnorm", "txt_in_rmsnorm_linear", "adaln_modulation", "adaln_gate_residual",
                 "multi_axis_rope", "final_adaln_out"):
        assert name in bw.TRAINABLE
        found = impls(name, "strict", "cuda")[0]
        assert "forward only" not in [c.name for c in found.constraints], name
        assert bw.grad_contract_id(name) == f"qwenimage.{name}.grad.cuda1"
    assert "latent_normalize" not in bw.TRAINABLE
