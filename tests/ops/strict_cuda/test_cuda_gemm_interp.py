"""The strict CUDA GEMM and its operators under Triton's interpreter, on CPU tensors (FP32).

What the interpreter can prove of the kernel's logic: masks (rows past M, columns past N, the K
tail), the TMA and pointer paths loading the same values, raw-byte row/batch invariance within a
run, the epilogue's activation equal in bytes to the CPU's ``gelu_tanh32`` / ``silu32`` of the
same FP32 pre-activation, the sinusoid and SiLU kernels equal in bytes to the CPU's, accuracy vs
the FP64 references, and fail-closed errors. The GPU's own bytes are tested in
``tests/gpu/test_strict_cuda_gemm.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops import lora as cpu_lora
from drifttool.ops import strict_math
from drifttool.ops.registry import impls
from drifttool.ops.strict import embed
from drifttool.ops.strict_cuda import linear as cuda_linear
from drifttool.references import ops as ref
from tests.strict_cuda_cases import gelu_tanh_f32_order
from tests.conftest import assert_same_bytes

gemm = pytest.importorskip("drifttool.ops.strict_cuda.kernels.gemm")
gemv = pytest.importorskip("drifttool.ops.strict_cuda.kernels.gemv")
kembed = pytest.importorskip("drifttool.ops.strict_cuda.kernels.embed")
exact_math = pytest.importorskip("drifttool.ops.strict_cuda.kernels.exact_math")


def op(name: str):
    """The registered strict CUDA function itself (its constraints ask for CUDA tensors)."""
    return impls(name, "strict", "cuda")[0].fn


def problem(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / math.sqrt(k),
            torch.randn(n, generator=g))


def assert_close(y: torch.Tensor, r: torch.Tensor, what: str, tol: float = 4e-6) -> None:
    err = (y.double() - r).abs() / (1 + r.abs())
    assert err.max().item() <= tol, f"{what}: max scaled error {err.max().item():.3g} > {tol:g}"


@pytest.mark.parametrize("m,n,k", [(37, 96, 100), (1, 48, 48), (5, 130, 64)])
@pytest.mark.parametrize("act", [None, "gelu_tanh", "silu"])
def test_linear_matches_fp64_reference(m, n, k, act):
    x, w, b = problem(m, n, k)
    y = gemm.linear(x, w, b, act=act)
    pre = x.double() @ w.double().T + b.double()
    want = {None: pre, "gelu_tanh": strict_math.gelu_tanh64(pre), "silu": strict_math.silu64(pre)}[act]
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert_close(y, want, f"{m}x{n}x{k} act={act}")


@pytest.mark.parametrize("act,cpu", [("gelu_tanh", strict_math.gelu_tanh32), ("silu", strict_math.silu32)])
def test_epilogue_activation_is_the_cpus_in_bytes(act, cpu):
    """Given the kernel's own FP32 pre-activation, its fused activation equals the CPU's."""
    x, w, b = problem(37, 96, 100, seed=1)
    x[0, :] *= 40  # large |pre|: exp's clamp and tanh → ±1
    pre = gemm.linear(x, w, b)
    assert_same_bytes(gemm.linear(x, w, b, act=act), cpu(pre), f"{act} epilogue vs CPU {cpu.__name__}")


def test_rows_and_batch_positions_do_not_change_bytes():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 13, 100, generator=g)  # [B, S, K], K with a tail chunk
    _, w, b = problem(1, 70, 100, seed=3)
    full = gemm.linear(x, w, b, act="gelu_tanh")  # [3, 13, 70]
    assert_same_bytes(full[2:3], gemm.linear(x[2:3], w, b, act="gelu_tanh"), "sample 2 of 3 vs alone")
    assert_same_bytes(full[1, 5:6], gemm.linear(x[1, 5:6], w, b, act="gelu_tanh"), "one row alone")
    assert_same_bytes(full[0, -3:], gemm.linear(x[0, -3:], w, b, act="gelu_tanh"), "last rows alone")
    again = gemm.linear(x, w, b, act="gelu_tanh")
    assert_same_bytes(full, again, "repetition")


def test_k_tail_is_zero_products():
    """K = 100: the masked tail chunk equals the same problem zero-padded to K = 128 (no mask)."""
    x, w, b = problem(9, 40, 100, seed=4)
    pad = torch.nn.functional.pad
    assert_same_bytes(gemm.linear(x, w, b), gemm.linear(pad(x, (0, 28)), pad(w, (0, 28)), b),
                      "K tail masked vs zero-padded")


def test_tma_and_pointer_paths_load_the_same_values():
    x, w, b = problem(37, 96, 128, seed=5)
    ptr = gemm.GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=2, tma=False)
    tma = gemm.GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=2, tma=True)
    assert_same_bytes(gemm.linear(x, w, b, config=tma), gemm.linear(x, w, b, config=ptr), "TMA vs pointers")
    assert_same_bytes(gemm.linear(x[:, :100], w[:, :100], b, config=tma),  # tail zero-filled by TMA
                      gemm.linear(x[:, :100].contiguous(), w[:, :100].contiguous(), b, config=ptr),
                      "TMA vs pointers, K tail")


@pytest.mark.parametrize("act", [None, "gelu_tanh_f32"])
def test_persistent_programs_give_one_program_per_tile_bytes(act):
    """Persistent programs (4 under the interpreter, each walking several of the 3 × 3 tiles, the
    last row and column of tiles partial, a K tail) equal one program per tile, with the bias and
    with a merge: each tile's arithmetic is the same whichever program runs it."""
    x, w, b = problem(37, 150, 100, seed=6)
    one = gemm.GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, tma=True)
    per = gemm.GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, tma=True, persistent=1)
    assert_same_bytes(gemm.linear(x, w, b, act=act, config=per), gemm.linear(x, w, b, act=act, config=one),
                      "persistent vs one program per tile")
    r = torch.randn(37, 150, generator=torch.Generator().manual_seed(7))
    assert_same_bytes(gemm.linear(x, w, b, act=act, merge_into=r, scale=0.5, config=per),
                      gemm.linear(x, w, b, act=act, merge_into=r, scale=0.5, config=one), "persistent, merged")


