"""The gradient ledger on the strict CUDA backward (contract ``grad.cuda1``), under Triton's
interpreter on CPU tensors: an adapted weight's GEMM backward hands its ``(dy, x)`` and the CUDA
per-sample partials to the ledger's sink (no dW to autograd), the ledger reduces them by the
canonical tree and sets (dA, dB) by the strict CUDA ``lora_merge`` backward. So the adapter
gradients are the definition computed here, and byte-equal whether the step's samples run as
one batch or as micro-batches in any order — which autograd's own accumulation is not.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_same_bytes

from drifttool.errors import UnsupportedConfigError
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora
from drifttool.ops.strict.grad import grad_sink
from drifttool.ops.strict_cuda import backward as bw
from drifttool.ops.strict_cuda import linear as SL
from drifttool.ops.strict_trees import tree_sum_stack
from drifttool.settings import RunSpec, resolve
from drifttool.training.ledger import GradLedger

pytest.importorskip("drifttool.ops.strict_cuda.kernels.gemm_backward")


@pytest.fixture(scope="module")
def module():
    """One LoRA-adapted linear of the tiny model (FP32), its name and its model."""
    fx, _ = resolve(RunSpec())
    model = load_checkpoint(fx.model_dir, dtype=torch.float32)
    add_lora(model, rank=4, alpha=8, seed=5, init_b_std=0.05)
    ledger = GradLedger(model)
    name, m = next(iter(ledger.modules.items()))
    return model, name, m


def _data(m, seed):
    gen = torch.Generator().manual_seed(seed)
    n, k = m.weight.shape
    x = torch.randn(3, 13, k, generator=gen)
    g = torch.randn(3, 13, n, generator=gen)
    g[1, 9:] = 0  # sample 1's prompt padding
    return x, g


def _step(model, m, x, g, groups, *, ledger=True):
    """One step's forward/backward over the sample ``groups`` (micro-batches, in that order):
    (dA, dB) after the step."""
    a, b = m.lora_A.weight, m.lora_B.weight
    a.grad = b.grad = None
    led = GradLedger(model) if ledger else None
    for ids in groups:
        merged = SL.lora_merge(m.weight, a, b, float(m.lora_scale))
        if led is not None:
            led.watch(m, merged, {"samples": list(ids), "branch": "cond"})
        y = SL.mlp_down_gemm(x[list(ids)], merged, None)
        (y * g[list(ids)]).sum().backward()
    if led is not None:
        led.finish_step(0)
    return a.grad.clone(), b.grad.clone()


def test_ledger_adapter_grads_are_the_definition_and_layout_free(module):
    model, _, m = module
    x, g = _data(m, 1)
    whole = _step(model, m, x, g, [(0, 1, 2)])
    for groups in ([(0,), (1,), (2,)], [(2,), (0, 1)], [(1, 2), (0,)]):
        got = _step(model, m, x, g, groups)
        for what, u, v in zip(("dA", "dB"), got, whole):
            assert_same_bytes(u, v, f"{what}: micro-batches {groups} vs one batch")
    # the definition: the CUDA per-sample partials, the tree over samples, the CUDA lora_merge backward
    parts = bw.sample_weight_grads(g, x)  # [3, N, K] FP32, sample s over its own live rows
    total = tree_sum_stack([parts[i] for i in range(3)])
    want = bw.lora_grads(total, m.lora_A.weight.detach(), m.lora_B.weight.detach(), float(m.lora_scale))
    for what, u, v in zip(("dA", "dB"), whole, want):
        assert_same_bytes(u, v, f"{what} vs the definition")


def test_without_the_ledger_the_same_grads_need_not_hold_and_no_sink_is_left(module):
    model, _, m = module
    x, g = _data(m, 2)
    plain = _step(model, m, x, g, [(0, 1, 2)], ledger=False)
    led = _step(model, m, x, g, [(0, 1, 2)])
    for what, u, v in zip(("dA", "dB"), plain, led):  # same math, other orders: close, not pinned
        assert torch.allclose(u, v, rtol=1e-4, atol=1e-5), what
    merged = SL.lora_merge(m.weight, m.lora_A.weight, m.lora_B.weight, float(m.lora_scale))
    assert grad_sink(merged) is None  # finish_step detached every sink


def test_cuda_atoms_under_a_tp_cut_are_refused(module):
    model, _, m = module
    led = GradLedger(model)
    merged = SL.lora_merge(m.weight, m.lora_A.weight, m.lora_B.weight, float(m.lora_scale))
    led.watch(m, merged, {"samples": [0], "branch": "cond"})
    sink = led.slice_sink(merged, 0, 0, 2)
    x, g = _data(m, 3)
    with pytest.raises(UnsupportedConfigError, match="TP/SP"):
        sink(g[:1], x[:1], partials=bw.sample_weight_grads)
    led.close()
