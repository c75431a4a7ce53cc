"""The strict CUDA GEMM backward (contract ``grad.cuda1``) on the GPU, in raw bytes (bf16 operands
on the tensor cores): dX rows do not depend on batch size or position; a sample's dW / db partial
does not depend on its companions, its position, the batch size or trailing zero-gradient rows;
the batch's dW / db equal ``tree_sum_stack`` of its batch-1 and of its aligned micro-batch
gradients (the invariance strict CPU's contract v2 gives), at 4099 rows per sample (odd, past
4096) and at odd row counts; the mlp_up backward's recomputed pre-activation is the forward's;
accuracy vs FP64; strict CUDA vs strict CPU gradients within a tolerance (one line per gradient
with ``-s``); fail-closed refusals.

    $ python -m pytest tests/gpu/test_strict_cuda_backward.py -n 0 -s
"""

from __future__ import annotations

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implementation
from drifttool.ops.strict.grad import attach_grad_sink, detach_grad_sinks
from drifttool.ops.strict_cuda import backward as bw
from drifttool.ops.strict_cuda import linear as cuda_linear
from drifttool.ops.strict_trees import tree_sum_stack
from drifttool.references import ops as ref
from tests.conftest import assert_same_bytes
from tests.strict_cuda_cases import gelu_tanh_f32_grad_order, gelu_tanh_f32_order, lin, rn, segment_order

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():  # without CUDA, importing the kernels here would decorate them before
    # tests/ops/strict_cuda/conftest.py sets TRITON_INTERPRET=1 for the interpreter suite
    from drifttool.ops.strict_cuda.kernels import gemm_backward as gb

D, HEADS, MLP = 3072, 24, 12288
ROWS = 4099  # rows per sample: past 4096, odd, a tail chunk of 3 rows
SHAPES = {"img_in": (D, 64), "proj_out": (64, D), "attn_out": (D, D), "mlp_up": (MLP, D), "mlp_down": (D, MLP)}
"""Weight shapes [N, K] of the model's GEMMs."""


def cuda(op):
    return implementation(op, "strict", "cuda")


def cpu(op):
    return implementation(op, "strict", "cpu")


# ---------------------------------------------------------------------------------------------
# raw-byte invariance


@pytest.mark.parametrize("shape", list(SHAPES))
def test_input_grad_rows_do_not_depend_on_batch(shape):
    n, k = SHAPES[shape]
    w = lin(n, k, seed=1)[0]
    dy = rn(3, ROWS, n, seed=2)
    full = bw.input_grad(dy, w, torch.bfloat16)  # [3, 4099, K]
    assert_same_bytes(full, bw.input_grad(dy, w, torch.bfloat16), f"{shape}: repetition")
    assert_same_bytes(full[2:], bw.input_grad(dy[2:], w, torch.bfloat16), f"{shape}: batch 1 vs position 2 of 3")
    assert_same_bytes(full[0, :1], bw.input_grad(dy[0, :1], w, torch.bfloat16), f"{shape}: row 0 alone")
    assert_same_bytes(full[1, -3:], bw.input_grad(dy[1, -3:], w, torch.bfloat16), f"{shape}: last 3 rows alone")
    odd = bw.input_grad(dy[:, :1001], w, torch.bfloat16)  # 3003 rows in all
    assert_same_bytes(full[:, :1001], odd, f"{shape}: 1001 rows per sample")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_samples_weight_and_bias_partials_do_not_depend_on_the_batch(shape):
    n, k = SHAPES[shape]
    dy, x = rn(3, ROWS, n, seed=3), rn(3, ROWS, k, seed=4)
    parts = bw.sample_weight_grads(dy, x)  # [3, N, K] fp32
    sums = gb.bias_grad_parts(dy, bw.live_counts(dy))
    assert_same_bytes(parts, bw.sample_weight_grads(dy, x), f"{shape}: repetition")
    for i in range(3):
        assert_same_bytes(parts[i:i + 1], bw.sample_weight_grads(dy[i:i + 1], x[i:i + 1]),
                          f"{shape}: dW partial of sample {i} alone vs in batch 3")
        alone = dy[i:i + 1]
        assert_same_bytes(sums[i:i + 1], gb.bias_grad_parts(alone, bw.live_counts(alone)), f"{shape}: db {i}")
    pad_dy = torch.cat([dy[1:2], torch.zeros(1, 37, n, dtype=dy.dtype, device="cuda")], 1)  # prompt padding
    pad_x = torch.cat([x[1:2], rn(1, 37, k, seed=5)], 1)
    assert_same_bytes(parts[1:2], bw.sample_weight_grads(pad_dy, pad_x), f"{shape}: 37 zero-gradient rows after")
    assert_same_bytes(sums[1:2], gb.bias_grad_parts(pad_dy, bw.live_counts(pad_dy)), f"{shape}: db padded")