def test_output_dtype_and_empty_inputs():
    x, w, b = problem(3, 16, 32)
    y16, y32 = gemm.linear(x, w, b, out_dtype=torch.bfloat16), gemm.linear(x, w, b)
    assert y16.dtype == torch.bfloat16  # (the interpreter truncates to bf16: the GPU test checks the rounding)
    assert ((y16.float() - y32).abs() <= y32.abs() * 2**-7).all()
    assert gemm.linear(x[:0], w, b).shape == (0, 16)
    assert_same_bytes(gemm.linear(x[:, :0], w[:, :0], b), b.expand(3, 16).contiguous(), "K = 0: the bias")


def test_fails_closed():
    x, w, b = problem(3, 16, 32)
    with pytest.raises(UnsupportedConfigError, match="float16"):
        gemm.linear(x.half(), w.half(), None)
    with pytest.raises(UnsupportedConfigError, match="activation"):
        gemm.linear(x, w, b, act="relu")
    with pytest.raises(UnsupportedConfigError, match="shapes"):
        gemm.linear(x, w[:, :31], b)


def test_silu_and_sinusoid_are_the_cpus_in_bytes():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3000, generator=g) * 12
    x[:8] = torch.tensor([math.nan, math.inf, -math.inf, 800.0, -800.0, -0.0, 0.0, 1e-30])
    assert_same_bytes(kembed.silu32(x), strict_math.silu32(x), "silu32")
    tau = torch.cat([torch.tensor([1.0, 0.019999980926513672, 0.0, 0.5]), torch.rand(5, generator=g)])
    assert_same_bytes(kembed.sinusoid(tau), embed.sinusoid(tau), "sinusoid")
    far = kembed.sinusoid(torch.tensor([3000.0]))  # a_0 = 3e6 >= 2^20: the CPU raises, the kernel gives NaN
    assert torch.isnan(far[0, 0]) and torch.isnan(far[0, 128]) and not torch.isnan(far[0, 127])


