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


def test_models_that_declare_it_are_graphable():
    """``graphs.graphable``: drifttool's MMDiT and the diffusers adapter's model say so (``drifttool
    run`` replays them from graphs on a GPU); any other model runs eagerly."""
    import pytest

    from drifttool.model.graphs import graphable

    assert graphable(MMDiT(tiny())) and not graphable(torch.nn.Linear(2, 2))
    pytest.importorskip("diffusers")
    from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage, load_transformer

    tr = load_transformer("fixtures/tiny-t2i/transformer", torch.float32)
    assert graphable(DiffusersQwenImage(tr))


def test_a_subclass_with_its_own_forward_is_not_graphable_unless_it_says_so():
    """A forward overridden below the declaration may run Python a replay would skip (the peer
    probe's factor, its padding junk drawn on the host): eager, unless the subclass declares it."""
    from drifttool.model.graphs import graphable
    from drifttool.probes.peer import PeerModel
    from drifttool.probes.peer_catalog import PeerCall

    class Wrapped(MMDiT):
        def forward(self, *a, **k):
            return super().forward(*a, **k)

    class Declared(Wrapped):
        graphable = True

    class Plain(MMDiT):  # inherits the forward and its declaration
        pass

    assert not graphable(Wrapped(tiny())) and graphable(Declared(tiny())) and graphable(Plain(tiny()))
    import pytest

    pytest.importorskip("diffusers")
    from drifttool.adapters.diffusers_qwenimage import load_transformer

    tr = load_transformer("fixtures/tiny-t2i/transformer", torch.float32)
    assert not graphable(PeerModel(tr, PeerCall(), torch.device("cpu")))


def test_device_scalars_leave_everything_but_cuda_scalars_to_torch():
    """``graphs.device_scalars`` (inside a capture) changes only a Python number made on a CUDA
    device (a GPU test runs that in a capture); torch's functions come back even on an error."""
    import pytest

    from drifttool.model.graphs import device_scalars

    before = torch.as_tensor, torch.tensor
    with pytest.raises(ZeroDivisionError):
        with device_scalars():
            assert (torch.as_tensor, torch.tensor) != before
            a, b = torch.as_tensor(5), torch.tensor([1.5, 2.0], dtype=torch.float64)
            c = torch.as_tensor(True, device="cpu")
            assert (a.dtype, b.dtype, c.dtype, a.item(), b.tolist(), c.item()) == (
                torch.int64, torch.float64, torch.bool, 5, [1.5, 2.0], True)
            assert torch.tensor(3, requires_grad=False).item() == 3
            1 / 0
    assert (torch.as_tensor, torch.tensor) == before


def test_graphed_training_sees_while_a_returned_velocity_graph_lives():
    """``GraphedTraining`` defers a capture while the autograd graph of a velocity it returned
    lives (micro-batches before one backward): its mark lives and dies with that graph, held
    through later operations (a micro-batch copied into the whole batch), and survives the
    backward until the graph's last tensor is dropped."""
    from drifttool.model.graphs_train import GraphedTraining

    fast = GraphedTraining(MMDiT(tiny()))
    w = torch.nn.Parameter(torch.randn(3, 3))
    v = fast._tracked(torch.randn(2, 3) @ w)
    whole = torch.zeros(4, 3).index_copy(0, torch.tensor([1, 3]), v)
    del v
    assert fast._held()
    whole.sum().backward()
    assert fast._held()
    del whole
    assert not fast._held()
    fast._tracked(torch.randn(2, 3))  # no autograd history: nothing to wait for
    assert not fast._held()


def test_the_diffusers_adapter_names_the_rope_tables_its_forward_reads():
    """``DiffusersQwenImage.graph_constants``: the cached per-shape RoPE tables of diffusers'
    forward (the same objects at every call, so a graph holding them keeps what it reads); with
    the edit pipelines' condition grids, one per image, in the forward's order."""
    import pytest

    pytest.importorskip("diffusers")
    from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage, load_transformer

    model = DiffusersQwenImage(load_transformer("fixtures/tiny-t2i/transformer", torch.float32))
    rope, cpu = model.transformer.pos_embed, torch.device("cpu")
    for grid, conds in (((5, 7), ()), ((4, 6), ((3, 5), (6, 2)))):
        held = model.graph_constants(grid, 9, conds, cpu)
        assert len(held) == 1 + len(conds) and all(a is b for a, b in zip(held, model.graph_constants(grid, 9, conds, cpu)))
        shapes = [(1, *grid), *((1, *g) for g in conds)]
        want = rope([shapes] if conds else [(1, *grid)], device=cpu, max_txt_seq_len=9)[0]
        assert torch.equal(torch.cat(held), want)


def test_a_training_capture_waits_only_where_torch_cannot_redirect_the_stale_stream(monkeypatch):
    """``GraphedTraining._waits_for_capture``: a signature due for capture waits while an earlier
    output's graph lives, unless torch redirects stale streams (then it captures at once); a
    first call (the warm-up) never waits; after ``WAITS_BEFORE_WARNING`` waits a warning says
    why, once."""
    import warnings

    import pytest

    from drifttool.model import graphs_train
    from drifttool.model.graphs_train import WAITS_BEFORE_WARNING, GraphedTraining

    fast = GraphedTraining(MMDiT(tiny()))
    key = ("signature",)
    w = torch.nn.Parameter(torch.randn(3, 3))
    v = fast._tracked(torch.randn(2, 3) @ w)
    monkeypatch.setattr(graphs_train, "_redirect_api", lambda: None)
    assert not fast._waits_for_capture(key)  # not seen yet: the warm-up runs
    fast._seen.add(key)
    for _ in range(WAITS_BEFORE_WARNING - 1):
        assert fast._waits_for_capture(key)
    with pytest.warns(RuntimeWarning, match="micro-batches before one backward"):
        assert fast._waits_for_capture(key)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fast._waits_for_capture(key)  # said once
    monkeypatch.setattr(graphs_train, "_redirect_api", lambda: (print, print))
    assert not fast._waits_for_capture(key)  # torch redirects the stream: capture now
    monkeypatch.setattr(graphs_train, "_redirect_api", lambda: None)
    del v
    assert not fast._waits_for_capture(key)
