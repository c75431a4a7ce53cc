"""The rank-wide strict CUDA GEMM (``kernels.narrow``: u = x·Aᵀ and du = dt·B of an unfused adapter,
K in segments of 256) under Triton's interpreter, on CPU FP32.

What the interpreter proves of the logic: each segment's partial is ``kernels.gemm.linear`` of the
segment's columns (the same chunks, the same dot), and the partials are added in ascending order
from the first (bytes, at K not a multiple of the chunk or the segment, bf16 and FP32 x); one
segment is ``kernels.gemm.linear`` itself; a row's bytes do not depend on the rows around it or
their number; accuracy against FP64; empty shapes. The GPU's own bytes:
``tests/gpu/test_strict_cuda_narrow.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_same_bytes

narrow = pytest.importorskip("drifttool.ops.strict_cuda.kernels.narrow")
gemm = pytest.importorskip("drifttool.ops.strict_cuda.kernels.gemm")

R = 16


def rn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def in_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """((p0 + p1) + p2) + …, each partial the strict GEMM of one segment's columns (same tile)."""
    k = x.shape[-1]
    parts = [gemm.linear(x[..., k0:k0 + narrow.SEG_K], w[:, k0:k0 + narrow.SEG_K], out_dtype=torch.float32,
                         config=narrow.CONFIG) for k0 in range(0, k, narrow.SEG_K)]
    y = parts[0]
    for p in parts[1:]:
        y = y + p  # one FP32 addition per element, in order
    return y


@pytest.mark.parametrize("k", [700, 512, 260])
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_partials_are_the_gemm_of_their_columns_added_in_order(k, xdt):
    """K = 700: segments of 256, 256 and 188 (a tail chunk of 60); 512: two whole segments; 260:
    a segment of 4 columns."""
    x, w = rn(37, k, seed=k, dtype=xdt), rn(R, k, seed=k + 1)
    got = narrow.linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (37, R)
    assert_same_bytes(got, in_order(x, w), f"K {k}, x {xdt}")


def test_one_segment_is_the_gemm_itself():
    x, w = rn(5, 3, 200, seed=3, dtype=torch.bfloat16), rn(R, 200, seed=4)
    assert_same_bytes(narrow.linear(x, w),
                      gemm.linear(x, w, out_dtype=torch.float32, config=narrow.CONFIG), "K 200")


def test_a_rows_bytes_do_not_depend_on_the_rows_around_it():
    """Rows 0–39 of a 77-row call against the same rows alone, shifted into another tile, and one
    at a time."""
    x, w = rn(77, 600, seed=5, dtype=torch.bfloat16), rn(R, 600, seed=6)
    whole = narrow.linear(x, w)
    assert_same_bytes(narrow.linear(x[:40], w), whole[:40], "the first 40 rows")
    assert_same_bytes(narrow.linear(x[3:43], w), whole[3:43], "40 rows from row 3")
    for r in (0, 31, 32, 76):
        assert_same_bytes(narrow.linear(x[r:r + 1], w), whole[r:r + 1], f"row {r} alone")


def test_a_transposed_factor_is_read_as_its_values():
    """du = dt·B passes Bᵀ, a strided view: the same bytes as its contiguous copy."""
    dt, b = rn(33, 520, seed=7), rn(520, R, seed=8)
    assert_same_bytes(narrow.linear(dt, b.t()), narrow.linear(dt, b.t().contiguous()), "Bᵀ view")


def test_accuracy_against_fp64():
    x, w = rn(64, 3072, seed=9, dtype=torch.bfloat16), rn(R, 3072, seed=10) / 50
    ref = x.double() @ w.double().t()
    err = (narrow.linear(x, w).double() - ref).abs() / (1 + ref.abs())
    assert err.max().item() < 1e-5


def test_empty_shapes():
    w = rn(R, 300, seed=11)
    assert narrow.linear(torch.zeros(0, 300), w).shape == (0, R)
    assert torch.equal(narrow.linear(torch.ones(4, 0), torch.ones(R, 0)), torch.zeros(4, R))


def test_the_adapted_kernel_id_names_the_segment_length():
    """The trace's kernel id of an adapted block GEMM changes with the segment length (which fixes
    u's and du's bytes), so two runs of different lengths say so in a diff's context."""
    from drifttool.ops.strict_cuda import linear as cuda_linear

    assert cuda_linear.LORA_SUFFIX.endswith(f".kseg{narrow.SEG_K}") and narrow.SEG_K % gemm.CHUNK == 0