@pytest.mark.parametrize("rows", [1, 63, 65, 4097])
def test_odd_row_counts_and_batch_composition(rows):
    n, k = D, D
    dy, x = rn(4, rows, n, seed=6), rn(4, rows, k, seed=7)
    dw, db = bw.weight_grad(dy, x), bw.bias_grad(dy)
    ones = [bw.weight_grad(dy[i:i + 1], x[i:i + 1]) for i in range(4)]
    assert_same_bytes(dw, tree_sum_stack(ones), f"{rows} rows: batch 4 = tree of batch 1s")
    pairs = [bw.weight_grad(dy[i:i + 2], x[i:i + 2]) for i in (0, 2)]
    assert_same_bytes(dw, tree_sum_stack(pairs), f"{rows} rows: batch 4 = tree of micro-batches of 2")
    assert_same_bytes(bw.weight_grad(dy[:3], x[:3]), tree_sum_stack(ones[:3]), f"{rows} rows: batch 3")
    assert_same_bytes(db, tree_sum_stack([bw.bias_grad(dy[i:i + 1]) for i in range(4)]), f"{rows} rows: db")


def test_bias_sums_are_the_stated_sequential_order():
    dy = rn(2, 77, D, seed=8)
    got = gb.bias_grad_parts(dy, bw.live_counts(dy))
    s = torch.zeros(2, D, device="cuda")
    for r in range(77):
        s = s + dy[:, r].float()
    assert_same_bytes(got, s, "sequential FP32 column sums (IEEE: any device)")


def test_mlp_up_backward_recomputes_the_forwards_pre_activation():
    x, (w, b) = rn(2, 1001, D, seed=9), lin(MLP, D, seed=10)
    pre = cuda_linear._mlp_up_pre(x, w, b)  # what the backward recomputes, FP32
    y = cuda("mlp_up_gemm_gelu")(x, w, b)
    assert_same_bytes(y, gelu_tanh_f32_order(pre).to(torch.bfloat16), "forward = GELU_f32(recomputed pre)")
    g = rn(2, 1001, MLP, seed=11)
    assert_same_bytes(gb.gelu_tanh_f32_grad(g, pre, torch.bfloat16),
                      gelu_tanh_f32_grad_order(g, pre).to(torch.bfloat16), "GELU' of the FP32 formula")


def test_autograd_chain_batch_invariance_with_fp32_merged_weights():
    """x → mlp_up → mlp_down with FP32 (merged, LoRA-style) weights: x.grad rows of batch 3 are
    each sample's alone, and the weights' FP32 gradients are the tree of the batch-1 ones."""
    w1, b1 = (t.float() for t in lin(MLP, D, seed=12))
    w2, b2 = (t.float() for t in lin(D, MLP, seed=14))
    x = rn(3, 1025, D, seed=16)
    gy = rn(3, 1025, D, seed=17)

    def grads(sl):
        xs = x[sl].clone().requires_grad_(True)
        ps = [t.clone().requires_grad_(True) for t in (w1, b1, w2, b2)]
        y = cuda("mlp_down_gemm")(cuda("mlp_up_gemm_gelu")(xs, ps[0], ps[1]), ps[2], ps[3])
        y.backward(gy[sl])
        return xs.grad, [p.grad for p in ps]

    gx, gp = grads(slice(0, 3))
    ones = [grads(slice(i, i + 1)) for i in range(3)]
    for i in range(3):
        assert_same_bytes(gx[i:i + 1], ones[i][0], f"dX of sample {i}")
    for j, name in enumerate(("dW1", "db1", "dW2", "db2")):
        assert gp[j].dtype == torch.float32
        assert_same_bytes(gp[j], tree_sum_stack([o[1][j] for o in ones]), f"{name}: tree of batch 1s")


