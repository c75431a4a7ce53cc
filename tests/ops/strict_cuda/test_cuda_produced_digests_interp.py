"""Row tables written by the kernels that produce an output (``capture.produced``), under Triton's
interpreter: the strict GEMM's digesting epilogue (``kernels.gemm.linear(..., digest=True)``) and
the gate residual's digesting launch write, from the values they store, the CPU's digest v2
level 1 of the output bit for bit (T, T') with the exact summary (max, min, NaN/±inf count), for
bf16, fp16 and FP32 outputs, every GEMM epilogue (bias, merge, the FP64 activations, the FP32
GELU), partial tiles in both axes, the pointer and TMA paths (a persistent configuration too);
the outputs' bytes are those of the launches without it; the table is handed to a capture of the
same bytes only while they are unwritten. The GPU's own run is
``tests/gpu/test_produced_digests_cuda.py``."""

from __future__ import annotations

import math

import pytest
import torch

from drifttool.capture import gpu_rows, produced
from drifttool.capture.digest import _halves, _row_sums

gemm = pytest.importorskip("drifttool.ops.strict_cuda.kernels.gemm")

SMALL = gemm.GemmConfig(block_m=16, block_n=32, num_warps=4, num_stages=1, tma=False)


def _problem(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / math.sqrt(k),
            torch.randn(n, generator=g))


def _check_table(y2d: torch.Tensor) -> None:
    """The offered table of ``y2d`` against the CPU's level 1 and exact summary of its bytes."""
    table = produced.table(y2d)
    assert table is not None, "the digesting launch offered no table"
    rows, stats = gpu_rows.combine_splits(*table)
    assert rows.tolist() == _row_sums(_halves(y2d, 0), 0).t().tolist()
    x = y2d.double()
    nan = torch.isnan(x)
    assert stats[:, 3].tolist() == (~torch.isfinite(x)).sum(1).double().tolist()
    assert stats[:, 1].tolist() == torch.where(nan, -torch.inf, x).amax(1).tolist()
    assert stats[:, 2].tolist() == torch.where(nan, torch.inf, x).amin(1).tolist()
    fin = torch.isfinite(x).all(1)
    assert torch.allclose(stats[fin, 0], (x * x).sum(1)[fin], rtol=1e-12, atol=0)


def _bits(t: torch.Tensor) -> list:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).reshape(-1).tolist()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k,act,bias", [
    (37, 96, 100, None, True),          # rows past a tile, the K tail
    (5, 50, 64, "silu", True),          # columns past N inside a quarter tile (FP64 activation)
    (16, 64, 48, "gelu_tanh", False),
    (21, 40, 32, "gelu_tanh_f32", True),
])
def test_digesting_epilogue_equals_the_cpu_digest(out_dtype, m, n, k, act, bias):
    x, w, b = _problem(m, n, k, m + n)
    plain = gemm.linear(x, w, b if bias else None, act=act, out_dtype=out_dtype, config=SMALL)
    y = gemm.linear(x, w, b if bias else None, act=act, out_dtype=out_dtype, config=SMALL, digest=True)
    assert _bits(y) == _bits(plain), "the digest changed the output"
    _check_table(y.view(m, n))


def test_a_merged_epilogue_and_leading_axes():
    x, w, _ = _problem(2 * 9, 48, 16, 3)
    pre = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(4))
    y = gemm.linear(x.view(2, 9, 16), w, merge_into=pre, scale=0.37, out_dtype=torch.bfloat16,
                    config=SMALL, digest=True)
    assert y.shape == (2, 9, 48)
    _check_table(y.view(18, 48))


@pytest.mark.parametrize("persistent", [0, 1])
def test_tma_and_persistent_paths(persistent):
    """TMA loads; a persistent configuration digests with one program per tile (``linear``)."""
    cfg = gemm.GemmConfig(block_m=16, block_n=32, num_warps=4, num_stages=1, tma=True, persistent=persistent)
    x, w, b = _problem(33, 70, 64, 9)
    y = gemm.linear(x, w, b, out_dtype=torch.bfloat16, config=cfg, digest=True)
    _check_table(y)


