"""The test harness itself (``tests/harness.py``): a CPU target never skips a missing
implementation, a device target skips with the reason, inputs move without changing bytes."""

import pytest
import torch

from drifttool.errors import UnsupportedConfigError
from tests import harness
from tests.conftest import assert_same_bytes
from tests.harness import Target, run_in_layout, targets


def test_targets_are_family_device_pairs_with_cuda_skipped_without_a_gpu():
    params = targets()
    assert [p.id for p in params] == ["strict-cpu", "strict-cuda", "production-cpu", "production-cuda"]
    for p in params:
        skips = [m for m in p.marks if m.name == "skip"]
        want = [] if p.id.endswith("cpu") or harness.HAS_CUDA else ["no CUDA device"]
        assert [m.kwargs["reason"] for m in skips] == want, p.id
    assert [p.id for p in targets("strict")] == ["strict-cpu", "strict-cuda"]


def test_cpu_target_fails_on_a_missing_implementation():
    """No skip-on-missing on the CPU: the registry's error reaches the test."""
    t = Target("no_such_family", "cpu")
    assert t.missing("mlp_down_gemm") is None
    with pytest.raises(UnsupportedConfigError, match="no 'no_such_family' implementation for device 'cpu'"):
        t.impl("mlp_down_gemm")


def test_device_target_skips_naming_the_missing_implementation(monkeypatch):
    monkeypatch.setattr(harness, "HAS_CUDA", True)  # as on a GPU host: only the registry decides
    assert Target("production", "cuda").missing("mlp_down_gemm") is None
    why = Target("no_such_family", "cuda").missing("mlp_down_gemm")
    assert why == "registry has no 'no_such_family' implementation of 'mlp_down_gemm' for device 'cuda'"
    with pytest.raises(pytest.skip.Exception, match="registry has no 'no_such_family'"):
        Target("no_such_family", "cuda").impl("mlp_down_gemm")
    monkeypatch.setattr(harness, "HAS_CUDA", False)
    assert Target("production", "cuda").missing("mlp_down_gemm") == "no CUDA device"


def test_put_moves_nested_tensors_and_keeps_bytes(target):
    g = torch.Generator().manual_seed(5)
    x = torch.tensor([0.0, -0.0, float("nan")]) * torch.randn(3, generator=g).abs()
    a, (b, c), d = target.put(x, (x, [x]), {"k": x, "n": 3})
    assert {t.device.type for t in (a, b, c[0], d["k"])} == {target.device}
    assert d["n"] == 3
    assert_same_bytes(harness.to_cpu(d["k"]), x, "moved and back")


def test_layouts_and_unknown_layout(tmp_path):
    assert [p.id for p in harness.layouts()] == list(harness.LAYOUTS)
    assert [m.name for m in harness.layouts()[1].marks] == ["slow"]
    with pytest.raises(ValueError, match="unknown layout 'tp2'"):
        run_in_layout("tp2", "run", cwd=tmp_path)
