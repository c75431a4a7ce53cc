"""A forward replayed from a CUDA graph (``drifttool.model.graphs.GraphedForward``) is byte-equal
to the eager forward and leaves the same operator trace and capture records (L1, L2), sees
in-place weight changes, re-captures when a parameter is replaced, and runs eagerly under
autograd and probe variants; ``drifttool run`` with graphs writes the artifact it writes without.
Skipped without CUDA."""

from __future__ import annotations

import re

import pytest
import torch

from drifttool.capture import gpu_row_batch
from drifttool.capture.recorder import Recorder
from drifttool.model.config import tiny
from drifttool.model.graphs import GraphedForward
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runtime import Runtime
from tests.conftest import assert_same_records

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).cpu()


def _inputs(seed: int, batch: int, grid=(5, 7), slots=11, lens=(11, 6, 9)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, grid[0] * grid[1], 64, generator=g).bfloat16().cuda()
    txt = torch.randn(batch, slots, tiny().joint_attention_dim, generator=g).bfloat16().cuda()
    mask = (torch.arange(slots)[None, :] < torch.tensor(lens[:batch])[:, None]).cuda()
    tau = torch.rand(batch, generator=g).cuda()
    return x, txt, mask, tau, grid


@pytest.fixture(scope="module")
def model():
    return random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=3).cuda()


def _trace(rt: Runtime) -> list[tuple]:
    return sorted((e.op, e.block, e.stream, e.call, e.calls, e.kernel, e.contract, e.device)
                  for e in rt.trace.entries())


@pytest.mark.parametrize("mode", ["strict", "auto"])
@pytest.mark.parametrize("batch", [1, 3])
def test_replay_is_byte_equal_to_eager_with_the_same_trace(model, mode, batch):
    fast = GraphedForward(model)
    eager_rt, graph_rt = Runtime(mode=mode), Runtime(mode=mode)
    with torch.no_grad():
        for seed in range(4):  # eager warm-up, capture + replay, then replays on fresh inputs
            x, txt, mask, tau, grid = _inputs(seed, batch)
            with eager_rt.scope(step=seed, phase="rollout"):
                want = model(x, txt, mask, tau, grid, eager_rt)
            with graph_rt.scope(step=seed, phase="rollout"):
                got = fast(x, txt, mask, tau, grid, graph_rt)
            assert torch.equal(_bits(got), _bits(want)), (mode, batch, seed)
    assert (fast.captures, fast.replays) == (1, 3)
    assert _trace(graph_rt) == _trace(eager_rt)


def test_no_mask_and_another_grid_are_other_graphs(model):
    fast = GraphedForward(model)
    rt = Runtime(mode="strict")
    with torch.no_grad():
        for grid, masked in [((5, 7), True), ((4, 4), True), ((5, 7), False)] * 3:
            x, txt, mask, tau, _ = _inputs(7, 1, grid=grid)
            mask = mask if masked else None
            assert torch.equal(_bits(fast(x, txt, mask, tau, grid, rt)), _bits(model(x, txt, mask, tau, grid, rt)))
    assert (fast.captures, fast.replays) == (3, 6)


def test_weights_changed_in_place_are_seen_and_replaced_ones_recaptured(model):
    fast = GraphedForward(model)
    rt = Runtime(mode="strict")
    x, txt, mask, tau, grid = _inputs(1, 2)
    w = model.proj_out.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            fast(x, txt, mask, tau, grid, rt)
            fast(x, txt, mask, tau, grid, rt)
            w.mul_(0.5)  # in place: the graph reads it
            assert torch.equal(_bits(fast(x, txt, mask, tau, grid, rt)), _bits(model(x, txt, mask, tau, grid, rt)))
            model.proj_out.weight = torch.nn.Parameter(saved.clone())  # replaced: recapture
            assert torch.equal(_bits(fast(x, txt, mask, tau, grid, rt)), _bits(model(x, txt, mask, tau, grid, rt)))
        assert fast.captures == 1  # the replaced parameter dropped the graph; the call ran eagerly
    finally:
        model.proj_out.weight = torch.nn.Parameter(saved)


@pytest.mark.parametrize("level, internals, batch, lane", [
    ("L1", None, True, False), ("L2", None, True, False), ("L2", False, True, False), ("L1", None, False, False),
    ("L1", None, True, True), ("L2", None, True, True)])
