"""Exact-op FP64 transcendentals of ``drifttool.ops.strict_math`` used by the portable inputs:
``log64`` and ``sincos_quadrant64`` against Python's math (libm, FP64), edge cases included.
Their portability across dispatch levels is tested with the inputs (tests/test_portable_inputs.py)
and on CUDA (tests/gpu/test_portable_inputs_cuda.py)."""

from __future__ import annotations

import math

import pytest
import torch

from drifttool.ops import strict_math as sm


def test_log64_matches_libm_to_a_few_ulps():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.rand(20_000, generator=g, dtype=torch.float64),  # (0, 1): Box–Muller's range
        torch.exp(torch.randn(20_000, generator=g, dtype=torch.float64) * 50),  # wide exponents
        torch.tensor([2.0**-53, 1 - 2.0**-53, 1 + 2.0**-52, math.sqrt(2), math.sqrt(2) * (1 + 2**-52),
                      2.0**-1074, 3e-310, 1e300], dtype=torch.float64),  # edges, subnormals
    ])
    got = sm.log64(x)
    want = torch.tensor([math.log(v) for v in x.tolist()], dtype=torch.float64)
    err = (got - want).abs()
    assert (err <= 4 * 2.0**-52 * want.abs()).all(), err.max().item()
    assert sm.log64(torch.tensor([1.0], dtype=torch.float64)).item() == 0.0


def test_log64_special_values():
    x = torch.tensor([0.0, -0.0, -1.0, math.inf, -math.inf, math.nan], dtype=torch.float64)
    got = sm.log64(x).tolist()
    assert got[0] == got[1] == -math.inf and got[3] == math.inf
    assert math.isnan(got[2]) and math.isnan(got[4]) and math.isnan(got[5])


@pytest.mark.parametrize("q", [0, 1, 2, 3])
def test_sincos_quadrant64_matches_libm(q):
    f = torch.cat([torch.rand(5000, generator=torch.Generator().manual_seed(q), dtype=torch.float64),
                   torch.tensor([0.0, 0.5, 1 - 2.0**-51], dtype=torch.float64)])
    sin, cos = sm.sincos_quadrant64(torch.full(f.shape, q, dtype=torch.int64), f)
    theta = [(math.pi / 2) * (q + v) for v in f.tolist()]  # rounded twice: |Δθ| ≤ 2 ulp(2π) ≈ 1.8e-15
    assert (sin - torch.tensor([math.sin(t) for t in theta], dtype=torch.float64)).abs().max() < 2.5e-15
    assert (cos - torch.tensor([math.cos(t) for t in theta], dtype=torch.float64)).abs().max() < 2.5e-15
    if q == 0:
        assert sin[-3].item() == 0.0 and cos[-3].item() == 1.0  # θ = 0 exactly


def test_gelu_erf64_matches_libm_and_is_position_independent():
    """The exact GELU x·½erfc(−x/√2) of the vision merger: within 2e-11 relative of libm's erfc
    over [−30, 30] (both tails included), and a value's FP32 bytes do not depend on where it
    sits in a buffer (no SIMD body/tail split of a torch transcendental)."""
    x = torch.linspace(-30, 30, 120_001, dtype=torch.float64)
    want = x * 0.5 * torch.tensor([math.erfc(-v / math.sqrt(2)) for v in x.tolist()], dtype=torch.float64)
    got = sm.gelu_erf64(x)
    live = want != 0
    assert ((got - want).abs()[live] <= 2e-11 * want.abs()[live]).all()
    x32 = torch.randn(1037, generator=torch.Generator().manual_seed(1)) * 4
    whole = sm.gelu_erf32(x32)
    assert all(sm.gelu_erf32(x32[i:i + 1]).view(torch.int32).equal(whole[i:i + 1].view(torch.int32))
               for i in range(0, 1037, 97))
    assert (sm.gelu_erf32(x32).double() - torch.nn.functional.gelu(x32.double())).abs().max() < 1e-6
