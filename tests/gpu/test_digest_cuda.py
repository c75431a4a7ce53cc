"""Digest v2 gives the same values on a CUDA device as on the CPU (exact integer arithmetic in
FP64 cuBLAS products and int64), is computed there without a copy to the host, and its shard
partials combine across devices. Skipped without a GPU; run with ``python -m pytest tests/gpu``.
"""

import numpy as np
import pytest
import torch

from drifttool.capture.digest import combine, digest_pending, digest_tensor, materialize, partial
from drifttool.capture.recorder import Recorder
from tests.capture.test_digest import DTYPES, random_tensor
from tests.capture.test_recorder import joint_out, site

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", DTYPES + [torch.complex64, torch.int32])
@pytest.mark.parametrize("shape,axis", [((6889, 24), 0), ((3, 70_001), 0), ((2, 17, 5), 1),
                                        ((70_003,), None), ((0, 4), 0), ((), None)])
def test_cpu_and_cuda_digests_are_equal(dtype, shape, axis):
    t = random_tensor(sum(shape) + 1, dtype, shape)
    cpu = digest_tensor(t, row_axis=axis, keep_rows=axis is not None)
    dev = digest_tensor(t.cuda(), row_axis=axis, keep_rows=axis is not None)
    assert dev.digest == cpu.digest and dev.nonfinite == cpu.nonfinite
    assert (dev.rows is None and cpu.rows is None) or dev.rows.tolist() == cpu.rows.tolist()
    if dtype.is_floating_point and cpu.nonfinite == 0 and t.numel():
        assert dev.maxabs == cpu.maxabs and dev.l2 == pytest.approx(cpu.l2, rel=1e-12)


def test_pending_stays_on_the_device_and_reads_back_once():
    ts = [random_tensor(i, torch.bfloat16, (257, 3072)).cuda() for i in range(5)]
    pending = [digest_pending(t, row_axis=0, keep_rows=True) for t in ts]
    assert all(p.table[0].device.type == "cuda" for p in pending)  # the Triton row kernel's tables
    got = materialize(pending)
    assert [d.digest for d in got] == [digest_tensor(t.cpu(), row_axis=0).digest for t in ts]


def test_shards_on_the_device_combine_to_the_cpu_digest():
    t = random_tensor(9, torch.bfloat16, (6889, 6, 8))
    parts = [partial(t[r0:r1, h0:h0 + 3].cuda(), row_axis=0, row_offset=r0, col_offset=h0 * 8)
             for r0, r1 in ((0, 3000), (3000, 6889)) for h0 in (0, 3)]
    v, rows = combine(parts, "bfloat16", (6889, 6, 8), row_axis=0)
    whole = digest_tensor(t, row_axis=0)
    assert v == whole.digest and rows.tolist() == whole.rows.tolist()


def test_recorder_on_cuda_writes_the_cpu_records():
    # capture and step records of CUDA tensors: computed on the device, read back at flush
    def run(device):
        rec = Recorder("L2")
        # finite values (NaN != NaN would fail the comparison of maxabs, not the digest)
        out = torch.randn(2, 4, 3072, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
        rec.capture(site(), out, "BS.")
        rec.record_step(phase="rollout", step=0, sigma=1.0, sigma_next=0.5, sample=0, branch="cfg",
                        quantities={"x_t": joint_out()[0].to(device), "v_t": out[0].to(device)})
        rec.flush()
        drop = lambda rows: [{k: v for k, v in r.items() if k != "l2"} for r in rows]
        return drop(rec.ops_table().to_pylist()), drop(rec.steps_table().to_pylist())

    assert run("cuda") == run("cpu")


_PATTERNS = {2: [0x0000, 0x8000, 0x7FC1, 0xFF80, 0x0001, 0x7C00, 0xFE01],
             4: [0x00000000, 0x80000000, 0x7FC00001, 0xFF800000, 0x00000001, 0x7F800000]}


def _special(dtype, shape, seed):
    """Random values with ±0, NaN payloads, ±inf and subnormals planted by bit pattern."""
    t = random_tensor(seed, dtype, shape).contiguous()
    size = t.element_size()
    bits = t.view(torch.int16 if size == 2 else torch.int32).numpy()
    flat = bits.view(np.uint16 if size == 2 else np.uint32).reshape(-1)  # shares t's memory
    for i, v in enumerate(_PATTERNS[size]):
        flat[(i * 7919) % flat.size] = v
    return t


_KERNEL1 = dict(kernel=1, bm=16, bc=128, warps=4, stages=3)


@pytest.mark.parametrize("kernel", [1, 2])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(6889, 3072), (37, 12288), (3, 70_001), (1, 262_144), (17, 5),
                                   (6889, 24), (31, 40), (21, 64), (3, 240)])
