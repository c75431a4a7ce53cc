"""The strict CUDA GEMM backward (contract ``grad.cuda1``) under Triton's interpreter, on CPU FP32.

What the interpreter proves of the backward's logic: accuracy of dX, dW, db, the GELU epilogue's
derivative and the LoRA factors' gradients against the FP64 references (``references/``); the
bias sums' and the GELU derivative's bytes equal to their stated FP32 orders computed by torch;
and raw-byte invariance within a run: dX rows independent of the batch size and position; a
sample's dW / db partial independent of its batch companions and of trailing zero-gradient rows;
the batch's dW / db equal to ``tree_sum_stack`` of its per-sample and of its aligned power-of-two
micro-batch gradients (the invariance the CPU's contract v2 gives). The GPU's own bytes:
``tests/gpu/test_strict_cuda_backward.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import impls
from drifttool.ops.strict.grad import attach_grad_sink, detach_grad_sinks
from drifttool.ops.strict_cuda import backward as bw
from drifttool.ops.strict_cuda import linear as cuda_linear
from drifttool.ops.strict_trees import tree_sum_stack
from drifttool.references import ops as ref
from tests.conftest import assert_same_bytes
from tests.strict_cuda_cases import gelu_tanh_f32_grad_order, gelu_tanh_f32_order, segment_order

gb = pytest.importorskip("drifttool.ops.strict_cuda.kernels.gemm_backward")


def op(name: str):
    """The registered strict CUDA function itself (its constraints ask for CUDA tensors)."""
    return impls(name, "strict", "cuda")[0].fn


def rn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def assert_close(y: torch.Tensor, r: torch.Tensor, what: str, tol: float = 2e-5) -> None:
    err = (y.double() - r).abs() / (1 + r.abs())
    assert err.max().item() <= tol, f"{what}: max scaled error {err.max().item():.3g} > {tol:g}"


def test_parameter_grads_match_fp64_and_drop_trailing_zero_rows():
    dy, x = rn(3, 70, 96, seed=1), rn(3, 70, 100, seed=2)  # 70 rows: a tail chunk; K, N not tiles
    dy[1, 41:] = 0  # sample 1: 41 live rows
    assert bw.live_counts(dy).tolist() == [70, 41, 70]
    want = torch.einsum("brn,brk->nk", dy.double(), x.double())
    assert_close(bw.weight_grad(dy, x), want, "dW")
    assert_close(bw.bias_grad(dy), dy.double().sum((0, 1)), "db")
    parts = bw.sample_weight_grads(dy, x)
    assert_close(parts[1], dy[1, :41].double().T @ x[1, :41].double(), "sample 1's partial")


def test_bias_sums_are_the_stated_sequential_order():
    dy = rn(2, 21, 200, seed=3)  # 21 rows: 2 unrolled groups of 8, then 5 one by one
    dy[1, 13:] = 0
    got = gb.bias_grad_parts(dy, bw.live_counts(dy))
    for b, live in enumerate((21, 13)):
        s = torch.zeros(200)
        for r in range(live):
            s = s + dy[b, r]
        assert_same_bytes(got[b], s, f"sample {b}: sequential FP32 column sum")


def test_a_samples_partial_does_not_depend_on_its_companions_or_padding():
    dy, x = rn(3, 70, 96, seed=4), rn(3, 70, 100, seed=5)
    full_w, full_b = bw.sample_weight_grads(dy, x), gb.bias_grad_parts(dy, bw.live_counts(dy))
    for i in range(3):
        alone = bw.sample_weight_grads(dy[i:i + 1], x[i:i + 1])
        assert_same_bytes(full_w[i], alone[0], f"dW partial of sample {i} alone vs in the batch")
    # padded: 30 trailing rows of zero gradient (their x arbitrary) reduce as the unpadded sample
    dyp = torch.cat([dy[2:3], torch.zeros(1, 30, 96)], dim=1)
    xp = torch.cat([x[2:3], rn(1, 30, 100, seed=6)], dim=1)
    assert_same_bytes(bw.sample_weight_grads(dyp, xp)[0], full_w[2], "dW: padded sample vs unpadded")
    assert_same_bytes(gb.bias_grad_parts(dyp, bw.live_counts(dyp))[0], full_b[2], "db: padded vs unpadded")


def test_batch_grads_are_the_tree_of_microbatch_grads():
    dy, x = rn(4, 37, 72, seed=7), rn(4, 37, 80, seed=8)
    dw, db = bw.weight_grad(dy, x), bw.bias_grad(dy)
    ones = [bw.weight_grad(dy[i:i + 1], x[i:i + 1]) for i in range(4)]
    assert_same_bytes(dw, tree_sum_stack(ones), "dW = tree of batch-1 gradients")
    halves = [bw.weight_grad(dy[i:i + 2], x[i:i + 2]) for i in (0, 2)]
    assert_same_bytes(dw, tree_sum_stack(halves), "dW = tree of aligned micro-batches of 2")
    assert_same_bytes(db, tree_sum_stack([bw.bias_grad(dy[i:i + 2]) for i in (0, 2)]), "db micro-batches")
    three = bw.weight_grad(dy[:3], x[:3])
    assert_same_bytes(three, tree_sum_stack(ones[:3]), "odd batch: zero-padded tree")


def test_input_grad_rows_do_not_depend_on_batch():
    dy, w = rn(3, 13, 70, seed=9), rn(70, 100, seed=10, scale=0.1)
    full = bw.input_grad(dy, w, torch.float32)  # [3, 13, 100]
    assert_close(full, dy.double() @ w.double(), "dX")
    assert_same_bytes(full[2:3], bw.input_grad(dy[2:3], w, torch.float32), "sample 2 of 3 vs alone")
    assert_same_bytes(full[1, 5:6], bw.input_grad(dy[1, 5:6], w, torch.float32), "one row alone")


def test_gelu_derivative_is_its_stated_formula_and_accurate():
    pre = rn(7, 300, seed=11, scale=4.0)
    pre[0, :6] = torch.tensor([-60.0, -9.5, 0.0, -0.0, 30.0, float("nan")])
    g = rn(7, 300, seed=12)
    got = gb.gelu_tanh_f32_grad(g, pre, torch.float32)
    assert_same_bytes(got, gelu_tanh_f32_grad_order(g, pre), "GELU' of the FP32 formula")
    eye = torch.eye(300, dtype=torch.float64)  # GELU(pre·I + 0): the reference's GELU alone
    dpre = ref.vjp(ref.mlp_up_gemm_gelu, [pre[1:], eye, torch.zeros(300)], g[1:])[0]
    assert_close(got[1:], dpre, "GELU' vs FP64", tol=3e-6)


GEMMS = {  # op: (K, N)
    "latent_proj_gemm": (64, 96),
    "attn_out_bias_gemm": (96, 96),
    "mlp_up_gemm_gelu": (96, 160),
    "mlp_down_gemm": (160, 96),
}


@pytest.mark.parametrize("name", sorted(GEMMS))
def test_gemm_operators_backward_match_fp64(name):
    k, n = GEMMS[name]
    x = rn(2, 11, k, seed=13).requires_grad_(True)
    w = rn(n, k, seed=14, scale=1 / math.sqrt(k)).requires_grad_(True)
    b = rn(n, seed=15, scale=0.1).requires_grad_(True)
    gy = rn(2, 11, n, seed=16)
    op(name)(x, w, b).backward(gy)
    want = ref.vjp(ref.OPS[name], [x, w, b], gy)
    for got, r, what in zip((x.grad, w.grad, b.grad), want, ("dX", "dW", "db")):
        assert got.dtype == torch.float32
        assert_close(got, r, f"{name} {what}")


def test_qkv_backward_matches_fp64():
    d, heads = 96, 4
    x = rn(2, 9, d, seed=17).requires_grad_(True)
    ps = [rn(d, d, seed=18 + i, scale=1 / math.sqrt(d)) if i % 2 == 0 else rn(d, seed=18 + i, scale=0.1)
          for i in range(6)]
    ps = [p.requires_grad_(True) for p in ps]
    gs = [rn(2, 9, heads, d // heads, seed=30 + i) for i in range(3)]
    outs = op("qkv_bias_gemm")(x, *ps, heads)
    torch.autograd.backward(outs, gs)
    want = ref.vjp(ref.qkv_bias_gemm, [x, *ps, heads], gs)
    for got, r, what in zip((x.grad, *(p.grad for p in ps)), want, ("dX", "dWq", "dbq", "dWk", "dbk", "dWv", "dbv")):
        assert_close(got, r, f"qkv {what}")


def test_lora_merge_backward_matches_fp64():
    w = rn(96, 80, seed=40)
    a = rn(8, 80, seed=41, scale=0.1).requires_grad_(True)
    b = rn(96, 8, seed=42, scale=0.1).requires_grad_(True)
    d = rn(96, 80, seed=43)
    op("lora_merge")(w, a, b, 2.0).backward(d)
    _, da, db, _ = ref.vjp(ref.lora_merge, [w, a, b, 2.0], d)
    assert_close(a.grad, da, "dA")
    assert_close(b.grad, db, "dB")


def test_ledger_sinks_get_the_cuda_partials_and_dtypes_fail_closed():
    x = rn(1, 5, 64, seed=50).requires_grad_(True)
    w = rn(32, 64, seed=51).requires_grad_(True)
    got = []
    keys = [attach_grad_sink(w, lambda dy, xx, partials=None: got.append(partials(dy, xx)))]
    try:
        y = op("mlp_down_gemm")(x, w, None)
        g = rn(1, 5, 32, seed=52)
        y.backward(g)
    finally:
        detach_grad_sinks(keys)
    assert w.grad is None and x.grad is not None  # dW went to the sink, dX to autograd
    assert_same_bytes(got[0], bw.sample_weight_grads(g, x.detach()), "the sink's partials")
    with pytest.raises(UnsupportedConfigError, match="float16"):
        gb.weight_grad_parts(x.detach().half(), x.detach().half(), torch.ones(1, dtype=torch.int64))
    with pytest.raises(UnsupportedConfigError, match="FP32 pre"):
        gb.gelu_tanh_f32_grad(x.detach(), x.detach().double(), torch.float32)


def test_registered_trainable_operators():
    for name in bw.TRAINABLE:
        found = impls(name, "strict", "cuda")[0]
        assert "forward only" not in [c.name for c in found.constraints], name
    assert bw.grad_contract_id("mlp_up_gemm_gelu") == "qwenimage.mlp_up_gemm_gelu.grad.cuda1"
    assert bw.grad_contract_id("lora_merge") == "drifttool.lora_merge.grad.cuda1"


def test_weight_grad_in_sample_groups_is_the_same_bytes(monkeypatch):
    """``PARTIALS_BYTES`` bounds the partials held at once; the grouping moves no byte."""
    dy, x = rn(5, 9, 24, seed=60), rn(5, 9, 40, seed=61)
    whole = bw.weight_grad(dy, x)
    monkeypatch.setattr(bw, "PARTIALS_BYTES", 2 * 4 * 24 * 40)  # groups of 2 samples
    assert_same_bytes(bw.weight_grad(dy, x), whole, "groups of 2 vs one group")
    assert_same_bytes(whole, tree_sum_stack(list(bw.sample_weight_grads(dy, x))), "tree of the partials")


def test_recording_autograd_moves_no_forward_byte_and_pre_is_the_forwards():
    x, w, b = rn(2, 9, 96, seed=70), rn(160, 96, seed=71, scale=0.1), rn(160, seed=72, scale=0.1)
    for name in ("mlp_up_gemm_gelu", "mlp_down_gemm"):
        k = 160 if name == "mlp_down_gemm" else 96
        xx, ww = (rn(2, 9, 160, seed=73), rn(96, 160, seed=74, scale=0.1)) if k == 160 else (x, w)
        bb = b[:ww.shape[0]]
        plain = op(name)(xx, ww, bb)
        traced = op(name)(xx.clone().requires_grad_(True), ww.clone().requires_grad_(True), bb)
        assert_same_bytes(plain, traced.detach(), f"{name}: forward with autograd recording")
    pre = cuda_linear._mlp_up_pre(x, w, b)
    assert_same_bytes(op("mlp_up_gemm_gelu")(x, w, b), gelu_tanh_f32_order(pre), "forward = GELU(recomputed pre)")


def test_a_lora_factors_grad_is_its_segments_added_in_order():
    # dB [N, r] and dA [r, K] shapes: too few tiles, so the live rows run in SEG_ROWS segments
    n, r, rows = 48, 16, 2 * gb.SEG_ROWS + 77
    assert gb.wgrad_config(n, r, True).seg_rows == gb.SEG_ROWS
    assert gb.wgrad_config(3072, 3072, True).seg_rows is None  # a full weight: one chain
    dy, x = rn(2, rows, n, seed=40), rn(2, rows, r, seed=41)
    dy[1, rows - 300:] = 0  # sample 1: 300 trailing zero-gradient rows (prompt padding)
    live = bw.live_counts(dy)
    got = gb.weight_grad_parts(dy, x, live)
    assert_same_bytes(got, segment_order(gb, dy, x, live.tolist()), "dB: segments in order")
    assert_same_bytes(got[1:], gb.weight_grad_parts(dy[1:, :rows - 300], x[1:, :rows - 300], live[1:]),
                      "sample 1 without its padding rows")
    da = gb.weight_grad_parts(x, dy, bw.live_counts(x))  # dA-like: [r, n]
    assert_same_bytes(da, segment_order(gb, x, dy, bw.live_counts(x).tolist()), "dA: segments in order")