# ---------------------------------------------------------------------------------------------
# accuracy and strict CPU


def test_grads_accurate_vs_fp64():
    n, k, rows = D, D, 300
    dy, x, w = rn(2, rows, n, seed=20), rn(2, rows, k, seed=21), lin(n, k, seed=22)[0]
    u = 2.0**-24
    want = torch.einsum("brn,brk->nk", dy.double().cpu(), x.double().cpu())
    mag = torch.einsum("brn,brk->nk", dy.double().cpu().abs(), x.double().cpu().abs())
    err = (bw.weight_grad(dy, x).cpu().double() - want).abs()
    assert (err <= 4 * 2 * rows * u * mag + 1e-30).all(), f"dW: max error {err.max().item():.3g}"
    want_x = dy.double().cpu() @ w.double().cpu()
    mag_x = dy.double().cpu().abs() @ w.double().cpu().abs()
    err = (bw.input_grad(dy, w, torch.float32).cpu().double() - want_x).abs()
    assert (err <= 4 * n * u * mag_x + 1e-30).all(), f"dX: max error {err.max().item():.3g}"
    a, b = rn(16, k, seed=23, dtype=torch.float32), rn(n, 16, seed=24, dtype=torch.float32, scale=0.01)
    d = rn(n, k, seed=25, dtype=torch.float32)
    da, db = bw.lora_grads(d, a, b, 2.0)
    _, ra, rb, _ = ref.vjp(ref.lora_merge, [w.cpu(), a.cpu(), b.cpu(), 2.0], d.cpu())
    for got, r, what in ((da, ra, "dA"), (db, rb, "dB")):
        e = (got.cpu().double() - r).abs().max().item()
        assert e <= 1e-5 * r.abs().max().item(), f"{what}: max error {e:.3g}"


def _op_case(op, tokens, d, heads, mlp, seed=30):
    """(args, kwargs, indices of the differentiated tensors) of a GEMM operator, bf16, on the CPU."""
    def x_(k):
        return rn(2, tokens, k, seed=seed, device="cpu")

    if op == "qkv_bias_gemm":
        ws = [t for i in range(3) for t in lin(d, d, seed=seed + 2 * i, device="cpu")]
        return (x_(d), *ws, heads), tuple(range(7))
    n, k = {"latent_proj_gemm": (d, 64), "attn_out_bias_gemm": (d, d), "mlp_up_gemm_gelu": (mlp, d),
            "mlp_down_gemm": (d, mlp)}[op]
    return (x_(k), *lin(n, k, seed + 10, device="cpu")), (0, 1, 2)


def _run(fn, args, diff, gys=None, seed=40):
    args = [a.clone().requires_grad_(True) if i in diff else a for i, a in enumerate(args)]
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    if gys is None:
        gys = [rn(*o.shape, seed=seed + j, device="cpu") for j, o in enumerate(outs)]
    torch.autograd.backward(outs, [g.to(o.device) for g, o in zip(gys, outs)])
    return [args[i].grad.cpu() for i in diff], gys


@pytest.mark.parametrize("geometry", ["tiny", "full"])
@pytest.mark.parametrize("op", ["latent_proj_gemm", "qkv_bias_gemm", "attn_out_bias_gemm", "mlp_up_gemm_gelu",
                                "mlp_down_gemm"])