def test_captured_records_of_replays_equal_the_eager_records(model, level, internals, batch, lane, monkeypatch):
    """Digest records (L1; L2 with row digests and the attention's internals, or without them:
    ``--no-internals``) of replayed forwards: the same rows as eager forwards', each replay under
    its own step, sigma and sample id (one graph: the rows share one sample at every step); the
    captured outputs' row kernels recorded a batch at a time (``capture.gpu_row_batch``), on the
    forward's stream or on one of their own (``LANE``), or a launch each."""
    monkeypatch.setattr(gpu_row_batch, "LANE", lane)
    fast = GraphedForward(model, batch_digests=batch)
    tables = {}
    for name in ("eager", "graph"):
        rec = Recorder(level)
        rt = Runtime(mode="strict", recorder=rec, internals=internals)
        with torch.no_grad():
            for step in range(4):
                x, txt, mask, tau, grid = _inputs(step, 2)
                with rt.scope(phase="rollout", step=step, sigma=1.0 - step / 4, samples=[step, step],
                              branch=("cond", "uncond"), txt_lens=[11, 6], img_grid=grid):
                    (model if name == "eager" else fast)(x, txt, mask, tau, grid, rt)
        rec.flush()
        tables[name] = rec.ops_table().to_pylist()
    assert (fast.captures, fast.replays) == (1, 3)
    assert_same_records(tables["graph"], tables["eager"], "replays against eager")
    assert {r["step"] for r in tables["graph"]} == {0, 1, 2, 3}
    roles = {r["role"] for r in tables["graph"]}
    assert ("internal" in roles) is (level == "L2" and internals is None)
    assert any(r["op"] == "joint_attention_fused" for r in tables["graph"])


def test_the_warm_up_compiles_the_batched_row_kernel_before_the_capture(model, monkeypatch):
    """The first call of a signature (eager) runs under a ``RowBatch`` as the capture will, so
    the batched row kernel is compiled (and its module loaded) then, never inside the capture,
    where loading a module is not allowed."""
    from drifttool.capture import gpu_rows_kernels

    kernel = gpu_rows_kernels._rows_many_kernel
    kernel.device_caches.clear()  # compiled afresh in this test
    seen = []
    compile_ = kernel._do_compile

    def counted(*args, **kwargs):
        seen.append(torch.cuda.is_current_stream_capturing())
        return compile_(*args, **kwargs)

    monkeypatch.setattr(kernel, "_do_compile", counted)
    fast = GraphedForward(model)
    rt = Runtime(mode="strict", recorder=Recorder("L1"))
    with torch.no_grad():
        for step in range(3):
            x, txt, mask, tau, grid = _inputs(step, 2)
            with rt.scope(phase="rollout", step=step, sigma=0.5, samples=[0, 1], branch="cond",
                          txt_lens=[11, 6], img_grid=grid):
                fast(x, txt, mask, tau, grid, rt)
    assert (fast.captures, fast.replays) == (1, 2)
    assert seen and not any(seen), seen


def test_autograd_and_variants_run_eagerly(model):
    x = _inputs(2, 1)[0]
    assert not GraphedForward.eligible(x, Runtime(mode="strict"))  # autograd is recording here
    with torch.no_grad():
        assert GraphedForward.eligible(x, Runtime(mode="strict", recorder=Recorder("L1")))
        assert not GraphedForward.eligible(x, Runtime(mode="strict", variants={"qk_rmsnorm": ("v", lambda *a, **k: a[0])}))


@pytest.fixture(scope="module")
def lora_adapter(tmp_path_factory):
    """A random rank-4 adapter of the tiny fixture model (non-zero B), saved as peft writes it."""
    from drifttool.model.checkpoint import load_checkpoint
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora

    m = load_checkpoint("fixtures/tiny-t2i/transformer", dtype=torch.float32)
    add_lora(m, rank=4, alpha=6.0, seed=2, init_b_std=0.05)
    return save_lora(m, tmp_path_factory.mktemp("lora") / "adapter")


@pytest.mark.parametrize("with_lora", [False, True], ids=["plain", "lora"])
def test_a_graphed_run_equals_an_eager_run(cli, tmp_path, monkeypatch, with_lora, lora_adapter):
    """``drifttool run`` on a GPU replays graphs (every capture taken, none refused: a failed
    capture would fall back to eager with the same bytes): its artifact (step and L2 records) is
    identical to the same run with the graphs turned into plain calls. With a LoRA adapter the
    weight digest reads the GPU weights back through pinned buffers before the first capture."""
    import drifttool.runner as runner

    extra = ("--lora", str(lora_adapter)) if with_lora else ()
    for name in ("graph", "eager"):
        if name == "eager":
            monkeypatch.setattr(runner, "rollout_forward", lambda model, device: model)
        code, out = cli("run", "-o", tmp_path / name, "--device", "cuda", "--mode", "strict",
                        "--capture", "L2", "--batch", "3", *extra)
        assert code == 0, out
        row = re.search(r"CUDA graphs\W+(\d+) captured, (\d+) calls replayed", out)
        if name == "graph":  # the summary's row (cli._summary.graph_rows): captured, replayed, none refused
            assert row and int(row[1]) > 0 and int(row[2]) > 0 and "refused" not in out, out
        else:
            assert row is None and "CUDA graphs" not in out, out
    code, out = cli("diff", tmp_path / "graph", tmp_path / "eager")
    assert code == 0 and "IDENTICAL" in out, out


