"""Raw-byte invariance of the strict backends: a sample's (row's) bytes must not change with batch
size, batch position, row count, or prompt padding (RFC numerical requirements).

Each test runs on every strict target (``tests/harness.py``): ``strict-cpu`` always, ``strict-cuda``
once a GPU is present and the registry has a strict CUDA implementation (skipped, with the reason,
before). Inputs are drawn on the CPU and moved; bytes are compared on the CPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import drifttool.ops  # noqa: F401
from drifttool.errors import UnsupportedConfigError
from drifttool.runtime import Runtime
from tests.conftest import assert_same_bytes
from tests.harness import targets

DTYPES = [torch.float32, torch.bfloat16]
STRICT = targets("strict")
ROWWISE_OPS = ("mlp_up_gemm_gelu", "mlp_down_gemm", "attn_out_bias_gemm", "adaln_mod_projection",
               "adaln_modulation", "adaln_gate_residual", "final_adaln_out", "qk_rmsnorm",
               "txt_in_rmsnorm_linear")
ATTENTION_OPS = ("joint_attention_fused", "joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm")


@pytest.mark.parametrize("target", STRICT)
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.sampled_from([1, 2, 3]), pos=st.integers(0, 2),
       rows=st.sampled_from([1, 7, 33, 77, 130]), dtype=st.sampled_from(DTYPES))
def test_rowwise_ops_invariant_to_batch_and_rows(target, seed, batch, pos, rows, dtype):
    target.require(*ROWWISE_OPS)
    strict = target.fn
    g = torch.Generator().manual_seed(seed)
    pos = min(pos, batch - 1)
    d = 48
    x = torch.randn(batch, rows, d, generator=g).to(dtype)
    w = (torch.randn(4 * d, d, generator=g) / 7).to(dtype)
    b = torch.randn(4 * d, generator=g).to(dtype)
    w2 = (torch.randn(d, 4 * d, generator=g) / 14).to(dtype)
    b2 = torch.randn(d, generator=g).to(dtype)
    temb = torch.randn(batch, d, generator=g).to(dtype)
    wm = (torch.randn(6 * d, d, generator=g) / 7).to(dtype)
    bm = torch.randn(6 * d, generator=g).to(dtype)
    cases = {
        "mlp_up_gemm_gelu": lambda x, t: strict("mlp_up_gemm_gelu")(x, w, b),
        "mlp_down_gemm": lambda x, t: strict("mlp_down_gemm")(strict("mlp_up_gemm_gelu")(x, w, b), w2, b2),
        "attn_out_bias_gemm": lambda x, t: strict("attn_out_bias_gemm")(x, w2[:, :d], b2),
        "adaln_mod_projection": lambda x, t: strict("adaln_mod_projection")(t, wm, bm),
        "adaln_modulation": lambda x, t: strict("adaln_modulation")(x, t, t / 3),
        "adaln_gate_residual": lambda x, t: strict("adaln_gate_residual")(x, t, x * 0.5),
        "final_adaln_out": lambda x, t: strict("final_adaln_out")(x, t, wm[: 2 * d], bm[: 2 * d]),
        "qk_rmsnorm": lambda x, t: strict("qk_rmsnorm")(x.unflatten(-1, (3, 16)), b2[:16]),
        "txt_in_rmsnorm_linear": lambda x, t: strict("txt_in_rmsnorm_linear")(x, b2, w2[:, :d], b2),
    }
    one = slice(pos, pos + 1)
    for name, f in cases.items():
        full = f(x, temb)
        alone = f(x[one], temb[one])
        assert_same_bytes(full[one], alone, f"{name}: batch {batch} vs alone at position {pos}")
        if name != "adaln_mod_projection":  # per-token ops: one row alone vs among `rows`
            assert_same_bytes(full[one, :1], f(x[one, :1], temb[one]), f"{name}: row 0 of {rows}")


@pytest.mark.parametrize("target", STRICT)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(1, 20), min_size=1, max_size=3),
       pad=st.integers(0, 70), n_img=st.sampled_from([6, 15, 64, 70]), dtype=st.sampled_from(DTYPES))
def test_attention_invariant_to_padding_and_batch(target, seed, lens, pad, n_img, dtype):
    target.require(*ATTENTION_OPS)
    strict = target.fn
    g = torch.Generator().manual_seed(seed)
    heads, dh = 2, 16
    lmax = max(lens) + pad
    batch = len(lens)
    q, k, v = (torch.randn(batch, lmax + n_img, heads, dh, generator=g).to(dtype) for _ in range(3))
    tm = torch.zeros(batch, lmax, dtype=torch.bool)
    for i, n in enumerate(lens):
        tm[i, :n] = True
    km = torch.cat([tm, torch.ones(batch, n_img, dtype=torch.bool)], 1)
    fused = strict("joint_attention_fused")(q, k, v, km, text_len=lmax)
    unfused = strict("joint_attn_av_gemm")(
        strict("joint_attn_softmax")(strict("joint_attn_qk_gemm")(q, k, text_len=lmax), km, text_len=lmax),
        v, km, text_len=lmax)
    assert_same_bytes(fused, unfused, "fused vs unfused")
    for i, n in enumerate(lens):
        keep = torch.cat([torch.arange(n), torch.arange(lmax, lmax + n_img)])
        qi, ki, vi = (t[i : i + 1, keep] for t in (q, k, v))
        alone = strict("joint_attention_fused")(qi, ki, vi, None, text_len=n)  # unpadded, no mask
        assert_same_bytes(fused[i : i + 1, keep], alone, f"sample {i} len {n} pad to {lmax}")


@pytest.mark.slow  # 15–150 s on 2 cores: run by .ci/run's slow step
@pytest.mark.parametrize("target", STRICT)
@pytest.mark.parametrize("n_img", [6889])
def test_attention_rows_6889_tokens(target, n_img):
    """The 1328² token count (not a multiple of any tile): first rows equal with and without
    companions and with the sequence cut short."""
    strict = target.fn
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 13 + n_img, 1, 16, generator=g) for _ in range(3))
    full = strict("joint_attention_fused")(q, k, v, None)
    two = strict("joint_attention_fused")(torch.cat([q, q.flip(1)]), torch.cat([k, k]), torch.cat([v, v]), None)
    assert_same_bytes(full, two[:1], "batch companion at 6889 tokens")


@pytest.mark.parametrize("target", STRICT)
def test_strict_rejects_unsupported_dtype_and_tf32(target):
    strict = target.fn
    x = torch.randn(1, 3, 8, dtype=torch.float16)
    with pytest.raises(UnsupportedConfigError, match="float16"):
        strict("mlp_down_gemm")(x, torch.randn(8, 8, dtype=torch.float16), None)
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with pytest.raises(UnsupportedConfigError, match="TF32"):
            Runtime(mode="strict")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
