"""The strict CUDA family's registration, checked without a GPU: every WS1 operator that runs on
CUDA is registered with contract ``cuda1`` behind the family's constraints (forward only, or for
the operators with a backward none), and the forward-only and Triton
constraints say why they refuse."""

from __future__ import annotations

import torch

import drifttool.ops  # noqa: F401  (registers every family)
from drifttool.ops.registry import impls
from drifttool.ops.specs import WS1_OPERATORS
from drifttool.ops.strict_cuda import _register as R
from drifttool.ops.strict_cuda.backward import TRAINABLE
from drifttool.ops.lora import PRODUCTION_ONLY
from drifttool.setting_checks import device_operators


def test_every_cuda_operator_has_a_strict_cuda_implementation_with_its_contract():
    ops = [op for op in device_operators("cuda") if op not in PRODUCTION_ONLY]  # strict refuses those modes
    assert set(ops) >= set(WS1_OPERATORS) - {"flow_sigma_table"}
    for op in ops:
        found = impls(op, "strict", "cuda")
        assert found, op
        names = [c.name for c in found[0].constraints]
        assert names[:3] == ["device cuda", "Triton importable", "qualified GPU (sm_90)"], op
        assert ("forward only" in names) == (op not in TRAINABLE), op
        assert found[0].contract.endswith("." + R.CONTRACT_VERSION), (op, found[0].contract)


def test_forward_only_refuses_a_tensor_that_wants_a_gradient():
    x = torch.ones(2, requires_grad=True)
    assert "forward only" in R.FORWARD_ONLY({"x": x})
    assert R.FORWARD_ONLY({"x": x.detach()}) is None
    with torch.no_grad():
        assert R.FORWARD_ONLY({"x": x}) is None


def test_triton_constraint_names_the_missing_package(monkeypatch):
    R._triton_missing.cache_clear()
    monkeypatch.setattr(R.importlib.util, "find_spec", lambda name: None)
    try:
        assert "Triton is not installed" in R.TRITON_READY({})
    finally:
        R._triton_missing.cache_clear()
