"""The hand-over of row tables from producing kernels to captures (``capture.produced``), on CPU
tensors: a table stands for its output's flat ``[rows, C]`` view only (the view a capture
digests), only while the output is alive and unwritten since (its version counter, shared by its
views), and is never taken for a later tensor at the same address; the registry's mark is on
only inside a marked call and when the hand-over is enabled; a table that cannot fit its output
is refused."""

from __future__ import annotations

import gc

import pytest
import torch

from drifttool.capture import produced


def _table(rows: int, splits: int = 2):
    return torch.zeros(splits, rows, 2, dtype=torch.int64), torch.zeros(splits, rows, 4, dtype=torch.float64)


def test_a_table_stands_for_the_flat_view_of_its_output():
    out = torch.randn(2, 5, 12)
    table = _table(10)
    produced.offer(out, table)
    assert produced.table(out.view(10, 12)) is table
    assert produced.table(out.view(-1, 12)) is table
    assert produced.table(out.view(5, 24)) is None       # other rows
    assert produced.table(out.view(10, 12)[:, :6]) is None  # a strided part
    assert produced.table(out.view(10, 12)[1:]) is None     # another address


def test_a_write_through_torch_makes_the_table_stale():
    out = torch.randn(4, 8)
    produced.offer(out, _table(4))
    view = out.view(4, 8)
    out[0, 0] = 1.0
    assert produced.table(view) is None
    assert produced.table(out) is None


def test_the_entry_goes_with_its_output():
    out = torch.randn(6, 16)
    key = produced._identity(out)
    produced.offer(out, _table(6))
    assert key in produced._TABLES
    del out
    gc.collect()
    assert key not in produced._TABLES


def test_a_table_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        produced.offer(torch.randn(5, 8), _table(3))
    with pytest.raises(ValueError, match="strided"):
        produced.offer(torch.randn(8, 5).t(), _table(5))


def test_the_mark_holds_inside_a_marked_call_while_enabled(monkeypatch):
    assert not produced.wanted()
    token = produced.producing(True)
    try:
        assert produced.wanted()
        monkeypatch.setattr(produced, "ENABLED", False)
        assert not produced.wanted()
        monkeypatch.setattr(produced, "ENABLED", True)
        inner = produced.producing(False)  # a nested call that is not captured
        assert not produced.wanted()
        produced.done(inner)
        assert produced.wanted()
    finally:
        produced.done(token)
    assert not produced.wanted()


def test_a_tensor_moved_to_other_storage_is_not_taken_for_its_old_bytes():
    out = torch.randn(4, 8)
    old = out.view(4, 8)
    produced.offer(out, _table(4))
    out.data = torch.randn(4, 8)  # the tensor lives on; its bytes moved
    assert produced.table(old) is None


def test_inference_tensors_are_not_handed_over():
    token = produced.producing(True)
    try:
        with torch.inference_mode():
            assert not produced.wanted()  # no version counter to tell a later write
            out = torch.randn(3, 4)
            produced.offer(out, _table(3))  # no error, no entry
            assert produced.table(out) is None
    finally:
        produced.done(token)
