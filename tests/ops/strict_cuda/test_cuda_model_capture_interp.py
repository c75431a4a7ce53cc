"""A captured strict forward of the tiny model through the strict CUDA family's kernels, run by
Triton's interpreter on CPU tensors (dispatched as on CUDA: the registry's device and the capture's
row path are told so): its L1 and L2 records are the same whether the kernels that write the
outputs hand their row tables to the captures (``capture.produced``) or the row kernel reads
every output again, and most captures take a handed-over table; at L2 the fused attention's own
tables of its scores and probabilities (never stored) give the decomposition's records and trace.
The GPU's own run is ``tests/gpu/test_produced_digests_cuda.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from drifttool.capture import gpu_rows, produced
from drifttool.capture.recorder import Recorder
from drifttool.model.config import tiny
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.ops import registry
from drifttool.runtime import Runtime
from tests.conftest import assert_same_records

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


def _records(model, level: str, enabled: bool, launches, monkeypatch, starts=None) -> tuple[list, int, list]:
    """The records of one captured forward (3 samples, prompts of 11, 6 and 9 tokens padded to
    11: on the right, or from ``starts``), the row kernel's launches, and the trace."""
    monkeypatch.setattr(produced, "ENABLED", enabled)
    launches[0] = 0
    rec = Recorder(level)
    rt = Runtime(mode="strict", recorder=rec)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 35, 64, generator=g)
    txt = torch.randn(3, 11, tiny().joint_attention_dim, generator=g)
    t0 = torch.tensor(starts or [0, 0, 0])[:, None]
    slot = torch.arange(11)[None, :]
    mask = (slot >= t0) & (slot < t0 + torch.tensor([11, 6, 9])[:, None])
    with torch.no_grad(), rt.scope(phase="rollout", step=0, sigma=0.5, samples=[0, 1, 2], txt_lens=[11, 6, 9],
                                   txt_starts=starts, img_grid=(5, 7)):
        model(x, txt, mask, torch.rand(3, generator=g), (5, 7), rt)
    rec.flush()
    kernels = {e.kernel for e in rt.trace.entries()}
    assert all(k.startswith(("triton", "silu_f64+triton", "sincos_f64+triton")) for k in kernels), kernels
    trace = sorted((e.op, e.block, e.stream, e.call, e.kernel, e.contract, e.reason) for e in rt.trace.entries())
    return rec.ops_table().to_pylist(), launches[0], trace


@pytest.mark.parametrize("level", ["L1", "L2"])
def test_records_with_handed_over_tables_are_the_row_kernels(as_on_cuda, monkeypatch, level):
    model = random_init_(MMDiT(tiny(), dtype=torch.float32), seed=1)
    handed, n_handed, _ = _records(model, level, True, as_on_cuda, monkeypatch)
    read, n_read, _ = _records(model, level, False, as_on_cuda, monkeypatch)
    assert_same_records(handed, read, "producers' tables against the row kernel's")
    assert n_handed < n_read / 2, (n_handed, n_read)


@pytest.mark.parametrize("starts, fold", [(None, None), ([0, 5, 2], None), ([0, 5, 2], 1)])
def test_l2_internals_from_the_fused_kernels_tables_are_the_decompositions(as_on_cuda, monkeypatch, starts, fold):
    """At L2 the fused attention files its scores' and probabilities' records from the tables its
    second pass wrote, never storing them (``scores`` is not called): the same records and trace
    entries as running the decomposition, prompts padded on the right and on the left, and with
    the limb sums folded after every image key block (``fold`` 1) as a longer sequence folds them."""
    import triton.language as tl

    from drifttool.ops import sink
    from drifttool.ops.strict_cuda.kernels import attention

    if fold is not None:
        monkeypatch.setattr(attention, "FOLD_BLOCKS", tl.constexpr(fold))

    wide = dataclasses.replace(tiny(), attention_head_dim=32, axes_dims_rope=(8, 12, 12))  # Dh 16: declined
    model = random_init_(MMDiT(wide, dtype=torch.float32), seed=2)
    monkeypatch.setattr(registry, "internals_from_tables", lambda rt: False)  # the decomposition runs
    unfused, _, unfused_trace = _records(model, "L2", True, as_on_cuda, monkeypatch, starts)

    def refused(*a, **k):
        raise AssertionError("the scores were stored")

    monkeypatch.setattr(registry, "internals_from_tables", sink.internals_from_tables)
    monkeypatch.setattr(attention, "scores", refused)
    fused, _, fused_trace = _records(model, "L2", True, as_on_cuda, monkeypatch, starts)
    assert fused_trace == unfused_trace
    assert_same_records(fused, unfused, "internals from the fused kernel's tables")
