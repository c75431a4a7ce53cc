"""A captured strict forward of the tiny model through the strict CUDA family's kernels, run by
Triton's interpreter on CPU tensors (dispatched as on CUDA: the registry's device and the capture's
row path are told so): its L1 and L2 records are the same whether the kernels that write the
outputs hand their row tables to the captures (``capture.produced``) or the row kernel reads
every output again, and most captures take a handed-over table. The GPU's own run is
``tests/gpu/test_produced_digests_cuda.py``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from drifttool.capture import gpu_rows, produced
from drifttool.capture.recorder import Recorder
from drifttool.model.config import tiny
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.ops import registry
from drifttool.runtime import Runtime

pytestmark = pytest.mark.slow


@pytest.fixture
def as_on_cuda(monkeypatch):
    """CPU tensors dispatched to the strict CUDA family and digested on the row-table path."""
    real = registry.call_device
    monkeypatch.setattr(registry, "call_device", lambda name, args, kw: "cuda" if real(name, args, kw) == "cpu"
                        else real(name, args, kw))
    impls = {k: [dataclasses.replace(i, constraints=tuple(c for c in i.constraints if not c.name.startswith("device")))
                 for i in v] if k[2] == "cuda" else v for k, v in registry._IMPLS.items()}
    monkeypatch.setattr(registry, "_IMPLS", impls)
    monkeypatch.setattr(gpu_rows, "available", lambda t: t.dtype in (torch.bfloat16, torch.float16, torch.float32))
    launches = [0]
    launch = gpu_rows.launch

    def counted(x, tile):
        launches[0] += 1
        return launch(x, tile)

    monkeypatch.setattr(gpu_rows, "launch", counted)
    return launches


def _records(model, level: str, enabled: bool, launches, monkeypatch) -> tuple[list, int]:
    monkeypatch.setattr(produced, "ENABLED", enabled)
    launches[0] = 0
    rec = Recorder(level)
    rt = Runtime(mode="strict", recorder=rec)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 35, 64, generator=g)
    txt = torch.randn(3, 11, tiny().joint_attention_dim, generator=g)
    mask = torch.arange(11)[None, :] < torch.tensor([11, 6, 9])[:, None]
    with torch.no_grad(), rt.scope(phase="rollout", step=0, sigma=0.5, samples=[0, 1, 2], txt_lens=[11, 6, 9],
                                   img_grid=(5, 7)):
        model(x, txt, mask, torch.rand(3, generator=g), (5, 7), rt)
    rec.flush()
    kernels = {e.kernel for e in rt.trace.entries()}
    assert all(k.startswith(("triton", "silu_f64+triton", "sincos_f64+triton")) for k in kernels), kernels
    return rec.ops_table().to_pylist(), launches[0]


@pytest.mark.parametrize("level", ["L1", "L2"])
def test_records_with_handed_over_tables_are_the_row_kernels(as_on_cuda, monkeypatch, level):
    model = random_init_(MMDiT(tiny(), dtype=torch.float32), seed=1)
    handed, n_handed = _records(model, level, True, as_on_cuda, monkeypatch)
    read, n_read = _records(model, level, False, as_on_cuda, monkeypatch)
    assert handed and len(handed) == len(read)
    for a, b in zip(handed, read):
        la, lb = a.pop("l2"), b.pop("l2")  # Σx²: a summary, summed in another order
        assert a == b, (a["op"], a["stream"], a["block"])
        assert la == lb or math.isclose(la, lb, rel_tol=1e-12)
    assert n_handed < n_read / 2, (n_handed, n_read)
