"""The finished tables of an artifact as Parquet files: written as the run goes, made whole when
the writer closes, and read whole.

    write_parquet(Path("runs/a/ops.rank0.parquet"), batches, OPS_SCHEMA)   # one row group each
    out = ParquetFile(Path("runs/a/ops.rank0.parquet"), OPS_SCHEMA)       # or a batch at a time:
    out.write(batch); ...; out.finish()                                    # the same bytes
    schema = parquet_schema(Path("runs/a/ops.rank0.parquet"))              # the Arrow schema
    for i, table in row_groups(Path("runs/a/ops.rank0.parquet")): ...       # checked by the reader

Why Parquet: DuckDB reads it natively (it reads no Arrow IPC file without a network extension),
and so do Polars (lazily, ``scan_parquet``) and pyarrow (``pyarrow.parquet``, ``pyarrow.dataset``).
The Arrow schema is stored in the file (``store_schema``), so the column types, the field
metadata and ``drifttool.schema_version`` come back as written, and every value's bytes are kept
(NaN payloads, −0.0, uint64 digests). A Parquet file opens only once its footer is written: the
writer streams while a run writes, writes each batch to the Parquet file's temp file beside the
stream, and completes it at close (``drifttool.artifact.writer``).

Damage is refused, never read as data. The manifest of a finished run records every Parquet
file's ``file_digest``, and the reader compares it before pyarrow parses a byte: a damaged
footer can abort the process inside pyarrow's Parquet reader (an uncaught C++ exception, not a
Python error), so a file is parsed only once its bytes are known to be the ones written. Every
page also carries a CRC-32 that the reader verifies, a file whose footer does not account for
every byte (``unaccounted_bytes``) is refused, and pyarrow's errors become ``ArtifactError``.

Start-up: the reader opens a file with pyarrow's own Parquet reader, ``pyarrow._parquet.
ParquetReader`` (what ``pyarrow.parquet.ParquetFile`` wraps, given the memory-mapped file and the
same options), because importing ``pyarrow.parquet`` imports ``pyarrow.fs`` and with it the S3,
GCS, Azure and HDFS filesystems and ``ssl``: 0.1–0.2 s of a ``drifttool diff`` that reads local
files only (docs/benchmarks.md, "CLI start-up"). Where that class is missing or opens otherwise
(a pyarrow that changed it), ``pyarrow.parquet.ParquetFile`` is used. ``pyarrow.parquet`` is
imported on first write.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import pyarrow as pa
import xxhash

from drifttool.artifact.manifest import brief
from drifttool.errors import ArtifactError, writing

if TYPE_CHECKING:
    import pyarrow.parquet as pq

WRITE_OPTIONS = {"write_page_checksum": True, "store_schema": True, "use_compliant_nested_type": False}
"""``pyarrow.parquet.ParquetWriter`` options besides the codecs (``compression``): a CRC-32 per
page (``page_checksum_verification`` on read), the Arrow schema stored in the footer, and list
items named ``item`` as in the Arrow schema (so the schema reads back equal)."""

UNCOMPRESSED = frozenset({"digest", "row_digests", "rank_digests"})
"""Columns of uniformly random 64-bit digests: zstd cannot shrink them, and at L2 (a row digest
per token row) compressing them took about twice as long as writing them."""


def compression(schema: pa.Schema) -> dict[str, str]:
    """Each column's codec: zstd (every reader above decodes it), none for ``UNCOMPRESSED``."""
    return {name: "NONE" if name in UNCOMPRESSED else "ZSTD" for name in schema.names}

_MAGIC = b"PAR1"


def write_parquet(path: Path, batches: Iterable[pa.RecordBatch], schema: pa.Schema) -> None:
    """Write ``batches`` (each non-empty one a row group) as the Parquet file ``path``,
    atomically (``ParquetFile``).

    Raises:
        OSError: the file cannot be written (the temp file is removed).
    """
    out = ParquetFile(path, schema)
    try:
        for batch in batches:
            out.write(batch)
    except BaseException:
        out.abandon()
        raise
    out.finish()