def test_triton_row_kernel_equals_the_cpu(dtype, shape, split, kernel, monkeypatch):
    from drifttool.capture import gpu_rows

    if kernel == 1:
        for key, value in _KERNEL1.items():
            monkeypatch.setitem(gpu_rows.TILE, key, value)
    monkeypatch.setitem(gpu_rows.TILE, "split", split)
    t = _special(dtype, shape, seed=shape[0])
    rows, stats = gpu_rows.combine_splits(*gpu_rows.row_table(t.cuda()))
    cpu = digest_tensor(t, row_axis=0)
    assert rows[:, 0].cpu().numpy().astype("uint64").tolist() == cpu.rows.tolist()
    dev = digest_tensor(t.cuda(), row_axis=0)
    assert (dev.digest, dev.nonfinite) == (cpu.digest, cpu.nonfinite)
    assert dev.rows.tolist() == cpu.rows.tolist()
    assert int(stats[:, 3].sum()) == cpu.nonfinite
    x = t.double()
    nan = torch.isnan(x)
    assert stats[:, 3].cpu().tolist() == (~torch.isfinite(x)).sum(1).double().tolist()
    assert stats[:, 1].cpu().tolist() == torch.where(nan, -torch.inf, x).amax(1).tolist()
    assert stats[:, 2].cpu().tolist() == torch.where(nan, torch.inf, x).amin(1).tolist()
    if dtype.is_floating_point and cpu.nonfinite == 0:
        assert float(stats[:, 1].max()) == cpu.maxabs or float(-stats[:, 2].min()) == cpu.maxabs