def test_measure_strict_cuda_vs_strict_cpu_gradients(op, geometry):
    """Prints one line per gradient; asserts a bound relative to the gradient's magnitude: the CPU
    (contract v2, FP32 dpre) and CUDA (grad.cuda1, bf16 dpre) orders differ by design."""
    d, heads, mlp, tokens = (32, 2, 128, 7) if geometry == "tiny" else (D, HEADS, MLP, 64)
    args, diff = _op_case(op, tokens, d, heads, mlp)
    want, gys = _run(cpu(op), args, diff)
    got, _ = _run(cuda(op), [a.cuda() if isinstance(a, torch.Tensor) else a for a in args], diff, gys)
    for i, g, w in zip(diff, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (op, i)
        scale = w.double().abs().max().item()
        dev = (g.double() - w.double()).abs().max().item()
        equal = (g == w).double().mean().item()
        print(f"\nstrict-cuda vs strict-cpu {op} grad[{i}] {geometry}: max|Δ| {dev:.3g} (max |g| {scale:.3g}), "
              f"bytes equal {equal:.4f}")
        assert dev <= 2.0**-5 * max(scale, 1e-30), f"{op} grad[{i}]: {dev:.3g} vs scale {scale:.3g}"


def test_lora_merge_backward_vs_strict_cpu():
    n, k = 1000, 777  # awkward: neither a multiple of 64
    w = lin(n, k, seed=50, device="cpu")[0]
    a = rn(16, k, seed=51, dtype=torch.float32, device="cpu")
    b = rn(n, 16, seed=52, dtype=torch.float32, device="cpu", scale=0.01)
    d = rn(n, k, seed=53, dtype=torch.float32, device="cpu")

    def grads(fn, dev):
        # clone: on the CPU .to() would return (and mark) the shared leaf itself
        aa, bb = (t.to(dev, copy=True).requires_grad_(True) for t in (a, b))
        fn(w.to(dev), aa, bb, 2.0).backward(d.to(dev))
        return aa.grad.cpu(), bb.grad.cpu()

    got, want = grads(cuda("lora_merge"), "cuda"), grads(cpu("lora_merge"), "cpu")
    assert_same_bytes(got[0], grads(cuda("lora_merge"), "cuda")[0], "dA repetition")
    for g, r, what in zip(got, want, ("dA", "dB")):
        dev = (g.double() - r.double()).abs().max().item()
        assert dev <= 1e-5 * r.double().abs().max().item(), f"{what}: {dev:.3g}"


# ---------------------------------------------------------------------------------------------
# fail closed


def test_fails_closed_on_forward_only_operators_and_ledger_sinks_get_the_partials():
    temb = rn(1, 64, seed=60).requires_grad_(True)
    w, b = lin(6 * 64, 64, seed=61)
    with pytest.raises(UnsupportedConfigError, match="forward only"):
        cuda("adaln_mod_projection")(temb, w, b)
    x = rn(1, 7, 64, seed=62).requires_grad_(True)
    w2 = lin(D, 64, seed=63)[0].requires_grad_(True)
    got = []
    keys = [attach_grad_sink(w2, lambda dy, xx, partials=None: got.append(partials(dy, xx)))]
    try:
        y = cuda("latent_proj_gemm")(x, w2, None)
        g = rn(1, 7, D, seed=64)
        y.backward(g)
    finally:
        detach_grad_sinks(keys)
    assert w2.grad is None and x.grad is not None
    assert_same_bytes(got[0], bw.sample_weight_grads(g, x.detach()), "the ledger sink's partials")


@pytest.mark.parametrize("n,k,xdt", [(D, 16, torch.float32), (16, MLP, torch.bfloat16), (64, D, torch.bfloat16)])
def test_a_lora_factors_grad_is_its_segments_added_in_order(n, k, xdt):
    # dB = dtᵀ·u [N, r] and dA = duᵀ·x [r, K] (x the bf16 activation): too few tiles for the GPU,
    # so the live rows run in SEG_ROWS-row segments whose partials are added in order
    assert gb.wgrad_config(n, k, True).seg_rows == gb.SEG_ROWS
    dy, x = rn(3, ROWS, n, seed=30, dtype=torch.float32), rn(3, ROWS, k, seed=31, dtype=xdt)
    dy[2, ROWS - 700:] = 0  # sample 2: 700 trailing zero-gradient rows (prompt padding)
    live = bw.live_counts(dy)
    got = gb.weight_grad_parts(dy, x, live)
    assert_same_bytes(got, segment_order(gb, dy, x, live.tolist()), f"[{n}, {k}]: segments in order")
    assert_same_bytes(got[2:], gb.weight_grad_parts(dy[2:, :ROWS - 700], x[2:, :ROWS - 700], live[2:]),
                      f"[{n}, {k}]: sample 2 alone, without its padding rows")
