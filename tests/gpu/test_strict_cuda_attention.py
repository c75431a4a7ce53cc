"""Strict CUDA joint attention on the GPU (contract cuda1), proved on raw bytes.

- the fused operator equals its unfused decomposition (qk → softmax → av) byte for byte, through
  the registry, at small head dims and at full width (24 heads × 128, 6889 image tokens);
- a sample's bytes do not change with batch size, batch position, prompt padding (128 → 165 text
  slots, NaN in every padded K/V slot), launch geometry or repetition;
- accuracy against FP64 (and SDPA's own error), a sample without a valid key refused;
- MEASURED, printed (one line per operator): strict CUDA vs strict CPU (max |Δ|, max ulp, fraction
  of bytes equal) on the tiny fixture's shapes and one full-width shape, and the fused kernel's
  time against masked SDPA. Only generous bounds are asserted there.

Skipped without a GPU (CI has none); run on the GPU machine with
``python -m pytest tests/gpu/test_strict_cuda_attention.py -s`` (``-s`` shows the measurements).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import drifttool.ops  # noqa: F401
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implementation
from references import ops as ref
from tests import strict_cuda_cases as cases
from tests.conftest import assert_same_bytes, bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OPS = ("joint_attention_fused", "joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm")


def cuda(op: str):
    return implementation(op, "strict", "cuda")


def cpu(op: str):
    return implementation(op, "strict", "cpu")


def joint(lens, text_len, n_img, heads, dh, dtype, seed=0, nan_pads=False):
    """``tests.strict_cuda_cases.joint`` on the GPU."""
    return cases.joint(lens, text_len, n_img, heads, dh, dtype, seed=seed, device="cuda", nan_pads=nan_pads)


def unfused(q, k, v, km, text_len):
    s = cuda("joint_attn_qk_gemm")(q, k, km, text_len=text_len)
    p = cuda("joint_attn_softmax")(s, km, text_len=text_len)
    return cuda("joint_attn_av_gemm")(p, v, km, text_len=text_len)


def sample(t: torch.Tensor, i: int, keep: torch.Tensor) -> torch.Tensor:
    return t[i : i + 1, keep.to(t.device)]


# --------------------------------------------------------------------------------- fused = unfused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dh", [16, 64, 128])
def test_fused_equals_unfused_decomposition(dtype, dh):
    """Odd text length 77 (valid 77 and 40: sample 1's second text block has no valid key and
    is skipped), 1000 image keys (a partial last block), batch 2, NaN in every masked K/V slot."""
    q, k, v, km = joint([77, 40], 77, 1000, 4, dh, dtype, seed=dh, nan_pads=True)
    o = cuda("joint_attention_fused")(q, k, v, km, text_len=77)
    assert o.dtype == dtype and o.shape == q.shape and torch.isfinite(o).all()
    assert_same_bytes(unfused(q, k, v, km, 77).cpu(), o.cpu(), f"fused vs unfused, {dtype}, Dh {dh}")


def test_fused_equals_unfused_full_width():
    """24 heads × 128, 128 text slots (valid 100), 6889 image tokens, bf16 ([B,H,S,S] FP32 ≈ 4.7 GB)."""
    q, k, v, km = joint([100], 128, 6889, 24, 128, torch.bfloat16, seed=1)
    o = cuda("joint_attention_fused")(q, k, v, km, text_len=128)
    assert_same_bytes(unfused(q, k, v, km, 128).cpu(), o.cpu(), "fused vs unfused at 6889 image tokens")


# --------------------------------------------------------------------------------- invariance


@pytest.fixture(scope="module")
def full_width():
    """Sample X (valid text 100) alone and unpadded, and at position 2 of a batch of 3 padded to
    165 text slots with NaN in every padded K/V slot; 6889 image tokens, 24 heads × 128, bf16."""
    n_img, lmax = 6889, 165
    q, k, v, km = joint([128, 5, 100], lmax, n_img, 24, 128, torch.bfloat16, seed=2, nan_pads=True)
    keep = torch.cat([torch.arange(100), torch.arange(lmax, lmax + n_img)])
    return q, k, v, km, lmax, keep


def test_bytes_invariant_to_batch_position_and_padding(full_width):
    q, k, v, km, lmax, keep = full_width
    o = cuda("joint_attention_fused")(q, k, v, km, text_len=lmax)
    assert torch.isfinite(o).all()
    xq, xk, xv = (sample(t, 2, keep) for t in (q, k, v))
    alone = cuda("joint_attention_fused")(xq, xk, xv, None, text_len=100)
    assert_same_bytes(sample(o, 2, keep).cpu(), alone.cpu(), "sample: alone unpadded vs padded at position 2 of 3")
    alone_128 = cuda("joint_attention_fused")(*(t[2:] for t in (q, k, v)), km[2:], text_len=lmax)
    assert_same_bytes(o[2:].cpu(), alone_128.cpu(), "sample: batch 1 vs position 2 of 3, same padding")


def test_bytes_invariant_to_launch_geometry_and_repetition(full_width):
    from drifttool.ops.strict_cuda.kernels import attention as kern

    q, k, v, km, lmax, _ = full_width
    base = kern.attention(q, k, v, km, text_len=lmax)
    for _ in range(2):
        assert_same_bytes(kern.attention(q, k, v, km, text_len=lmax).cpu(), base.cpu(), "repetition")
    for config in [(64, 4, 3), (128, 4, 3), (64, 4, 2), (128, 8, 2), (128, 8, 3), (128, 4, 2), (64, 4, 3, True)]:
        o = kern.attention(q, k, v, km, text_len=lmax, config=config)
        assert_same_bytes(o.cpu(), base.cpu(), f"launch geometry {config} vs {kern.CONFIG}")


# --------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accuracy_vs_fp64_and_sdpa(dtype):
    q, k, v, km = joint([90], 128, 1024, 4, 128, dtype, seed=3)
    o = cuda("joint_attention_fused")(q, k, v, km, text_len=128)
    r = ref.joint_attention_fused(q.cpu(), k.cpu(), v.cpu(), km.cpu())
    err = (o.cpu().double() - r).abs().max().item()
    mask = km[:, None, None, :]
    sd = F.scaled_dot_product_attention(*(t.permute(0, 2, 1, 3) for t in (q, k, v)), attn_mask=mask)
    err_sdpa = (sd.permute(0, 2, 1, 3).cpu().double() - r).abs().max().item()
    print(f"\naccuracy {dtype}: strict cuda max|err| vs fp64 {err:.3g}, SDPA {err_sdpa:.3g}")
    if dtype == torch.float32:
        assert err < 2e-5
    else:
        assert err <= 2 * err_sdpa + 1e-3


def test_sample_without_valid_key_refused():
    q, k, v, km = joint([5, 5], 16, 64, 2, 16, torch.float32)
    km[1] = False
    for op, args in [("joint_attention_fused", (q, k, v, km)), ("joint_attn_qk_gemm", (q, k, km))]:
        with pytest.raises(UnsupportedConfigError, match="no valid key"):
            cuda(op)(*args, text_len=16)


def test_unsupported_head_dim_refused():
    q, k, v, km = joint([5], 16, 64, 2, 24, torch.float32)
    with pytest.raises(UnsupportedConfigError, match="head dim"):
        cuda("joint_attention_fused")(q, k, v, km, text_len=16)


# --------------------------------------------------------------------------------- measured


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Bits as integers ordered like the floats (adjacent floats differ by 1)."""
    b = bits(t).to(torch.int64)
    sign = 1 << (8 * t.element_size() - 1)
    return torch.where(b < 0, -(b + sign), b) if t.element_size() < 8 else b