@pytest.mark.parametrize("tile", [dict(bm=128, bc=64, warps=8), dict(bm=64, bc=256, v=0),
                                  dict(bm=16, bc=16, split=3), dict(regs=0),
                                  dict(bm=64, bc=128, stages=4, split=8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel2_settings_give_kernel1_tables(dtype, tile):
    # T, T' bit for bit, max/min/counts exactly, under the settings the sweep tries
    from drifttool.capture import gpu_rows

    t = _special(dtype, (4099, 777), seed=5).cuda()
    base = dict(kernel=2, bm=64, bc=128, warps=4, stages=3, split=4, v=8, regs=1)
    r1, s1 = gpu_rows.combine_splits(*gpu_rows.launch(t, dict(_KERNEL1, split=2)))
    r2, s2 = gpu_rows.combine_splits(*gpu_rows.launch(t, dict(base, **tile)))
    assert torch.equal(r1, r2)
    assert torch.equal(s1[:, 1:], s2[:, 1:])
    fin = torch.isfinite(s1[:, 0])
    assert torch.equal(fin, torch.isfinite(s2[:, 0]))
    assert torch.allclose(s1[fin, 0], s2[fin, 0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("layout,shape,stream,lens", [
    ("BS.", (3, 7 + 24, 40), "joint", [7, 3, 0]), ("BS..", (1, 24, 4, 8), "img", None),
    ("B.", (3, 6 * 40), "img", None), ("BS.", (3, 7, 40), "txt", [7, 1, 4])])
@pytest.mark.parametrize("split", [1, 3])
def test_recorder_fast_path_writes_the_cpu_records(layout, shape, stream, lens, split, monkeypatch):
    from drifttool.capture import gpu_rows

    monkeypatch.setitem(gpu_rows.TILE, "split", split)

    def run(device):
        rec = Recorder("L2")
        t = random_tensor(5, torch.bfloat16, shape).to(device)
        nb = shape[0]
        rec.capture(site(stream=stream, samples=list(range(nb)), txt_lens=lens, img_grid=(4, 6)),
                    t, layout)
        rec.flush()
        nan = lambda v: "nan" if isinstance(v, float) and v != v else v  # noqa: E731 - NaN == NaN here
        return [{k: nan(v) for k, v in r.items() if k != "l2"} for r in rec.ops_table().to_pylist()]

    assert run("cuda") == run("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(6889, 24), (31, 40), (21, 64), (3, 240), (16, 136), (64, 3136)])
def test_kernel2_partial_tile_with_an_aligned_stride(dtype, shape):
    # the case Triton once compiled wrongly (a vectorised masked uint8 load with other=128):
    # kernel 2 called directly, past row_table's routing, gives kernel 1's tables
    from drifttool.capture import gpu_rows

    t = _special(dtype, shape, seed=7).cuda()
    r1, s1 = gpu_rows.combine_splits(*gpu_rows.launch(t, dict(_KERNEL1, split=2)))
    r2, s2 = gpu_rows.combine_splits(*gpu_rows.launch(t, dict(gpu_rows.TILE, kernel=2)))
    assert torch.equal(r1, r2)
    assert torch.equal(s1[:, 1:], s2[:, 1:])


def _batch_outputs(seed):
    """Outputs of the shapes a block captures and awkward ones: the aligned partial tiles above,
    a strided and misaligned column slice, fp16 and fp32, one without rows."""
    xs = [_special(torch.bfloat16, s, seed + i).cuda() for i, s in
          enumerate([(4096, 3072), (128, 3072), (4096, 12288), (31, 40), (16, 136), (3, 240)])]
    xs.append(_special(torch.bfloat16, (257, 3100), seed).cuda()[:, 3:3075])
    xs += [_special(torch.float16, (6889, 24), seed).cuda(), _special(torch.float32, (37, 700), seed).cuda(),
           torch.empty(0, 64, dtype=torch.bfloat16, device="cuda")]
    return xs


def _table_bits(table):
    return [table[0].clone(), table[1].clone().view(torch.int64)]


@pytest.mark.parametrize("entries", [64, 3])
def test_one_launch_a_batch_writes_the_tables_of_a_launch_each(entries, monkeypatch):
    """``RowBatch``'s launches, the text lane's outputs on a second stream included, write every
    table a launch per output writes: T, T' and the summaries' raw bits."""
    from drifttool.capture import gpu_row_batch, gpu_rows

    monkeypatch.setitem(gpu_row_batch.BATCH, "entries", entries)
    xs = _batch_outputs(11)
    side = torch.cuda.Stream()
    with gpu_row_batch.RowBatch() as batch:
        tables = []
        for i, x in enumerate(xs):
            if i % 3 == 1:  # as the text lane's outputs
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    tables.append(gpu_rows.row_table(x))
            else:
                tables.append(gpu_rows.row_table(x))
        assert entries == 3 or batch.launches == 0  # deferred until the end
    torch.cuda.synchronize()
    for x, got in zip(xs, tables):
        want = gpu_rows.launch(x, gpu_rows.TILE)
        assert all(torch.equal(a, b) for a, b in zip(_table_bits(got), _table_bits(want))), (x.dtype, x.shape)
    assert batch.tensors == len(xs) - 1 and batch.launches < batch.tensors


def _captured_tables(src, last=None):
    """A CUDA graph of ``o = x * 1`` for each of ``src`` and the row tables of the ``o``, through
    a ``RowBatch`` whose arena an eager run measured; ``last()`` runs in the capture just before
    the batch's launches."""
    from drifttool.capture import gpu_row_batch, gpu_rows

    with gpu_row_batch.RowBatch(defer=False) as warm:  # compiled, key tables grown, the arena measured
        [gpu_rows.row_table(x * 1) for x in src]
    graph = torch.cuda.CUDAGraph()
    batch = gpu_row_batch.RowBatch(torch.empty(warm.words, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    with torch.cuda.graph(graph), batch:
        outs = [x * 1 for x in src]  # the graph's own outputs
        tables = [gpu_rows.row_table(o) for o in outs]
        if last is not None:
            last()
    batch.fill()
    assert batch.launches >= 1 and batch.keep
    return graph, outs, tables, batch


def _replays_give_each_outputs_tables(graph, src, outs, tables):
    from drifttool.capture import gpu_rows

    for seed in (5, 6):
        for x, new in zip(src, _batch_outputs(seed)[:5]):
            x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        for o, got in zip(outs, tables):  # (x * 1 may quiet a NaN: the table of o's own bytes)
            want = gpu_rows.launch(o, gpu_rows.TILE)
            assert all(torch.equal(a, b) for a, b in zip(_table_bits(got), _table_bits(want)))


def test_a_graph_of_batched_launches_digests_each_replays_values():
    """Recorded in a CUDA graph, the batched launches read their address tables (in the arena,
    written after the capture, kept with the graph) and the outputs at every replay: new values
    give their own tables, after memory freed since the capture was written over."""
    src = [x.clone() for x in _batch_outputs(3)[:5]]
    graph, outs, tables, _ = _captured_tables(src)
    junk = [torch.full((1 << 20,), 0x55, dtype=torch.int64, device="cuda") for _ in range(8)]
    _replays_give_each_outputs_tables(graph, src, outs, tables)
    del junk


def test_a_graph_writing_its_freed_memory_again_leaves_its_address_tables_alone():
    """Tensors freed early in a capture hand their memory to what the capture allocates later;
    each replay writes them again before the launches run. The address tables live outside the
    graph's pool (the arena), so a replay never overwrites them (an address table the capture
    allocated was overwritten so and its launch read addresses of nothing)."""
    src = [x.clone() for x in _batch_outputs(4)[:5]]

    def scratch():  # small blocks of the graph's pool, written, freed before the launches
        for n in (64, 96, 128, 256, 512, 1024, 4096):
            torch.full((n,), -1, dtype=torch.int64, device="cuda").add_(0)

    graph, outs, tables, batch = _captured_tables(src, scratch)
    assert len(batch.keep) == 1  # the arena: no table in the graph's pool
    _replays_give_each_outputs_tables(graph, src, outs, tables)


def test_a_text_lane_launch_reads_an_output_the_main_lane_made_and_freed(monkeypatch):
    """An output made on the main stream and digested on a second stream (the text lane's
    batch, launched after the lanes stopped keeping it): once dropped, its memory is not handed
    to the main stream's next tensor before the launch has read it."""
    from drifttool.capture import gpu_row_batch, gpu_rows

    monkeypatch.setitem(gpu_row_batch.BATCH, "entries", 1)  # launched at once, on the side stream
    x = _special(torch.bfloat16, (4096, 3072), 21).cuda()
    want = _table_bits(gpu_rows.launch(x, gpu_rows.TILE))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with gpu_row_batch.RowBatch():
        with torch.cuda.stream(side):
            torch.cuda._sleep(500_000_000)  # the side stream busy: its launch runs late
            got = gpu_rows.row_table(x)
        del x
        y = torch.full((4096, 3072), 7.0, dtype=torch.bfloat16, device="cuda")  # the main stream's next tensor
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_table_bits(got), want))
    del y
