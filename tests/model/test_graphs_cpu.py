"""``GraphedForward`` off a GPU: every call runs the model itself (bytes, trace and records as
the model's), and ``eligible`` names what keeps a call eager. The replay itself is tested on a
GPU (``tests/gpu/test_cuda_graphs.py``)."""

from __future__ import annotations

import torch

from drifttool.capture.recorder import Recorder
from drifttool.model.config import tiny
from drifttool.model.graphs import GraphedForward
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runtime import Runtime


def test_cpu_calls_run_the_model_itself():
    model = random_init_(MMDiT(tiny()), seed=1)
    fast = GraphedForward(model)
    g = torch.Generator().manual_seed(0)
    x, txt = torch.randn(3, 35, 64, generator=g), torch.randn(3, 9, tiny().joint_attention_dim, generator=g)
    mask, tau = torch.arange(9)[None, :] < torch.tensor([[9], [4], [7]]), torch.rand(3, generator=g)
    a, b = Runtime(mode="strict"), Runtime(mode="strict")
    with torch.no_grad():
        for _ in range(3):
            got, want = fast(x, txt, mask, tau, (5, 7), a), model(x, txt, mask, tau, (5, 7), b)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert (fast.captures, fast.replays) == (0, 0) and fast.dtype == model.dtype
    assert [(e.op, e.calls) for e in a.trace.entries()] == [(e.op, e.calls) for e in b.trace.entries()]


def test_cpu_tensors_are_never_graphed():
    x = torch.zeros(1, 4, 64)
    with torch.no_grad():
        for level in ("L0", "L1", "L2"):
            assert not GraphedForward.eligible(x, Runtime(mode="strict", recorder=Recorder(level)))