def test_special_values_are_digested_as_stored():
    """NaN, ±inf and ±0 in the output (a bias of them): the bytes as stored, counted as such."""
    x, w, b = _problem(9, 32, 16, 5)
    b[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 3e38])
    y = gemm.linear(x * 0, w, b, out_dtype=torch.bfloat16, config=SMALL, digest=True)
    _check_table(y)
    assert gpu_rows.combine_splits(*produced.table(y))[1][:, 3].tolist() == [3.0] * 9


def test_the_table_is_handed_over_only_while_the_bytes_are_unwritten():
    x, w, b = _problem(8, 32, 16, 6)
    y = gemm.linear(x, w, b, out_dtype=torch.bfloat16, config=SMALL, digest=True)
    assert produced.table(y) is not None
    assert produced.table(y.view(4, 64)) is None  # other rows: another tensor
    y.add_(1)  # an in-place write: the table is stale
    assert produced.table(y) is None
    z = gemm.linear(x, w, b, out_dtype=torch.bfloat16, config=SMALL, digest=True)
    key = produced._identity(z)
    del z  # freed: its entry goes, so a new tensor at that address is not mistaken for it
    assert key not in produced._TABLES
    plain = gemm.linear(x, w, b, out_dtype=torch.bfloat16, config=SMALL)
    assert produced.table(plain) is None


def test_outputs_it_cannot_digest_get_no_table():
    """A float64 output, or quarter tiles narrower than the int8 product's 16 bytes: no table (a
    capture then reads the output with the row kernel), the same output."""
    x, w, _ = _problem(4, 16, 16, 7)
    y = gemm.linear(x, w, out_dtype=torch.float64, config=SMALL, digest=True)
    assert produced.table(y) is None
    narrow = gemm.GemmConfig(block_m=16, block_n=16, num_warps=2, num_stages=1, tma=False)
    y = gemm.linear(x, w, out_dtype=torch.bfloat16, config=narrow, digest=True)
    assert produced.table(y) is None
    assert _bits(y) == _bits(gemm.linear(x, w, out_dtype=torch.bfloat16, config=narrow))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,s,d", [(1, 45, 300), (3, 7, 128), (2, 33, 96)])