def test_operators_match_references():
    g = torch.Generator().manual_seed(7)
    d, heads = 48, 3

    def lin(n, k):
        return torch.randn(n, k, generator=g) / math.sqrt(k), torch.randn(n, generator=g) * 0.1

    x = torch.randn(2, 7, d, generator=g)
    for name, w, b in (("latent_proj_gemm", *lin(64, d)), ("attn_out_bias_gemm", *lin(d, d)),
                       ("mlp_up_gemm_gelu", *lin(4 * d, d))):
        assert_close(op(name)(x, w, b), ref.OPS[name](x, w, b), name)
    h = torch.randn(2, 7, 4 * d, generator=g)
    w, b = lin(d, 4 * d)
    assert_close(op("mlp_down_gemm")(h, w, b), ref.mlp_down_gemm(h, w, b), "mlp_down_gemm")
    ws = [t for _ in range(3) for t in lin(d, d)]
    for got, want in zip(op("qkv_bias_gemm")(x, *ws, heads), ref.qkv_bias_gemm(x, *ws, heads)):
        assert got.shape == (2, 7, heads, d // heads)
        assert_close(got, want, "qkv_bias_gemm")
    temb = torch.randn(2, d, generator=g) * 2
    w, b = lin(6 * d, d)
    assert_close(op("adaln_mod_projection")(temb, w, b), ref.adaln_mod_projection(temb, w, b),
                 "adaln_mod_projection")
    tau = torch.tensor([1.0, 0.3, 0.02])
    w1, b1 = lin(d, 256)
    w2, b2 = lin(d, d)
    assert_close(op("timestep_embed_mlp")(tau, w1, b1, w2, b2), ref.timestep_embed_mlp(tau, w1, b1, w2, b2),
                 "timestep_embed_mlp")


def test_gemm_operators_are_batch_invariant():
    g = torch.Generator().manual_seed(8)
    d = 48
    temb = torch.randn(3, d, generator=g)
    w, b = torch.randn(6 * d, d, generator=g) / 7, torch.randn(6 * d, generator=g)
    full = op("adaln_mod_projection")(temb, w, b)
    assert_same_bytes(full[1:2], op("adaln_mod_projection")(temb[1:2], w, b), "adaln sample 1 of 3")
    tau = torch.tensor([0.9, 0.4, 0.1])
    w1, b1 = torch.randn(d, 256, generator=g) / 16, torch.randn(d, generator=g)
    w2, b2 = torch.randn(d, d, generator=g) / 7, torch.randn(d, generator=g)
    full = op("timestep_embed_mlp")(tau, w1, b1, w2, b2)
    assert_same_bytes(full[2:], op("timestep_embed_mlp")(tau[2:], w1, b1, w2, b2), "temb sample 2 of 3")


def test_lora_merge_matches_the_cpu_strict_merge():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    a, bb = torch.randn(4, 24, generator=g), torch.randn(40, 4, generator=g)
    got = op("lora_merge")(w, a, bb, 0.5)
    want = cpu_lora.lora_merge_strict(w, a, bb, 0.5)
    assert got.dtype == torch.float32 and got.shape == (40, 24)
    assert_close(got, want.double(), "lora_merge", tol=1e-6)
    assert_same_bytes(op("lora_merge")(w, a, torch.zeros_like(bb), 0.5), w.float(), "B = 0: W unchanged")


def test_registered_kernel_id_is_the_kernels():
    assert cuda_linear.KERNEL == gemm.KERNEL_ID


def test_kernel_globals_equal_themselves():
    """Triton's jit re-checks every global a kernel used with ``!=`` at each launch on the GPU (not
    in the interpreter), so a NaN global fails every launch: no module global of the kernels may be
    a float unequal to itself."""
    import triton.language as tl

    for module in (exact_math, gemm, gemv, kembed):
        for name, val in vars(module).items():
            v = val.value if isinstance(val, tl.constexpr) else val
            assert not (isinstance(v, float) and v != v), f"{module.__name__}.{name} is NaN"


# ---------------------------------------------------------------------------------------------
# the GEMV (few rows, FP32 operand): its order is stated exactly, so its bytes are reproducible


def gemv_order(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The GEMV's stated order by torch FP32 ops on the CPU: 64 lane sums over K (k ascending,
    rounded product then rounded add), adjacent lanes added pairwise, then the bias."""
    pad = (-x.shape[-1]) % 64
    p = torch.nn.functional.pad(x, (0, pad))[:, None, :] * torch.nn.functional.pad(w, (0, pad))[None]
    lanes = p.unflatten(-1, (-1, 64))  # [M, N, chunks, 64]
    s = torch.zeros(lanes.shape[:2] + (64,))
    for c in range(lanes.shape[2]):
        s = s + lanes[:, :, c]
    while s.shape[-1] > 1:
        s = s[..., 0::2] + s[..., 1::2]
    return s[..., 0] + (0 if b is None else b)


def test_gemv_bytes_are_its_stated_order_and_accurate():
    x, w, b = problem(3, 70, 200, seed=11)  # K with a tail chunk, N with a tail block
    y = gemv.gemv(x, w, b)
    assert_same_bytes(y, gemv_order(x, w, b), "gemv vs its order computed by torch")
    assert_close(y, x.double() @ w.double().T + b.double(), "gemv vs FP64")
    pre = y
    assert_same_bytes(gemv.gemv(x, w, b, act="silu"), strict_math.silu32(pre), "gemv silu epilogue vs CPU")
    assert_same_bytes(gemv.gemv(x, w.to(torch.bfloat16), None),
                      gemv_order(x, w.to(torch.bfloat16).float(), None), "gemv with a bf16 weight")


def test_gemv_rows_do_not_depend_on_batch():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(7, 300, generator=g) * 3  # K = 300: 4 chunks unrolled, one whole, a tail
    _, w, b = problem(1, 50, 300, seed=13)
    alone = gemv.gemv(x[1:2], w, b)
    assert_same_bytes(alone, gemv.gemv(x[:3], w, b)[1:2], "row 1 alone vs in M = 3")
    assert_same_bytes(alone, gemv.gemv(x, w, b)[1:2], "row 1 alone vs in M = 7")
    assert_same_bytes(gemv.gemv(x[6:], w, b), gemv.gemv(x, w, b)[6:], "row 6 alone vs in M = 7")
    cfg = gemv.GemvConfig(block_n=16, num_warps=2, unroll=1)
    assert_same_bytes(gemv.gemv(x, w, b, config=cfg), gemv.gemv(x, w, b), "launch configuration")
    assert_same_bytes(gemv.gemv(x, w, b), gemv_order(x, w, b), "gemv vs its order, K = 300")


def test_few_row_operators_take_the_gemv():
    """adaln_mod_projection and timestep_embed_mlp are GEMVs by contract, at any batch size."""
    g = torch.Generator().manual_seed(14)
    d = 48
    temb = torch.randn(7, d, generator=g)
    w, b = torch.randn(6 * d, d, generator=g) / 7, torch.randn(6 * d, generator=g)
    got = op("adaln_mod_projection")(temb, w, b)
    assert_same_bytes(got, gemv_order(strict_math.silu32(temb), w, b), "adaln = silu32 + the GEMV order")
    assert_same_bytes(got[4:5], op("adaln_mod_projection")(temb[4:5], w, b), "adaln row 4 of 7 alone")
    assert cuda_linear.GEMV == gemv.GEMV_ID
    assert cuda_linear.GEMV in impls("adaln_mod_projection", "strict", "cuda")[0].kernel
    assert cuda_linear.GEMV in impls("timestep_embed_mlp", "strict", "cuda")[0].kernel


def test_lora_merge_epilogue_is_the_two_fp32_operations():
    """The merge fused in the GEMM's epilogue gives the bytes of fp32(W) + fp32(s)·(B·A) done as
    separate torch operations on the same kernel's B·A (same tile: the interpreter's dot is numpy's,
    whose sums depend on the tile; the GPU test checks the tile does not change the GPU's)."""
    g = torch.Generator().manual_seed(15)
    w = torch.randn(70, 100, generator=g).to(torch.bfloat16)
    a, bb = torch.randn(8, 100, generator=g), torch.randn(70, 8, generator=g) * 0.1
    delta = gemm.linear(bb, a.t(), config=gemm.LORA_CONFIG)
    want = w.float() + torch.tensor(0.3, dtype=torch.float32) * delta
    got = gemm.linear(bb, a.t(), merge_into=w, scale=0.3, out_dtype=torch.float32, config=gemm.LORA_CONFIG)
    assert_same_bytes(got, want, "fused merge vs separate FP32 ops")
    assert_same_bytes(op("lora_merge")(w, a, bb, 0.3), want, "lora_merge operator")
    with pytest.raises(UnsupportedConfigError, match="merge_into"):
        gemm.linear(bb, a.t(), merge_into=w[:, :99])


def test_gelu_f32_epilogue_is_its_stated_formula_and_accurate():
    x, w, b = problem(37, 96, 100, seed=16)
    x[0, :] *= 40  # large |pre|: the clamps
    b[:6] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, -30.0])  # specials in every row
    pre = gemm.linear(x, w, b)
    got = gemm.linear(x, w, b, act="gelu_tanh_f32")
    nan = torch.isnan(got)
    assert torch.equal(nan, torch.isnan(gelu_tanh_f32_order(pre))) and nan[:, 0].all() and nan[:, 2].all()
    assert_same_bytes(got[~nan], gelu_tanh_f32_order(pre)[~nan], "FP32 GELU epilogue vs its formula")
    fine = torch.isfinite(pre)
    err = (got.double() - strict_math.gelu_tanh64(pre.double())).abs()[fine]
    assert (err <= 8 * 2.0**-24 * pre.double().abs()[fine] + 1e-37).all(), f"max error {err.max().item():.3g}"


def test_mlp_up_kernel_id_names_its_gelu_epilogue():
    kernel = impls("mlp_up_gemm_gelu", "strict", "cuda")[0].kernel
    cap = cuda_linear.GELU_MAXNREG[cuda_linear.GELU_EPILOGUE]
    assert kernel.endswith(f"+gelu_tanh.{cuda_linear.GELU_EPILOGUE}" + (f".r{cap}" if cap else ""))
    assert cuda_linear.GELU_ACTS[cuda_linear.GELU_EPILOGUE] in exact_math.ACTS
