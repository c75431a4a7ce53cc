"""The strict CUDA attention backward (``joint_attention_fused``, contract ``grad.cuda1``) on the
GPU, in raw bytes.

- dQ, dK, dV against FP64 autograd of the same masked attention, bf16 and FP32 (SDPA's backward
  error printed beside);
- the backward's P is the forward's bit for bit (dV under a one-hot output gradient against the
  unfused ``joint_attn_softmax``'s P), bf16 and FP32;
- full width (24 heads × 128, 165 text slots and 4096 image tokens, bf16; and a smaller FP32
  case): a sample's dQ, dK, dV do not change with the batch (alone vs at position 2 of 3 with
  other prompts), prompt padding (100 valid of 165 slots vs unpadded; NaN in every padded Q/K/V
  slot and in the padded rows' output gradient), repetition or dQ's query tile; masked positions
  get +0; the forward's bytes are the same with a gradient wanted;
- fail closed: the unfused operators and an SP rank's rows with a key mask refuse a gradient;
- MEASURED, printed: forward + backward time against masked SDPA's at the model's shapes.

Skipped without a GPU (CI has none); on the GPU machine:
``python -m pytest tests/gpu/test_strict_cuda_attention_backward.py -n 0 -s`` (``-s`` shows the
measurements).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implementation
from references import ops as ref
from tests import strict_cuda_cases as cases
from tests.conftest import assert_same_bytes, bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():  # without CUDA, importing the kernels here would decorate them before
    # tests/ops/strict_cuda/conftest.py sets TRITON_INTERPRET=1 for the interpreter suite
    from drifttool.ops.strict_cuda.kernels import attention as kern
    from drifttool.ops.strict_cuda.kernels import attention_backward as kb

TOL = {torch.bfloat16: 0.03, torch.float32: 1e-4}
"""Scaled error |got − FP64| / (1 + |FP64|). bf16: the declared casts (P̃ and G̃ to bf16 before
their products, the output, D from the bf16 output) give ≈ 0.008 at the accuracy shape in a torch
emulation of the same steps (SDPA's CPU backward: ≈ 0.01); 0.03 leaves 4×. FP32: FP32 sums over
≈ 1150 terms and ex2.approx; ≈ 1e-6 expected. A wrong mask, order or scale is off by O(1)."""


def cuda(op: str):
    return implementation(op, "strict", "cuda")


def joint(lens, text_len, n_img, heads, dh, dtype, seed=0, nan_pads=False):
    """``tests.strict_cuda_cases.joint`` on the GPU (NaN in padded Q slots too when ``nan_pads``)."""
    q, k, v, km = cases.joint(lens, text_len, n_img, heads, dh, dtype, seed=seed, device="cuda", nan_pads=nan_pads)
    if nan_pads:
        q = q.masked_fill(~km[:, :, None, None], float("nan"))
    return q, k, v, km


def out_grad(shape, dtype, seed, km=None):
    """A standard-normal output gradient (NaN on the masked rows when ``km`` is given)."""
    do = cases.rn(*shape, seed=seed, dtype=dtype)
    return do if km is None else do.masked_fill(~km[:, :, None, None], float("nan"))


def grads(q, k, v, km, text_len, do):
    """(o, dq, dk, dv) through the registered ``joint_attention_fused`` (constraints checked) and
    autograd."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = cuda("joint_attention_fused")(*leaves, km, text_len=text_len)
    o.backward(do)
    return (o.detach(), *(t.grad for t in leaves))


def assert_plus_zero(t: torch.Tensor, what: str) -> None:
    b = bits(t.cpu())
    assert t.numel() > 0 and torch.equal(b, torch.zeros_like(b)), f"{what}: not all +0"


# --------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grads_vs_fp64_and_sdpa(dtype):
    """128 text slots (valid 90), 1024 image tokens, 4 heads × 128; the output gradient of the
    masked rows is taken as 0 in the references (the strict backward does not read it)."""
    q, k, v, km = joint([90], 128, 1024, 4, 128, dtype, seed=3)
    do = out_grad(q.shape, dtype, seed=4)
    _, *got = grads(q, k, v, km, 128, do)
    live = km[:, :, None, None]
    leaves = [t.cpu().double().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(ref.joint_attention_fused(*leaves, km.cpu()), leaves,
                               (do.double() * live).cpu())
    sd_in = [t.detach().permute(0, 2, 1, 3).requires_grad_(True) for t in (q, k, v)]
    sd_out = F.scaled_dot_product_attention(*sd_in, attn_mask=km[:, None, None, :])
    sd = [g.permute(0, 2, 1, 3) for g in torch.autograd.grad(sd_out, sd_in, (do * live).permute(0, 2, 1, 3))]
    for name, g, s, w in zip(("dQ", "dK", "dV"), got, sd, want):
        assert g.dtype == dtype and g.shape == w.shape
        err = ((g.cpu().double() - w).abs() / (1 + w.abs())).max().item()
        err_sdpa = ((s.cpu().double() - w).abs() / (1 + w.abs())).max().item()
        print(f"\n{name} {dtype}: strict cuda max scaled err vs fp64 {err:.3g}, SDPA {err_sdpa:.3g}")
        assert err <= max(TOL[dtype], 2 * err_sdpa), f"{name}: {err:.3g}"
        assert_plus_zero(g[~km], f"{name} at masked positions")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_probabilities_are_the_forwards(dtype):
    """dO one-hot at one row per head: dV[:, j, h, 0] = P̃[h, i, j] exactly (the other products
    are +0), against the unfused softmax's P (= the fused forward's) cast to v's dtype."""
    L = 77
    q, k, v, km = joint([77, 40], L, 1000, 4, 128, dtype, seed=5, nan_pads=True)
    o, ml = kern.attention(q, k, v, km, text_len=L, with_stats=True)
    p = cuda("joint_attn_softmax")(cuda("joint_attn_qk_gemm")(q, k, km, text_len=L), km, text_len=L)
    rows = (3, L + 5, L + 500, L + 999)  # a text row, image rows in the first, a middle and the last tile
    do = torch.zeros_like(q)
    for h, i in enumerate(rows):
        do[:, i, h, 0] = 1.0
    do = do.masked_fill(~km[:, :, None, None], float("nan"))  # sample 1's padded rows: never read
    _, _, dv = kb.attention_grads(do, q, k, v, o, ml, km, text_len=L, needs=(False, False, True))
    for h, i in enumerate(rows):
        for b in range(2):
            if km[b, i]:
                assert_same_bytes(dv[b, :, h, 0].cpu(), p[b, h, i, :].to(dtype).cpu(),
                                  f"sample {b}, head {h}, row {i}: dV column vs the forward's P")


# --------------------------------------------------------------------------------- invariance


SHAPES = {  # label: (valid text lengths, text slots, image tokens, heads, dtype)
    "bf16_h24_l165_n4096": ([128, 5, 100], 165, 4096, 24, torch.bfloat16),
    "fp32_h4_l165_n1000": ([128, 5, 100], 165, 1000, 4, torch.float32),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def padded_batch(request):
    """Sample 2 (valid text 100) at position 2 of a batch of 3 padded to 165 text slots, NaN in
    every padded Q/K/V slot and padded output-gradient row; and the batch's gradients."""
    lens, lmax, n_img, heads, dtype = SHAPES[request.param]
    q, k, v, km = joint(lens, lmax, n_img, heads, 128, dtype, seed=6, nan_pads=True)
    do = out_grad(q.shape, dtype, seed=7, km=km)
    return request.param, (q, k, v, km, lmax, do), grads(q, k, v, km, lmax, do)


def test_gradients_invariant_to_batch_padding_and_repetition(padded_batch):
    label, (q, k, v, km, lmax, do), (o, dq, dk, dv) = padded_batch
    names = ("dQ", "dK", "dV")
    for name, g in zip(names, (dq, dk, dv)):
        assert torch.isfinite(g).all(), f"{label} {name}: not finite"
        assert_plus_zero(g[~km], f"{label} {name} at padded positions")
    again = grads(q, k, v, km, lmax, do)
    for name, a, b in zip(("o", *names), again, (o, dq, dk, dv)):
        assert_same_bytes(a.cpu(), b.cpu(), f"{label} {name}: repetition")
    alone = grads(q[2:], k[2:], v[2:], km[2:], lmax, do[2:])
    for name, a, b in zip(names, alone[1:], (dq, dk, dv)):
        assert_same_bytes(a.cpu(), b[2:].cpu(), f"{label} sample 2 {name}: batch 1 vs position 2 of 3")
    keep = torch.cat([torch.arange(100), torch.arange(lmax, q.shape[1])]).cuda()
    _, *single = grads(*(t[2:, keep] for t in (q, k, v)), None, 100, do[2:, keep])
    for name, a, b in zip(names, single, (dq, dk, dv)):
        assert_same_bytes(a.cpu(), b[2:, keep].cpu(), f"{label} sample 2 {name}: unpadded alone vs padded in a batch")


def test_dq_rows_do_not_depend_on_the_query_tile_and_forward_bytes(padded_batch):
    label, (q, k, v, km, lmax, do), (o, dq, _, _) = padded_batch
    plain = cuda("joint_attention_fused")(q, k, v, km, text_len=lmax)
    assert_same_bytes(o.cpu(), plain.cpu(), f"{label}: forward with a gradient wanted vs without")
    o2, ml = kern.attention(q, k, v, km, text_len=lmax, with_stats=True)
    assert_same_bytes(o2.cpu(), plain.cpu(), f"{label}: forward writing the row states vs without")
    dkv = kb.DKV_CONFIG_FP32 if q.dtype == torch.float32 else kb.DKV_CONFIG
    for cfg in ([(64, 4, 1), (32, 4, 1)] if q.dtype == torch.float32 else [(64, 4, 2), (128, 8, 3)]):
        dq2, _, _ = kb.attention_grads(do, q, k, v, o2, ml, km, text_len=lmax, needs=(True, False, False),
                                       configs=(dkv, cfg))
        assert_same_bytes(dq2.cpu(), dq.cpu(), f"{label}: dQ with query tiles {cfg} vs the fixed configuration")


def test_dkv_bytes_do_not_depend_on_the_keys_a_program_holds(padded_batch):
    """dK, dV of a key depend on its own column of the products only: a program holding two
    64-key blocks (``attention_grads``' ``keys``, tried by ``benchmarks/
    sweep_strict_attention_backward.py``) gives the fixed configuration's bytes."""
    label, (q, k, v, km, lmax, do), (_, _, dk, dv) = padded_batch
    o2, ml = kern.attention(q, k, v, km, text_len=lmax, with_stats=True)
    fp32 = q.dtype == torch.float32
    dq_cfg = kb.DQ_CONFIG_FP32 if fp32 else kb.DQ_CONFIG
    for cfg in ([(*kb.DKV_CONFIG_FP32, 128)] if fp32 else [(*kb.DKV_CONFIG, 128), (64, 8, 2, 128)]):
        _, dk2, dv2 = kb.attention_grads(do, q, k, v, o2, ml, km, text_len=lmax, needs=(False, True, True),
                                         configs=(cfg, dq_cfg))
        assert_same_bytes(dk2.cpu(), dk.cpu(), f"{label}: dK with {cfg} vs the fixed configuration")
        assert_same_bytes(dv2.cpu(), dv.cpu(), f"{label}: dV with {cfg} vs the fixed configuration")


# --------------------------------------------------------------------------------- fail closed


def test_unfused_operators_and_sp_rows_with_a_mask_refuse_a_gradient():
    q, k, v, km = joint([5], 16, 64, 2, 16, torch.float32)
    s = cuda("joint_attn_qk_gemm")(q, k, km, text_len=16).requires_grad_(True)
    with pytest.raises(UnsupportedConfigError, match="joint_attention_fused"):
        cuda("joint_attn_softmax")(s, km, text_len=16)
    rows = torch.cat([torch.arange(16), torch.arange(16 + 32, 16 + 64)]).cuda()
    qr = q[:, rows].clone().requires_grad_(True)
    with pytest.raises(UnsupportedConfigError, match="joint self-attention layout"):
        cuda("joint_attention_fused")(qr, k, v, km, text_len=16)
    with torch.no_grad():  # forward only: an SP rank's rows are fine
        cuda("joint_attention_fused")(qr, k, v, km, text_len=16)


# --------------------------------------------------------------------------------- measured


def _ms(fn, reps=10, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("n_img,batch", [(4096, 1), (4096, 2), (6032, 1)])
def test_forward_backward_time_vs_masked_sdpa_measured(n_img, batch):
    """Printed only: forward + backward of the strict fused attention against masked SDPA's at the
    model's shapes (128 text slots, 24 heads × 128, bf16); backward ≈ (fwd + bwd) − fwd."""
    q, k, v, km = joint([100] * batch, 128, n_img, 24, 128, torch.bfloat16, seed=8)
    do = out_grad(q.shape, torch.bfloat16, seed=9)
    f = cuda("joint_attention_fused")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    sd_in = [t.detach().permute(0, 2, 1, 3).requires_grad_(True) for t in (q, k, v)]
    mask, do_h = km[:, None, None, :], do.permute(0, 2, 1, 3)

    def strict_fwd():
        return f(*leaves, km, text_len=128)

    def sdpa_fwd():
        return F.scaled_dot_product_attention(*sd_in, attn_mask=mask)

    t_s = _ms(strict_fwd)
    t_sb = _ms(lambda: torch.autograd.grad(strict_fwd(), leaves, do))
    t_p = _ms(sdpa_fwd)
    t_pb = _ms(lambda: torch.autograd.grad(sdpa_fwd(), sd_in, do_h))
    s = 128 + n_img
    print(f"\nattention S={s} B={batch}: strict fwd {t_s:.3f} ms, fwd+bwd {t_sb:.3f} ms (bwd ≈ {t_sb - t_s:.3f}); "
          f"masked SDPA fwd {t_p:.3f} ms, fwd+bwd {t_pb:.3f} ms (bwd ≈ {t_pb - t_p:.3f}); "
          f"fwd+bwd strict/SDPA {t_sb / t_pb:.2f}, bwd {(t_sb - t_s) / max(t_pb - t_p, 1e-6):.2f}")
    assert t_sb > 0
