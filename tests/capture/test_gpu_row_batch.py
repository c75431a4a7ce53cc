"""``capture.gpu_row_batch.RowBatch`` in Triton's interpreter on CPU tensors: the row tables of
many outputs written by one launch a word type are those of a launch each (``gpu_rows.launch``)
byte for byte — T, T' and the summaries' raw bits — for mixed dtypes, awkward shapes, strided
and misaligned rows, empty outputs and early flushes; an output changed in place before its
launch is refused; a failed block launches nothing. With a CUDA device these skip:
``tests/gpu/test_digest_cuda.py`` runs the batch there, in and out of a CUDA graph."""

import contextlib
import importlib.util

import pytest
import torch

from drifttool.capture import gpu_row_batch, gpu_rows, produced
from drifttool.capture.gpu_row_batch import RowBatch
from drifttool.errors import UnsupportedConfigError

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="a CUDA device is present (tests/gpu runs the batch there) or Triton is missing")

SMALL = dict(kernel=2, bm=16, bc=64, warps=4, stages=2, split=3, v=8, regs=1)


@pytest.fixture
def small_tile(monkeypatch):
    for k, v in SMALL.items():
        monkeypatch.setitem(gpu_rows.TILE, k, v)


def _outputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(shape, dtype):
        return (torch.randn(shape, generator=g) * 3).to(dtype)

    wide = rnd((9, 140), torch.bfloat16)
    odd = rnd((7, 301), torch.float16)
    odd[2, 5] = float("nan")
    odd[6, 300] = float("-inf")
    return [rnd((1, 300), torch.bfloat16),               # one row, a partial last tile
            rnd((37, 130), torch.bfloat16),              # rows past a program's end
            wide[:, 3:133],                              # strided rows, a misaligned address
            odd,                                         # fp16, NaN and -inf in rows
            rnd((19, 70), torch.float32),                # fp32: its own launch
            rnd((0, 64), torch.bfloat16),                # no rows
            rnd((5, 64), torch.bfloat16),                # more splits than tiles
            rnd((3, 1), torch.float32)]                  # one column


def _raw(table):
    rows, stats = table
    return rows.clone(), stats.clone().view(torch.int64)  # the summaries' bits, NaN included


@pytest.mark.parametrize("entries", [64, 2])
def test_one_launch_writes_the_tables_a_launch_each_writes(small_tile, monkeypatch, entries):
    monkeypatch.setitem(gpu_row_batch.BATCH, "entries", entries)
    xs = _outputs(entries)
    with RowBatch() as batch:
        tables = [batch.add(x) for x in xs]
    for x, got in zip(xs, tables):
        want = gpu_rows.launch(x, gpu_rows.TILE)
        for a, b in zip(_raw(got), _raw(want)):
            assert torch.equal(a, b), (x.dtype, tuple(x.shape))
    assert batch.tensors == len(xs) - 1  # the output without rows needs no program
    # one launch per word type, rows per program and alignment: at the end bf16 misaligned
    # (three outputs), fp16, fp32 and bf16 aligned (the 5 × 64); flushed two at a time, 6
    assert batch.launches == (4 if entries == 64 else 6)
    assert len(batch.keep) == batch.launches


def test_the_words_a_capture_needs_do_not_depend_on_the_batching(small_tile, monkeypatch):
    """``words`` (what an eager forward measures for its capture's arena) is the size of the
    address tables the launches read, however the outputs were batched."""
    used = set()
    for entries in (64, 2, 1):
        monkeypatch.setitem(gpu_row_batch.BATCH, "entries", entries)
        with RowBatch() as batch:
            for x in _outputs(4):
                batch.add(x)
        used.add((batch.words, sum(p.numel() for p in batch.keep)))
    assert len(used) == 1 and len({*used.pop()}) == 1


def test_a_warm_up_launches_each_output_at_once_and_measures_the_batchs_words(small_tile, monkeypatch):
    """``RowBatch(defer=False)`` (a graph's warm-up): ``row_table`` writes each table at once, as
    without a batch; ``words`` is what a deferring batch measures; at the end each kind of launch
    the batch will make (word type, rows per program, alignment) runs once, compiling it."""
    monkeypatch.setattr(gpu_rows, "available", lambda t: t.dtype in (torch.bfloat16, torch.float16, torch.float32))
    xs = _outputs(5)
    with RowBatch() as deferring:
        for x in xs:
            gpu_rows.row_table(x)
    with RowBatch(defer=False) as warm:
        tables = [gpu_rows.row_table(x) for x in xs]
        assert warm.launches == 0
        for x, got in zip(xs, tables):
            for a, b in zip(_raw(got), _raw(gpu_rows.launch(x, gpu_rows.TILE))):
                assert torch.equal(a, b), (x.dtype, tuple(x.shape))
    assert warm.words == deferring.words > 0
    assert warm.launches == deferring.launches == 4  # a launch per kind, on a few zeros


