"""The digest's cached key tables grow by replacement; the table a CUDA graph captured reads must
outlive the growth (the graph reads it at its address at every replay), so a replaced table is
kept alive. Checked off a GPU with weak references; ``tests/gpu/test_cuda_graphs.py`` replays a
graph across a growth."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from drifttool.capture import digest_rows, gpu_rows


@pytest.mark.parametrize("kernel,wbytes", [(1, 2), (2, 2), (2, 4)])
def test_a_grown_row_key_table_keeps_the_old_one(monkeypatch, kernel, wbytes):
    monkeypatch.setattr(gpu_rows, "_TABLES", {})
    monkeypatch.setattr(gpu_rows, "_RETIRED", [])
    cpu = torch.device("cpu")
    old = gpu_rows._key_table(kernel, cpu, 300, wbytes)
    assert gpu_rows._key_table(kernel, cpu, 4000, wbytes) is old  # fits: the same table
    ref = weakref.ref(old)
    new = gpu_rows._key_table(kernel, cpu, 4097, wbytes)
    del old
    gc.collect()
    assert new is not ref() and ref() is not None, "the replaced key table was freed"


@pytest.mark.parametrize("kind", ["row", "col"])
def test_a_grown_digest_key_table_keeps_the_old_one(monkeypatch, kind):
    monkeypatch.setattr(digest_rows, "_TABLES", {})
    monkeypatch.setattr(digest_rows, "_RETIRED", [])
    cpu = torch.device("cpu")
    old = digest_rows.key_table(kind, 17, cpu)
    ref = weakref.ref(old)
    new = digest_rows.key_table(kind, old.shape[-1] + 1, cpu)
    del old
    gc.collect()
    assert new is not ref() and ref() is not None, "the replaced key table was freed"
