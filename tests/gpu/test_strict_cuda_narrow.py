"""The rank-wide strict CUDA GEMM (``kernels.narrow``: an unfused adapter's u = x·Aᵀ and du = dt·B,
K in segments of 256) on the GPU, in raw bytes: its output is the in-order sum of the strict GEMM
of each segment's columns; a row's bytes do not depend on the row count, its position or the
tile; at full width (K 3072 and 12288) and 6889 rows."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_same_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():  # without CUDA, importing the kernels here would decorate them before
    # tests/ops/strict_cuda/conftest.py sets TRITON_INTERPRET=1 for the interpreter suite
    from drifttool.ops.strict_cuda.kernels import gemm, narrow

R, TOKENS = 16, 6889


def rn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).cuda()


@pytest.mark.parametrize("k", [3072, 12288, 700])
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_output_is_the_segments_gemms_added_in_order(k, xdt):
    x, w = rn(TOKENS, k, seed=k, dtype=xdt), rn(R, k, seed=k + 1) / 30
    parts = [gemm.linear(x[:, k0:k0 + narrow.SEG_K], w[:, k0:k0 + narrow.SEG_K], out_dtype=torch.float32,
                         config=narrow.CONFIG) for k0 in range(0, k, narrow.SEG_K)]
    want = parts[0]
    for p in parts[1:]:
        want = want + p
    assert_same_bytes(narrow.linear(x, w), want, f"K {k}")


def test_a_rows_bytes_do_not_depend_on_row_count_position_or_tile():
    x, w = rn(TOKENS, 3072, seed=1, dtype=torch.bfloat16), rn(R, 3072, seed=2) / 30
    whole = narrow.linear(x, w)
    assert_same_bytes(narrow.linear(x[:128], w), whole[:128], "the first 128 rows")
    assert_same_bytes(narrow.linear(x[77:4173], w), whole[77:4173], "4096 rows from row 77")
    assert_same_bytes(narrow.linear(x[TOKENS - 1:], w), whole[TOKENS - 1:], "the last row alone")
    for bm, bn, warps, stages in ((16, 16, 2, 3), (64, 16, 4, 1), (32, 32, 4, 2)):
        cfg = gemm.GemmConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, tma=False)
        assert_same_bytes(narrow.linear(x, w, config=cfg), whole, cfg.id)


def test_a_transposed_factor_and_its_copy_give_the_same_bytes():
    """du = dt·B passes Bᵀ (a strided view)."""
    dt, b = rn(4096, 12288, seed=3), rn(12288, R, seed=4) / 30
    assert_same_bytes(narrow.linear(dt, b.t()), narrow.linear(dt, b.t().contiguous()), "Bᵀ")
