"""Read and rewrite an artifact's table files with plain pyarrow, whatever their format, the way a
hand edit or another tool would; and turn a run into the stream format of schema versions 3
and 4.

    t = read_table(run / "ops.rank0.parquet")
    rewrite_table(run / "ops.rank0.parquet", lambda t: t.slice(1))   # digest re-recorded
    to_streams(run, version=4)                                       # ops.rank0.arrow, ...

A Parquet file is rewritten with the writer's options and its digest re-recorded in the
manifest (a consistent edit: what the reader's checks of the records must catch); a stream is
rewritten as a stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from drifttool.artifact import schema as S
from drifttool.artifact.parquet import WRITE_OPTIONS, compression, file_digest


def read_table(path: Path) -> pa.Table:
    """The table in the Parquet file or Arrow IPC stream ``path`` (no checks)."""
    if path.suffix == S.PARQUET:
        return pq.read_table(path)
    with pa.OSFile(str(path)) as f:
        return pa.ipc.open_stream(f).read_all()


def batches(path: Path) -> list[pa.Table]:
    """The file's row groups (Parquet) or record batches (stream), in order."""
    if path.suffix == S.PARQUET:
        pf = pq.ParquetFile(path)
        return [pf.read_row_group(i) for i in range(pf.num_row_groups)]
    with pa.OSFile(str(path)) as f:
        return [pa.Table.from_batches([b]) for b in pa.ipc.open_stream(f)]


def write_batches(path: Path, parts: list[pa.Table], schema: pa.Schema | None = None) -> None:
    """Replace ``path`` by ``parts`` (one row group or batch each) in the file's own format;
    a Parquet file's digest is re-recorded in the manifest beside it."""
    schema = schema or (parts[0].schema if parts else read_table(path).schema)
    if path.suffix == S.PARQUET:
        # Parquet stores no null in a required column: an edit that puts one there declares the
        # column nullable (what another tool writing the file would do)
        nulls = {f.name for part in parts for f, col in zip(part.schema, part.columns)
                 if col.null_count}
        schema = pa.schema([f.with_nullable(True) if f.name in nulls else f for f in schema],
                           metadata=schema.metadata)
        with pq.ParquetWriter(path, schema, compression=compression(schema), **WRITE_OPTIONS) as w:
            for part in parts:
                w.write_table(part.cast(schema))
        manifest = path.parent / S.MANIFEST
        m = json.loads(manifest.read_text())
        if path.name in m["files"].get("digests", {}):
            m["files"]["digests"][path.name] = file_digest(path)
            manifest.write_text(json.dumps(m))
        return
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, schema) as w:
        for part in parts:
            w.write_table(part)


def rewrite_table(path: Path, edit: Callable[[pa.Table], pa.Table], *,
                  schema: pa.Schema | None = None) -> None:
    """Replace the table in ``path`` by ``edit(table)`` (``write_batches``: one row group)."""
    table = edit(read_table(path))
    write_batches(path, [table], schema or table.schema)


def rewrite_batches(path: Path, keep: Callable[[list[pa.Table]], list[pa.Table]]) -> None:
    """Replace the row groups (batches) of ``path`` by ``keep(them)``."""
    write_batches(path, keep(batches(path)), read_table(path).schema)


def to_streams(run: Path, version: int) -> None:
    """Rewrite the finished run ``run`` as schema ``version`` (3 or 4) wrote it: every table an
    Arrow IPC stream ``<table>.rank<r>.arrow`` whose metadata says ``version`` (version 3: the op
    records without the rank columns), no ``files.digests``."""
    m = json.loads((run / S.MANIFEST).read_text())
    for table in S.RANK_TABLES:
        names = []
        for name in m["files"][table]:
            t = read_table(run / name)
            if version == 3 and table == "ops":
                t = t.drop_columns(list(S.RANK_COLUMNS))
            t = t.replace_schema_metadata({**t.schema.metadata,
                                           b"drifttool.schema_version": str(version).encode()})
            legacy = name.replace(S.PARQUET, S.LEGACY_STREAM)
            with pa.OSFile(str(run / legacy), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
                w.write_table(t)
            (run / name).unlink()
            names.append(legacy)
        m["files"][table] = names
    m["files"].pop("digests", None)
    m["schema_version"] = version
    (run / S.MANIFEST).write_text(json.dumps(m))
