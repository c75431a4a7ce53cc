"""``model.replay``: what a replayed forward files in bulk equals what the eager forward files
call by call — the op records (every column, ``seq`` included), the operator trace and the call
counters — on the CPU, where the recorded forward's digests are re-read at each filing. Eager
records before, between and after the replays keep their places; a step with two forwards
starts its counters from where the first left them. (The CUDA graph that replays the forward is
tested on a GPU, ``tests/gpu/test_cuda_graphs.py``.)"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings, strategies as st

from drifttool.artifact import schema as S
from drifttool.capture.recorder import Recorder
from drifttool.model.replay import ReplayRecords, logging_runtime
from drifttool.capture.trace import OperatorTrace
from drifttool.model.config import tiny
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.ops.sink import record_external
from drifttool.runtime import Runtime


class _OneByOne:
    """A recorder without ``capture_records``: the replay hands it one output at a time."""

    def __init__(self, level: str) -> None:
        self.inner = Recorder(level)
        self.level = level

    def capture(self, *a, **kw) -> None:
        self.inner.capture(*a, **kw)

    def capture_digested(self, *a, **kw) -> None:
        self.inner.capture_digested(*a, **kw)


@pytest.fixture(scope="module")
def model():
    return random_init_(MMDiT(tiny()), seed=int(np.random.default_rng().integers(1 << 30)))


def _inputs(rng: np.random.Generator, batch: int):
    grid = (int(rng.integers(2, 6)), int(rng.integers(3, 8)))
    slots = int(rng.integers(3, 12)) | 1  # an odd prompt length
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    x = torch.randn(batch, grid[0] * grid[1], 64, generator=g)
    txt = torch.randn(batch, slots, tiny().joint_attention_dim, generator=g)
    lens = [slots, *rng.integers(1, slots + 1, batch - 1).tolist()]
    mask = torch.arange(slots)[None, :] < torch.tensor(lens)[:, None]
    return (x, txt, mask, torch.rand(batch, generator=g), grid), lens


def _sampler_record(rt: Runtime, x: torch.Tensor, n: int) -> None:
    """An eager record of the sampler's, outside the forward (placed between its records)."""
    record_external(rt, "cfg_combine_renorm", "none", x[:, :n].clone(), "B..", contract="test",
                    actual="test", kernel="test", block=S.SAMPLER_BLOCK)


@pytest.mark.parametrize("mode,level,batch", [("strict", "L1", 1), ("strict", "L2", 3),
                                              ("auto", "L2", 1), ("auto", "L1", 3)])
def test_bulk_filing_equals_the_eager_forward(model, mode, level, batch):
    rng = np.random.default_rng()
    (x, txt, mask, tau, grid), lens = _inputs(rng, batch)
    branch = "cond" if batch == 1 else tuple(rng.choice(["cond", "uncond"], batch).tolist())
    scope = dict(phase="rollout", samples=rng.permutation(7)[:batch].tolist(), txt_lens=lens,
                 img_grid=grid, branch=branch)
    eager, replayed = (Runtime(mode=mode, recorder=Recorder(level)) for _ in range(2))
    with replayed.scope(step=0, **scope), torch.no_grad():
        quiet, log = logging_runtime(replayed, level)
        model(x, txt, mask, tau, grid, quiet)
    records = ReplayRecords(log.calls, level)
    assert len(records) > 0 and not replayed.trace.entries()  # recording filed nothing
    for step, forwards in ((0, 1), (3, 2)):  # two forwards in one step: counters from a base
        sigma = float(rng.random())
        for rt in (eager, replayed):
            with rt.scope(step=step, sigma=sigma, **scope), torch.no_grad():
                _sampler_record(rt, x, 2)
                for _ in range(forwards):
                    if rt is eager:
                        model(x, txt, mask, tau, grid, rt)
                    else:
                        records.file(rt)
                    _sampler_record(rt, x, 3)
    for rt in (eager, replayed):
        rt.recorder.flush()
    got, want = replayed.recorder.ops_table(), eager.recorder.ops_table()
    assert got.num_rows == want.num_rows > 2 * len(records)
    assert got.equals(want), _first_difference(got, want)
    assert replayed.trace.rows() == eager.trace.rows()
    assert replayed._calls == eager._calls


def test_a_recorder_without_bulk_filing_gets_each_output(model):
    rng = np.random.default_rng()
    (x, txt, mask, tau, grid), lens = _inputs(rng, 3)
    scope = dict(phase="rollout", step=1, sigma=0.5, samples=[4, 0, 2], txt_lens=lens, img_grid=grid,
                 branch=("cond", "uncond", "uncond"))
    eager, replayed = Runtime(mode="strict", recorder=Recorder("L2")), Runtime(mode="strict",
                                                                              recorder=_OneByOne("L2"))
    with torch.no_grad():
        with replayed.scope(**scope):
            quiet, log = logging_runtime(replayed, "L2")
            model(x, txt, mask, tau, grid, quiet)
            ReplayRecords(log.calls, "L2").file(replayed)
        with eager.scope(**scope):
            model(x, txt, mask, tau, grid, eager)
    eager.recorder.flush()
    replayed.recorder.inner.flush()
    assert replayed.recorder.inner.ops_table().equals(eager.recorder.ops_table())
    assert replayed.trace.rows() == eager.trace.rows()