def test_a_run_without_the_internals_keeps_every_other_l2_record(cli, tmp_path):
    """``drifttool run --no-internals`` on a GPU (graphed, the attention fused): identical to the
    L2 run with the internals, compared without them."""
    for name, extra in (("with", ()), ("without", ("--no-internals",))):
        code, out = cli("run", "-o", tmp_path / name, "--device", "cuda", "--mode", "strict",
                        "--capture", "L2", "--batch", "3", *extra)
        assert code == 0, out
    code, out = cli("diff", tmp_path / "with", tmp_path / "without")
    flat = " ".join(out.split())
    assert code == 0 and "IDENTICAL" in flat and "without the fused attention's internals" in flat, out


def test_edit_condition_latents_are_graph_inputs(model):
    """The edit pipelines' condition latents: static inputs of the graph, their grids part of
    its key; replays byte-equal to eager forwards."""
    fast = GraphedForward(model)
    rt = Runtime(mode="strict")
    with torch.no_grad():
        for seed in range(4):
            x, txt, mask, tau, grid = _inputs(seed, 2)
            cond = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(50 + seed)).bfloat16().cuda()
            kw = dict(cond=cond, cond_grids=((3, 4),))
            assert torch.equal(_bits(fast(x, txt, mask, tau, grid, rt, **kw)), _bits(model(x, txt, mask, tau, grid, rt, **kw)))
    assert (fast.captures, fast.replays) == (1, 3)


def test_a_graph_reads_its_row_key_table_after_the_table_grew(monkeypatch):
    """A graph captured on the row kernel's key table keeps giving the eager digest after a wider
    output replaced the cached table and the freed memory was written over."""
    from drifttool.capture import gpu_rows

    monkeypatch.setattr(gpu_rows, "_TABLES", {})
    monkeypatch.setattr(gpu_rows, "_RETIRED", [])
    x = (torch.randn(64, 300, generator=torch.Generator().manual_seed(7)) * 3).bfloat16().cuda()
    eager = [t.clone() for t in gpu_rows.row_table(x)]  # compiles; a table for 4,096 columns
    old = gpu_rows._TABLES[next(iter(gpu_rows._TABLES))]
    size = old.numel()
    del old
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu_rows.row_table(x)
    gpu_rows.row_table(torch.ones(4, 9000, dtype=torch.bfloat16, device="cuda"))  # grows it
    junk = [torch.full((size,), 0x55, dtype=torch.int8, device="cuda") for _ in range(8)]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(eager, out)), "the graph read a freed key table"
    del junk


def test_a_forward_that_cannot_be_captured_runs_eagerly(model, uncapturable):
    """A forward that synchronises with the host while being captured: the capture is refused once,
    with a warning, and every later call runs eagerly with the eager bytes; the failed capture
    leaves the default stream current, and a new wrapper still captures and replays."""
    fast = GraphedForward(model)
    rt = Runtime(mode="strict")
    x, txt, mask, tau, grid = _inputs(3, 2)
    with torch.no_grad():
        want = _bits(model(x, txt, mask, tau, grid, rt))
        with uncapturable():
            assert torch.equal(_bits(fast(x, txt, mask, tau, grid, rt)), want)  # warm-up
            with pytest.warns(RuntimeWarning, match="runs eagerly from now on"):
                assert torch.equal(_bits(fast(x, txt, mask, tau, grid, rt)), want)
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        assert torch.equal(_bits(fast(x, txt, mask, tau, grid, rt)), want)
        assert (fast.captures, fast.replays) == (0, 0) and fast.refused
        again = GraphedForward(model)
        y = _inputs(4, 1)
        want = _bits(model(*y, rt))
        for _ in range(3):
            assert torch.equal(_bits(again(*y, rt)), want)
    assert (again.captures, again.replays) == (1, 2)


def test_a_python_number_made_on_the_device_inside_a_capture_is_filled_there():
    """``graphs.device_scalars``: ``torch.as_tensor(n, device=cuda)`` (diffusers' forward makes
    one), which a capture refuses as a pageable host copy, is filled on the device; every
    replay reads the same value."""
    from drifttool.model.graphs import device_scalars

    x = torch.zeros((), dtype=torch.int64, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with device_scalars(), torch.cuda.graph(graph, stream=stream):
        y = x + torch.as_tensor(7, device=x.device) + torch.tensor(2, device="cuda")
    for start in (10, -4):
        x.fill_(start)
        graph.replay()
        torch.cuda.synchronize()
        assert (y.dtype, int(y)) == (torch.int64, start + 9)