class ParquetFile:
    """The Parquet file ``path`` written a batch at a time (each non-empty batch a row group) to
    ``<name>.tmp``, which ``finish`` completes (footer, flushed, fsync'ed) and renames to
    ``path``: the bytes ``write_parquet`` writes of the same batches. Until then ``path`` does not
    exist; ``abandon`` removes the temp file.

    Raises (``write``, ``finish``):
        OSError: the file cannot be written, naming ``path`` (``errors.writing``); ``finish``
            removes the temp file then.
    """

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path = path
        self.schema = schema
        self._tmp = path.with_name(path.name + ".tmp")
        self._file: Any = None
        self._writer: Any = None

    def _open(self) -> Any:
        if self._writer is None:
            import pyarrow.parquet as pq  # lazy: see the module docstring

            with writing(self.path):  # Arrow's own file: written without the GIL
                self._file = pa.OSFile(str(self._tmp), "wb")
                self._writer = pq.ParquetWriter(self._file, self.schema, compression=compression(self.schema),
                                                **WRITE_OPTIONS)
        return self._writer

    def write(self, batch: pa.RecordBatch) -> None:
        """Append ``batch`` as a row group (nothing for an empty batch)."""
        if batch.num_rows:
            writer = self._open()
            with writing(self.path):
                writer.write_batch(batch)

    def finish(self) -> Path:
        """Complete the file and rename it to ``path``; returns ``path``."""
        try:
            writer = self._open()
            with writing(self.path):
                writer.close()
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abandon()
            raise
        return self.path

    def abandon(self) -> None:
        """Close and remove the temp file (nothing if it was never opened or is finished)."""
        for close in (getattr(self._writer, "close", None), getattr(self._file, "close", None)):
            try:
                if close is not None:
                    close()
            except Exception:  # noqa: BLE001 - the file goes anyway
                pass
        self._tmp.unlink(missing_ok=True)


def file_digest(path: Path) -> str:
    """xxh3_128 (hex) of the bytes of the file ``path``, as the manifest records it (hashed
    through a memory map: no copy of the file in memory; a 1.2 GB file in 0.16 s instead of
    0.8 s read whole)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # an empty file cannot be mapped
            return xxhash.xxh3_128_hexdigest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return xxhash.xxh3_128_hexdigest(view)


class _ParquetFile:
    """The part of ``pq.ParquetFile`` the reader uses (``metadata``, ``schema_arrow``,
    ``num_row_groups``, ``read_row_group``), on ``pyarrow._parquet.ParquetReader`` over the
    memory-mapped file, page checksums verified (module docstring: why)."""

    def __init__(self, reader_class, path: Path) -> None:
        self._source = pa.memory_map(str(path))
        self.reader = reader_class()
        self.reader.open(self._source, page_checksum_verification=True)

    @property
    def metadata(self):
        return self.reader.metadata

    @property
    def schema_arrow(self) -> pa.Schema:
        return self.reader.schema_arrow

    @property
    def num_row_groups(self) -> int:
        return self.reader.num_row_groups

    def read_row_group(self, i: int) -> pa.Table:
        return self.reader.read_row_group(i)


def _reader_class():
    """``pyarrow._parquet.ParquetReader``, or None where this pyarrow has none."""
    try:
        from pyarrow._parquet import ParquetReader
    except ImportError:  # pragma: no cover - every pyarrow this package supports has it
        return None
    return ParquetReader


def _open(path: Path) -> "pq.ParquetFile | _ParquetFile":
    """``path`` opened with page checksums verified. Raises ArtifactError if it does not open."""
    try:
        cls = _reader_class()
        if cls is not None:
            try:
                return _ParquetFile(cls, path)
            except TypeError:  # pragma: no cover - a pyarrow whose reader opens otherwise
                pass
        import pyarrow.parquet as pq  # lazy: see the module docstring

        return pq.ParquetFile(str(path), memory_map=True, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as e:
        raise ArtifactError(f"{path}: not a readable Parquet file ({brief(e)})") from None


def parquet_schema(path: Path) -> pa.Schema:
    """The Arrow schema stored in the Parquet file ``path`` (its metadata included).

    Raises:
        ArtifactError: not a readable Parquet file, or bytes its footer does not account for.
    """
    pf = _open(path)
    extra = unaccounted_bytes(pf, path.stat().st_size)
    if extra:
        raise ArtifactError(f"{path}: {extra} bytes that its Parquet footer does not account for "
                            "(appended or inserted)")
    return pf.schema_arrow


def unaccounted_bytes(pf: "pq.ParquetFile | _ParquetFile", size: int) -> int:
    """Bytes of a ``size``-byte file that are neither its magic numbers, nor a column chunk, nor
    its footer (0 for a file as ``write_parquet`` writes it)."""
    meta = pf.metadata
    chunks = sum(meta.row_group(i).column(j).total_compressed_size
                 for i in range(meta.num_row_groups) for j in range(meta.num_columns))
    return size - (2 * len(_MAGIC) + chunks + meta.serialized_size + 4)


def row_groups(path: Path) -> Iterator[tuple[int, pa.Table]]:
    """``(index, table)`` of every row group of the Parquet file ``path``, in order.

    Raises:
        ArtifactError: the file does not open, or a row group is damaged (a page checksum, a
            length or an encoding pyarrow refuses).
    """
    pf = _open(path)
    for i in range(pf.num_row_groups):
        try:
            yield i, pf.read_row_group(i)
        except (pa.ArrowException, OSError) as e:
            raise ArtifactError(f"{path}: row group {i} is corrupt ({brief(e)})") from None