def measure(name: str, got: torch.Tensor, want: torch.Tensor) -> tuple[float, int, float]:
    """max |Δ|, max ulp distance, fraction of bytes equal; printed as one line."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, name
    d = (got.double() - want.double()).abs().max().item()
    ulp = (_ordered(got) - _ordered(want)).abs().max().item()
    eq = (bits(got) == bits(want)).double().mean().item()
    print(f"strict cuda vs strict cpu  {name:<58} max|Δ| {d:9.3g}  max ulp {ulp:8d}  bytes equal {eq:7.2%}")
    return d, ulp, eq


CROSS = {  # label: (valid text lengths, text slots, image tokens, heads, Dh)
    "b3_l13_grid3x5_masked": ([13, 7, 10], 13, 15, 2, 16),
    "b1_l7_grid3x5_nomask": ([7], 7, 15, 2, 16),
    "full_h24_l64_pad9_n1024": ([55], 64, 1024, 24, 128),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label", list(CROSS))
def test_strict_cuda_vs_strict_cpu_measured(label, dtype):
    lens, L, n, h, dh = CROSS[label]
    q, k, v, km = joint(lens, L, n, h, dh, dtype, seed=4)
    km = None if "nomask" in label else km
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    kmc = None if km is None else km.cpu()
    what = f"{label} {str(dtype).removeprefix('torch.')}"
    s_cpu = cpu("joint_attn_qk_gemm")(qc, kc, kmc, text_len=L)
    p_cpu = cpu("joint_attn_softmax")(s_cpu, kmc, text_len=L)
    o_cpu = cpu("joint_attention_fused")(qc, kc, vc, kmc, text_len=L)
    rows = {
        "joint_attn_qk_gemm": (cuda("joint_attn_qk_gemm")(q, k, km, text_len=L), s_cpu),
        "joint_attn_softmax": (cuda("joint_attn_softmax")(s_cpu.cuda(), km, text_len=L), p_cpu),
        "joint_attn_av_gemm": (cuda("joint_attn_av_gemm")(p_cpu.cuda(), v, km, text_len=L),
                               cpu("joint_attn_av_gemm")(p_cpu, vc, kmc, text_len=L)),
        "joint_attention_fused": (cuda("joint_attention_fused")(q, k, v, km, text_len=L), o_cpu),
    }
    for op, (got, want) in rows.items():
        d, _, _ = measure(f"{op} {what}", got, want)
        mag = max(1.0, want.abs().max().item())
        # generous: a few ulps of the output dtype relative to the magnitude
        bound = (2.0**-6 if got.dtype == torch.bfloat16 else 2.0**-16) * mag
        assert d <= bound, f"{op} {what}: max|Δ| {d:.3g} beyond {bound:.3g}"


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


@pytest.mark.parametrize("n_img,batch", [(4096, 1), (4096, 2), (6032, 1), (6889, 1)])
def test_fused_time_vs_masked_sdpa_measured(n_img, batch):
    """Printed only: the two-pass kernel's time against masked SDPA (the production path) at the
    model's shapes, 128 text slots, 24 heads × 128, bf16."""
    q, k, v, km = joint([100] * batch, 128, n_img, 24, 128, torch.bfloat16, seed=5)
    f = cuda("joint_attention_fused")
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    mask = km[:, None, None, :]
    t_strict = _ms(lambda: f(q, k, v, km, text_len=128))
    t_sdpa = _ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask))
    s = 128 + n_img
    tflops = 4 * batch * 24 * s * s * 128 / (t_strict * 1e-3) / 1e12
    print(f"\nattention S={s} B={batch}: strict {t_strict:.3f} ms ({tflops:.0f} TFLOP/s at 4·B·H·S²·Dh), "
          f"masked SDPA {t_sdpa:.3f} ms, strict/SDPA {t_strict / t_sdpa:.2f}")
    assert t_strict > 0


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_sp_rank_rows_reproduce_one_device(full_width, sp):
    """AG/RS on one device: each SP rank's queries (text rows + its image rows, ``sp_row_spans``)
    against every key reproduce the single-device rows' bytes; at L2 the decomposition too."""
    from drifttool.shards import sp_row_spans

    q, k, v, km, lmax, _ = full_width
    full = cuda("joint_attention_fused")(q, k, v, km, text_len=lmax)
    for lo, hi in sp_row_spans(q.shape[1] - lmax, sp):
        rows = torch.cat([torch.arange(lmax), torch.arange(lmax + lo, lmax + hi)]).cuda()
        mine = cuda("joint_attention_fused")(q[:, rows], k, v, km, text_len=lmax)
        assert_same_bytes(mine.cpu(), full[:, rows].cpu(), f"sp {sp}: image rows [{lo}, {hi})")
        if sp == 8:
            assert_same_bytes(unfused(q[:, rows], k, v, km, lmax).cpu(), mine.cpu(), f"sp 8 rank [{lo}, {hi}) unfused")
