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


def test_after_a_refused_capture_every_call_runs_eagerly_after_one_warning():
    """``SignatureGraphs._graph``: a refused capture (``UnsupportedConfigError``) makes the wrapper
    capture nothing more, ``reset`` included (every call eager, None), after one warning; an
    out-of-memory error goes through."""
    import pytest

    from drifttool.errors import UnsupportedConfigError
    from drifttool.model.graphs import SignatureGraphs

    graphs = SignatureGraphs(torch.nn.Linear(2, 2))
    tries = []

    def refuse():
        tries.append(1)
        raise UnsupportedConfigError("CUDA graph capture of the strict forward failed (a host sync)")

    assert graphs._graph("a", refuse) is None and not tries  # the first call: eager warm-up
    with pytest.warns(RuntimeWarning, match="a host sync.*runs eagerly from now on"):
        assert graphs._graph("a", refuse) is None
    assert "a host sync" in graphs.refused and len(tries) == 1
    for key in ("a", "b", "b", "b"):
        assert graphs._graph(key, lambda: "graph") is None
    graphs.reset()
    assert graphs._graph("c", lambda: "graph") is None and graphs._graph("c", lambda: "graph") is None
    assert graphs.captures == 0 and len(tries) == 1

    def oom():
        raise torch.cuda.OutOfMemoryError("out of memory")

    fresh = SignatureGraphs(torch.nn.Linear(2, 2))
    fresh._graph("d", oom)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fresh._graph("d", oom)
    assert fresh.refused is None


def test_the_least_recently_replayed_graph_goes_past_max_graphs():
    from drifttool.model.graphs import SignatureGraphs

    graphs = SignatureGraphs(torch.nn.Linear(2, 2), max_graphs=2)
    made = []

    def capture(key):
        made.append(key)
        return f"graph {key}"

    for key in ("a", "a", "b", "b", "a", "c", "c"):  # each first call eager, the second captures
        graphs._graph(key, lambda k=key: capture(k))
    assert made == ["a", "b", "c"] and list(graphs._graphs) == ["a", "c"]  # b: least recently replayed
    assert graphs._graph("b", lambda: capture("b")) == "graph b"  # seen before: captured again at once
    assert list(graphs._graphs) == ["c", "b"] and graphs.captures == 4


def test_a_refused_capture_names_the_first_error_raised_inside_it():
    from drifttool.model.graphs import capture_refused

    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing\ndetails")
        except RuntimeError:
            raise RuntimeError("operation failed due to a previous error during capture")
    except RuntimeError as e:
        err = capture_refused("strict training step", e)
    assert str(err) == ("CUDA graph capture of the strict training step failed (operation not permitted when "
                        "stream is capturing; then: operation failed due to a previous error during capture)")
    assert "(boom)" in str(capture_refused("strict forward", RuntimeError("boom")))


def test_a_training_capture_redirects_stale_autograd_streams_and_restores_torchs_setting(monkeypatch):
    """``graphs_train.stale_streams_redirected``: torch's stale-stream override is on inside and
    back to what it was after (also after an error); without that setting (older torch) the
    capture goes ahead as before."""
    import pytest

    from drifttool.model.graphs_train import stale_streams_redirected

    get = torch._C._override_stale_capture_stream
    for before in (False, True):
        torch.autograd.graph.set_override_stale_capture_stream(before)
        try:
            with stale_streams_redirected():
                assert get() is True
            assert get() is before
            with pytest.raises(ZeroDivisionError), stale_streams_redirected():
                1 / 0
            assert get() is before
        finally:
            torch.autograd.graph.set_override_stale_capture_stream(False)
    monkeypatch.delattr(torch.autograd.graph, "set_override_stale_capture_stream")
    ran = []
    with stale_streams_redirected():
        ran.append(get())
    assert ran == [False]
