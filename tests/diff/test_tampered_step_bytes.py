"""Step records whose stored bytes no longer match their digest are refused, naming the file
that holds them: the rank's finished Parquet table or, for a run that stopped early, its
stream (``steps.rank<r>.arrows``)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from drifttool.artifact import open_run
from drifttool.diff import diff_runs
from drifttool.errors import ArtifactError
from tests.artifact.table_files import rewrite_table


def _flip_data_of_row(row: int):
    def edit(t: pa.Table) -> pa.Table:
        data = t.column("data").to_pylist()
        b = bytearray(data[row])
        b[len(b) // 2] ^= 0x40  # one bit of one value; the digest is left as it was
        data[row] = bytes(b)
        i = t.schema.get_field_index("data")
        return t.set_column(i, t.schema.field("data"), pa.array(data, type=t.schema.field("data").type))
    return edit


def test_tampered_record_of_rank_1_names_that_ranks_parquet_file(make_run):
    good = make_run("good", owners={0: 0, 1: 1})
    bad = make_run("bad", owners={0: 0, 1: 1})
    rewrite_table(bad / "steps.rank1.parquet", _flip_data_of_row(2))  # its digest re-recorded
    with pytest.raises(ArtifactError) as e:
        diff_runs(open_run(good), open_run(bad))
    assert str(e.value).startswith(f"{bad / 'steps.rank1.parquet'}: the bytes of step "), e.value
    assert "do not match their digest" in str(e.value)


def test_garbage_in_the_stream_of_an_incomplete_run_names_the_stream(make_run):
    good = make_run("good", crash_after=2)
    bad = make_run("bad", crash_after=2)
    stream = bad / "steps.rank0.arrows"
    assert stream.is_file() and not (bad / "steps.rank0.parquet").exists()
    buf = pa.py_buffer(stream.read_bytes())
    first = pa.ipc.open_stream(pa.BufferReader(buf)).read_next_batch()
    values = first.column("data").buffers()[2]  # the stored bytes of the batch's records
    assert values.size > 140
    with open(stream, "r+b") as f:  # 100 bytes of garbage inside the records' bytes
        f.seek(values.address - buf.address + 20)
        f.write(bytes(range(7, 107)))
    with pytest.raises(ArtifactError) as e:
        diff_runs(open_run(good), open_run(bad))
    assert str(e.value).startswith(f"{stream}: the bytes of step 0 "), e.value


def test_table_file_names_what_the_reader_reads(make_run):
    done = open_run(make_run("done", owners={0: 0, 1: 1}))
    assert done.table_file("steps", 1) == done.path / "steps.rank1.parquet"
    assert done.table_file("ops", 0) == done.path / "ops.rank0.parquet"
    cut = open_run(make_run("cut", crash_after=1))
    assert cut.table_file("steps", 0) == cut.path / "steps.rank0.arrows"
    with pytest.raises(ArtifactError, match="no steps file of rank 3"):
        done.table_file("steps", 3)