@pytest.mark.parametrize("bulk", [True, False])
def test_a_replay_files_its_own_scopes_sample_ids(model, bulk):
    """A forward recorded for samples [4, 0, 4] and filed in the scope of samples [9, 2, 9] (the
    same rows sharing a sample: a graph's signature) gives the eager records of the latter."""
    rng = np.random.default_rng()
    (x, txt, mask, tau, grid), lens = _inputs(rng, 3)
    scope = dict(phase="rollout", step=1, sigma=0.5, txt_lens=lens, img_grid=grid,
                 branch=("cond", "cond", "uncond"))
    make = (lambda: Recorder("L2")) if bulk else (lambda: _OneByOne("L2"))
    eager, replayed = Runtime(mode="strict", recorder=Recorder("L2")), Runtime(mode="strict", recorder=make())
    with torch.no_grad():
        with replayed.scope(samples=[4, 0, 4], **scope):
            quiet, log = logging_runtime(replayed, "L2")
            model(x, txt, mask, tau, grid, quiet)
        with replayed.scope(samples=[9, 2, 9], **scope):
            ReplayRecords(log.calls, "L2").file(replayed)
        with eager.scope(samples=[9, 2, 9], **scope):
            model(x, txt, mask, tau, grid, eager)
    eager.recorder.flush()
    got = replayed.recorder if bulk else replayed.recorder.inner
    got.flush()
    table = got.ops_table()
    assert set(table.column("sample").to_pylist()) - {-1} == {9, 2}
    assert table.equals(eager.recorder.ops_table()), _first_difference(table, eager.recorder.ops_table())


def test_the_signature_keeps_which_rows_share_a_sample_not_the_ids():
    from drifttool.model.graphs import sample_pattern, signature

    assert sample_pattern([7, 9, 7]) == sample_pattern([1, 0, 1]) == (0, 1, 0)
    assert sample_pattern([7, 9, 8]) == (0, 1, 2) and sample_pattern(None) is None
    x, txt, tau = torch.zeros(3, 6, 64), torch.zeros(3, 5, 8), torch.zeros(3)

    def key(samples):
        rt = Runtime(mode="strict")
        with rt.scope(samples=samples, txt_lens=[5, 4, 5], img_grid=(2, 3)):
            return signature(x, txt, None, tau, (2, 3), None, (), rt, "L1")

    assert key([7, 9, 7]) == key([1, 0, 1])
    assert key([7, 9, 7]) != key([7, 9, 8]) != key(None)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(-1, 1), st.sampled_from(["img", "txt"]),
                          st.integers(0, 1), st.sampled_from(["strict", "auto"]), st.booleans(),
                          st.sampled_from(["cpu", "cuda:0"]), st.sampled_from(["k1", "k2"])), max_size=12),
       st.integers(0, 2))
def test_counting_in_bulk_is_counting_one_by_one(calls, repeats):
    """``OperatorTrace.record_calls`` and ``Runtime.advance_counters`` leave what ``record`` and
    ``site`` leave call by call, also for a site whose backend, fallback or device changes."""
    one, bulk = OperatorTrace(), OperatorTrace()
    rt_one, rt_bulk = Runtime(mode="auto"), Runtime(mode="auto")
    for _ in range(repeats + 1):
        keys, fields = [], []
        for op, block, stream, call, actual, fallback, device, kernel in calls:
            kw = dict(contract="c", requested="auto", actual=actual, kernel=kernel,
                      fallback=fallback, reason="r" if fallback else "", declared=False, device=device)
            one.record(site={"op": op, "block": block, "stream": stream, "call": call, "rank": 0}, **kw)
            keys.append((0, "mmdit", op, block, stream, call))
            fields.append(kw)
            rt_one.site(op, stream, block=block)
        bulk.record_calls(keys, fields)
        suffixes = list(dict.fromkeys(k for op, block, stream, *_ in calls
                                      for k in ((block, op, stream), (block,))))
        rt_bulk.advance_counters(suffixes, [sum(1 for op, block, stream, *_ in calls
                                                if k in ((block, op, stream), (block,))) for k in suffixes])
    assert bulk.rows() == one.rows()
    assert rt_bulk._calls == rt_one._calls


def test_capture_records_refuses_columns_it_cannot_file():
    rec = Recorder("L1")
    shared = ("seq", "rank", *S.RANK_COLUMNS, "component", "phase", "step", "sigma")
    cols = {k: [] for k in S.OPS_SCHEMA.names if k not in shared}
    scope = {"phase": "rollout", "step": 0, "sigma": 0.5}
    with pytest.raises(ValueError, match="missing"):
        rec.capture_records(scope, {k: v for k, v in cols.items() if k != "branch"})
    with pytest.raises(ValueError, match=r"unknown \['sigma'\]"):
        rec.capture_records(scope, {**cols, "sigma": []})
    with pytest.raises(ValueError, match="different lengths"):
        rec.capture_records(scope, {**cols, "op": ["a"]})
    with pytest.raises(ValueError, match="unknown component"):
        rec.capture_records({**scope, "component": "encoder"}, cols)
    rec.capture_records(scope, cols)  # no records: nothing filed
    rec.flush()
    assert rec.ops_table().num_rows == 0


def _first_difference(got: pa.Table, want: pa.Table) -> str:
    for name in want.column_names:
        a, b = got[name].to_pylist(), want[name].to_pylist()
        for i, (u, v) in enumerate(zip(a, b)):
            if u != v and not (u != u and v != v):
                return f"column {name}, row {i}: {u!r} != {v!r}"
    return "schemas or lengths differ"
