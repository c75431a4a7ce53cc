"""Value drift from stored bytes: exact widening, NaN/Inf handling, transition KL."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from drifttool.diff.values import compare_values, transition_kl, values


def stored(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.contiguous().view(
        torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int32, torch.bool, torch.float8_e4m3fn])
def test_values_widen_exactly(dtype):
    t = (torch.randn(3, 4) * 3).to(dtype)
    got = values(*stored(t))
    assert got.dtype == np.float64 and got.shape == (3, 4)
    assert np.array_equal(got, t.to(torch.float64).numpy())


def test_nonfinite_compared_apart_from_values():
    a = np.array([1.0, np.nan, 3.0, 2.0])
    b = np.array([1.0, np.nan, 3.5, np.inf])
    r = compare_values(a, b)
    assert r["max_abs"] == 0.5 and r["nonfinite_mismatch"] == 1
    assert r["rel_l2"] == pytest.approx(0.5 / math.sqrt(1 + 9))  # over elements finite in both
    assert compare_values(np.zeros(2), np.zeros(3))["note"] == "shape [2] vs [3]"
    assert compare_values(np.zeros(2), np.array([0.0, 1.0]))["rel_l2"] == math.inf


def test_transition_kl():
    mu_a, mu_b = np.array([0.0, 1.0]), np.array([0.5, 1.0])
    kl, s = transition_kl(mu_a, mu_b, std_t=np.float64(2.0), sigma=1.0, sigma_next=0.75)
    assert s == pytest.approx(1.0) and kl == pytest.approx((0.25 / 2) / 2)
    assert transition_kl(mu_a, mu_b, std_t=np.float64(2.0), sigma=0.5, sigma_next=0.5)[0] is None
