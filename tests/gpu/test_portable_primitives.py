"""The exact-op strict primitives give the same bytes on a CUDA device as on the CPU.

They use only correctly rounded IEEE operations (×, +, −, ÷, sqrt, round, exponent-bit scaling),
each a separate kernel, so no FMA contraction or approximate intrinsic can enter. Skipped
without a GPU (CI has none); run on the GPU machine with ``python -m pytest tests/gpu``.
"""

import pytest
import torch

from drifttool.ops import strict_math as sm
from drifttool.ops.strict_gemm import exact_matmul
from tests.conftest import assert_same_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _pair(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    return x, x.cuda()


@pytest.mark.parametrize("m,n,k", [(37, 128, 32), (1, 64, 64), (150, 32, 128)])
def test_exact_matmul_same_bytes_on_cuda(m, n, k):
    a, a_d = _pair(m, k, seed=1)
    b, b_d = _pair(n, k, seed=2)
    assert_same_bytes(exact_matmul(a_d, b_d).cpu(), exact_matmul(a, b), "exact_matmul")


def test_tree_sum_same_bytes_on_cuda():
    x, x_d = _pair(17, 6889, seed=3)
    assert_same_bytes(sm.tree_sum(x_d).cpu(), sm.tree_sum(x), "tree_sum")


@pytest.mark.parametrize("fn", ["exp32", "silu32", "gelu_tanh32"])
def test_transcendentals_same_bytes_on_cuda(fn):
    x, x_d = _pair(300_001, scale=6.0, seed=4)
    f = getattr(sm, fn)
    assert_same_bytes(f(x_d).cpu(), f(x), fn)


def test_sincos_same_bytes_on_cuda():
    x, x_d = _pair(100_000, scale=300.0, seed=5)
    for i in range(2):
        assert_same_bytes(sm.sincos64(x_d)[i].cpu(), sm.sincos64(x)[i], f"sincos64[{i}]")