def test_a_digesting_gate_residual_equals_the_cpu_digest(out_dtype, b, s, d):
    """The gate residual's digesting launch (2-D tiles): the flat launch's bytes, and the CPU's
    T, T' of its ``[B·S, d]`` rows."""
    from drifttool.ops.strict_cuda.kernels import elementwise

    g = torch.Generator().manual_seed(b * s + d)
    x, y = torch.randn(b, s, d, generator=g), torch.randn(b, s, d, generator=g)
    gate = torch.randn(b, d, generator=g)
    y[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    plain = elementwise.gate_residual(x, gate, y, out_dtype)
    o = elementwise.gate_residual(x, gate, y, out_dtype, digest=True)
    assert _bits(o) == _bits(plain)
    _check_table(o.view(b * s, d))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,s,h,dh", [(1, 37, 3, 16), (3, 5, 2, 128), (2, 9, 7, 8)])
def test_a_digesting_rope_equals_the_cpu_digest(out_dtype, b, s, h, dh):
    """The rotation's digesting launch: the flat launch's bytes and the CPU's T, T' of its
    ``[B·S, H·Dh]`` rows."""
    from drifttool.ops.strict_cuda.kernels import elementwise

    g = torch.Generator().manual_seed(b + s + h + dh)
    x = torch.randn(b, s, h, dh, generator=g).to(out_dtype)
    ang = torch.randn(s, dh // 2, generator=g)
    freqs = torch.polar(torch.ones_like(ang), ang)
    plain = elementwise.rope(x, freqs)
    o = elementwise.rope(x, freqs, digest=True)
    assert _bits(o) == _bits(plain)
    _check_table(o.view(b * s, h * dh))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,s,h,dh", [(1, 37, 3, 128), (3, 5, 4, 16), (2, 9, 3, 100)])
def test_a_digesting_head_rmsnorm_equals_the_cpu_digest(out_dtype, b, s, h, dh):
    """The head-wise RMSNorm's digesting launch (each head's ``Dh`` a norm row, padded heads
    included): the plain launch's bytes and the CPU's T, T' of its ``[B·S, H·Dh]`` rows."""
    from drifttool.ops.strict_cuda.kernels import norms

    g = torch.Generator().manual_seed(b + s + h + dh)
    x = torch.randn(b, s, h, dh, generator=g) * 3
    gain = torch.randn(dh, generator=g)
    plain = norms.rms_norm(x, gain, 1e-6, out_dtype)
    o = norms.rms_norm(x, gain, 1e-6, out_dtype, digest=True)
    assert _bits(o) == _bits(plain)
    _check_table(o.view(b * s, h * dh))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,s,d", [(1, 19, 1100), (2, 5, 2048)])
def test_a_digesting_layernorm_equals_the_cpu_digest(out_dtype, b, s, d):
    """The modulated LayerNorm's digesting launch (long rows: the same trees, the output in 2-D
    tiles): the long-row launch's bytes and the CPU's T, T' of its ``[B·S, d]`` rows."""
    from drifttool.ops.strict_cuda.kernels import norms

    g = torch.Generator().manual_seed(b + s + d)
    x = torch.randn(b, s, d, generator=g) * 2 + 0.5
    mod = torch.randn(b, 2 * d, generator=g)
    shift, scale = mod[:, :d], mod[:, d:]
    plain = norms.ln_modulation(x, shift, scale, 1e-6, out_dtype)
    o = norms.ln_modulation(x, shift, scale, 1e-6, out_dtype, digest=True)
    assert _bits(o) == _bits(plain)
    _check_table(o.view(b * s, d))


@pytest.mark.parametrize("with_stats", [False, True])
def test_a_digesting_attention_equals_the_cpu_digest(with_stats):
    """The fused attention's digesting launch (each program its head's columns of its query
    rows, text and image tiles, a padded prompt, a partial image block): the launch's bytes
    without it, and the CPU's T, T' of the output's ``[B·Sq, H·Dh]`` rows."""
    from drifttool.ops.strict_cuda.kernels import attention
    from tests.strict_cuda_cases import joint

    q, k, v, km = joint([13, 7, 10], 13, 70, 3, 16, seed=2)
    plain = attention.attention(q, k, v, km, text_len=13, with_stats=with_stats)
    o = attention.attention(q, k, v, km, text_len=13, with_stats=with_stats, digest=True)
    if with_stats:
        (plain, ml0), (o, ml1) = plain, o
        assert _bits(ml0) == _bits(ml1)
    assert _bits(o) == _bits(plain)
    _check_table(o.view(3 * 83, 3 * 16))


def test_the_internals_launch_refuses_heads_it_does_not_take():
    """Heads narrower than ``INTERNALS_MIN_HEAD_DIM`` (16 values) are refused in one line, and the
    registered operator's ``internals`` declines them (its decomposition runs)."""
    from drifttool.ops.strict_cuda import attention as registered
    from drifttool.ops.strict_cuda.kernels import attention
    from tests.strict_cuda_cases import joint

    q, k, v, km = joint([5, 3], 5, 12, 2, 16, seed=3)
    with pytest.raises(ValueError, match="at least 32"):
        attention.attention(q, k, v, km, text_len=5, internals=([0, 0], [5, 3]))
    assert registered._fused_internals({}, q, k, v, km, text_len=5) is None
