"""The reader's Parquet path (``pyarrow._parquet.ParquetReader`` over the memory-mapped file,
``drifttool.artifact.parquet``) reads what ``pyarrow.parquet.ParquetFile`` reads: the same Arrow
schema (field and schema metadata included), the same row groups byte for byte, the same
footer accounting; and a damaged page is refused by its checksum as before. Files are fresh
random tables of awkward sizes written by ``write_parquet``."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from drifttool.artifact import parquet as P
from drifttool.errors import ArtifactError

SCHEMA = pa.schema([pa.field("step", pa.int32(), metadata={b"k": b"v"}),
                    pa.field("digest", pa.uint64()), pa.field("x", pa.float32()),
                    pa.field("data", pa.binary()), pa.field("shape", pa.list_(pa.int64()))],
                   metadata={b"drifttool.table": b"steps"})


def _batches(rng, sizes):
    for n in sizes:
        yield pa.RecordBatch.from_pydict({
            "step": rng.integers(-5, 5, n).astype(np.int32),
            "digest": rng.integers(0, 2**63, n).astype(np.uint64) * 2 + 1,
            "x": np.where(rng.random(n) < 0.2, np.float32(-0.0), rng.standard_normal(n).astype(np.float32)),
            "data": [rng.bytes(int(k)) for k in rng.integers(0, 40, n)],
            "shape": [list(rng.integers(1, 9, int(k))) for k in rng.integers(0, 4, n)]}, schema=SCHEMA)


@pytest.mark.parametrize("sizes", [(1,), (7, 0, 3), (1000, 1, 65)])
def test_reads_what_pyarrow_parquet_reads(tmp_path, sizes):
    path = tmp_path / "steps.rank0.parquet"
    P.write_parquet(path, _batches(np.random.default_rng(), sizes), SCHEMA)
    ours, theirs = P._open(path), pq.ParquetFile(str(path), page_checksum_verification=True)
    assert isinstance(ours, P._ParquetFile)
    assert ours.schema_arrow.equals(theirs.schema_arrow, check_metadata=True)
    assert ours.num_row_groups == theirs.num_row_groups == sum(1 for n in sizes if n)
    for i in range(ours.num_row_groups):
        a, b = ours.read_row_group(i), theirs.read_row_group(i)
        assert a.equals(b) and a.schema.equals(b.schema, check_metadata=True)
        for col in ("digest", "x"):
            assert a[col].to_numpy().tobytes() == b[col].to_numpy().tobytes()
    assert P.unaccounted_bytes(ours, path.stat().st_size) == 0
    assert P.parquet_schema(path).equals(SCHEMA, check_metadata=True)


def test_a_damaged_page_is_refused(tmp_path):
    path = tmp_path / "steps.rank0.parquet"
    P.write_parquet(path, _batches(np.random.default_rng(), (500,)), SCHEMA)
    raw = bytearray(path.read_bytes())
    raw[200] ^= 0xFF  # inside the first column chunk's data page
    path.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="row group 0 is corrupt|not a readable Parquet"):
        list(P.row_groups(path))
    path.write_bytes(b"PAR1 not parquet")
    with pytest.raises(ArtifactError, match="not a readable Parquet file"):
        P.parquet_schema(path)