def test_a_capture_takes_its_tables_from_the_arena_and_refuses_to_outgrow_it():
    arena = torch.zeros(10, dtype=torch.int64)
    batch = RowBatch(arena)
    assert batch.keep == [arena]
    assert batch._cut(8).data_ptr() == arena.data_ptr()
    with pytest.raises(UnsupportedConfigError, match="more than the 10 address-table words"):
        batch._cut(4)
    with pytest.raises(UnsupportedConfigError, match="more than the 0 address-table words"):
        RowBatch()._cut(2)


def test_row_table_inside_a_batch_defers_and_outside_does_not(small_tile):
    x = _outputs(1)[1]
    with RowBatch() as batch:
        assert gpu_rows.defer_to(batch) is batch  # (put back: the batch is this thread's)
        table = batch.add(x)
        assert batch.launches == 0
    assert batch.launches == 1 and gpu_rows.defer_to(None) is None
    assert torch.equal(table[0], gpu_rows.launch(x, gpu_rows.TILE)[0])


def test_an_output_changed_in_place_before_its_launch_is_refused(small_tile):
    x = _outputs(2)[1].clone()
    with pytest.raises(UnsupportedConfigError, match="changed in place"):
        with RowBatch() as batch:
            batch.add(x)
            x.mul_(2)
    assert gpu_rows.defer_to(None) is None  # the batch let go of row_table


def test_a_failed_forward_launches_nothing(small_tile):
    with pytest.raises(KeyError):
        with RowBatch() as batch:
            batch.add(_outputs(3)[1])
            raise KeyError("the forward failed")
    assert batch.launches == 0 and gpu_rows.defer_to(None) is None


def test_batches_do_not_nest_and_inference_tensors_are_digested_at_once(small_tile):
    with RowBatch() as batch:
        with pytest.raises(RuntimeError, match="already active"):
            RowBatch().__enter__()
        assert gpu_rows.defer_to(batch) is batch
        with torch.inference_mode():
            t = torch.ones(4, 8, dtype=torch.bfloat16)
        assert not batch.takes(t) and batch.takes(torch.ones(4, 8))


@pytest.mark.parametrize("kernel,defer", [(2, True), (2, False), (1, True)])
def test_producers_leave_a_batchs_outputs_to_it_and_digest_again_after(small_tile, monkeypatch, kernel, defer):
    monkeypatch.setitem(gpu_rows.TILE, "kernel", kernel)
    token = produced.producing(True)  # as the registry marks a captured call
    try:
        assert produced.wanted()
        with pytest.raises(KeyError):
            with RowBatch(defer=defer):
                assert produced.wanted() is (kernel != 2)  # kernel 1 batches nothing
                raise KeyError("a failed forward")
        assert produced.wanted()
        with RowBatch(defer=defer):
            assert produced.wanted() is (kernel != 2)
        assert produced.wanted()
    finally:
        produced.done(token)
    assert not produced.wanted()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_a_forward_captured_through_a_batch_files_the_records_of_a_launch_each(small_tile, monkeypatch, mode):
    """The tiny model's L2 records (row digests, summaries), its outputs digested through the
    row kernel (``gpu_rows.available`` widened to CPU tensors, as on a CUDA device) a launch
    each, and through a ``RowBatch`` around the forward: the same rows (the recorder's own use
    of the tables, the outputs' lifetimes and in-place writes; no graph, no second stream)."""
    from drifttool.capture.recorder import Recorder
    from drifttool.model.config import tiny
    from drifttool.model.mmdit import MMDiT, random_init_
    from drifttool.runtime import Runtime

    monkeypatch.setattr(gpu_rows, "available", lambda t: t.dtype in (torch.bfloat16, torch.float32))
    model = random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 35, 64, generator=g).bfloat16()
    txt = torch.randn(2, 11, tiny().joint_attention_dim, generator=g).bfloat16()
    mask = torch.arange(11)[None, :] < torch.tensor([11, 6])[:, None]
    tau = torch.rand(2, generator=g)
    rows = {}
    for batched in (False, True):
        rec = Recorder("L2")
        rt = Runtime(mode=mode, recorder=rec)
        with torch.no_grad(), rt.scope(phase="rollout", step=0, sigma=1.0, samples=[0, 0],
                                       branch=("cond", "uncond"), txt_lens=[11, 6], img_grid=(5, 7)):
            with (RowBatch() if batched else contextlib.nullcontext()) as batch:
                model(x, txt, mask, tau, (5, 7), rt)
        rec.flush()
        rows[batched] = [{k: "nan" if v != v else v for k, v in r.items()} for r in rec.ops_table().to_pylist()]
    assert batch.tensors > 50 and batch.launches < batch.tensors
    assert rows[True] and rows[True] == rows[False]
