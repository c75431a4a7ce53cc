"""Read a trajectory artifact directory (layout: ``drifttool.artifact.schema``).

    >>> run = open_run("runs/a")
    >>> run.complete, run.world_size, run.manifest["capture_level"], run.ops_table().num_rows
    (True, 2, 'L1', 123456)
    >>> run.steps_table()["rank"]          # every rank's records, the owning rank a column
    >>> run.problems                      # for an incomplete run: what was cut short
    ['ops.rank0.arrows: truncated after 7 complete batches (...)']

Each rank ``r`` of ``layout.world_size`` wrote its own ``ops``/``steps``/``trace.rank<r>`` files
(``drifttool.artifact.writer``); the tables concatenate them rank by rank, the owning rank a
column. A single-process run is rank 0 of world 1. A finished table is a Parquet file
(``read_parquet``: its digest compared with the manifest's first, then every row group checked);
a table whose process died while writing it, and every table of schema versions 3 and 4, is an
Arrow IPC stream, read batch by batch from a memory map (``read_stream``). A run whose manifest
says ``complete: false`` may end in a cut batch or lack a file: the finished batches are
returned and the cut is listed in ``Run.problems``. A run that says ``complete: true`` must be
whole; anything else raises ``ArtifactError``. Opening a run checks its manifest
(``drifttool.artifact.manifest``), its directory and replay inputs; every batch is checked as it
is read, and ``Run.check`` (which ``diff``, ``replay`` and ``recompute`` call) reads every file
(``drifttool.artifact.checks``, ``drifttool.artifact.coverage``).

This module does not import torch (``Run.inputs`` does, when called).
Source: design.md, "Artifact".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from safetensors import SafetensorError

from drifttool.artifact import compute as ac
from drifttool.artifact import schema as S
from drifttool.artifact.checks import (check_batch, check_directory, check_inputs,
                                       check_records_match_manifest, check_sigmas,
                                       check_unique_seq, schema_differences)
from drifttool.artifact.coverage import check_named_samples, check_owning_ranks, check_traced_ranks
from drifttool.artifact.directory import being_written
from drifttool.artifact.manifest import brief, read_manifest, world_size
from drifttool.artifact.parquet import file_digest, parquet_schema, row_groups
from drifttool.artifact.raw import RawTensor
from drifttool.errors import ArtifactError

if TYPE_CHECKING:
    import torch

_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # IPC end-of-stream marker written by close()


def _table_schema(path: Path, got: pa.Schema, want: pa.Schema) -> tuple[pa.Schema, bool]:
    """Check the schema ``got`` of the table file ``path`` against ``want``: a supported schema
    version that files of its suffix hold (``schema.suffix_fits``) and the same columns. Returns
    the schema to read it with and whether it is a version 3 op table (``_upgrade`` it).

    Raises:
        ArtifactError: naming the file and what differs.
    """
    version = S.schema_version_of(got)
    problem = S.version_problem(version)
    if problem:
        raise ArtifactError(f"{path}: {problem}")
    suffix = S.parse_rank_file(path.name)[2]
    if not S.suffix_fits(suffix, version):
        raise ArtifactError(f"{path}: holds a schema_version {version} table, which drifttool "
                            f"never writes as a {suffix} file")
    upgrade = version == 3 and want.equals(S.OPS_SCHEMA, check_metadata=False)
    if upgrade:  # version 3 op records: the rank columns read as null (not checked on every rank)
        want = S.OPS_SCHEMA_V3
    if not got.equals(want, check_metadata=False):
        raise ArtifactError(f"{path}: columns differ from schema version {version}: "
                            f"{schema_differences(got, want)}")
    return want, upgrade


def _upgrade(table: pa.Table) -> pa.Table:
    """A version 3 op table with version 4's rank columns, null (not checked on every rank)."""
    for name in S.RANK_COLUMNS:
        field = S.OPS_SCHEMA.field(name)
        table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table.replace_schema_metadata(S.OPS_SCHEMA.metadata)


def read_parquet(path: Path, schema: pa.Schema, *, digest: str | None) -> pa.Table:
    """The finished table at ``path`` (a Parquet file, ``drifttool.artifact.parquet``), every row
    group checked (``check_batch``).

    Args:
        digest: the file's digest as the manifest records it (``files.digests``), compared
            before the file is parsed; ``None`` where the manifest records none (an incomplete
            run whose process died after writing the file).

    Raises:
        ArtifactError: other bytes than the digest's, not a Parquet file of ``schema`` at a
            supported schema version, or a damaged row group.
    """
    if digest is not None and file_digest(path) != digest:
        raise ArtifactError(f"{path}: its bytes differ from the digest the manifest records "
                            "(a damaged or replaced file)")
    _table_schema(path, parquet_schema(path), schema)
    ops = schema.metadata[b"drifttool.table"] == b"ops"
    groups = []
    for i, group in row_groups(path):
        check_batch(path, i, group, ops=ops)
        groups.append(group)
    return pa.concat_tables(groups) if groups else schema.empty_table()


def _header_bytes(schema: pa.Schema) -> int:
    """Bytes of an IPC stream header (the schema message) for ``schema``: the writer writes it
    whole when it opens the stream, so a crash can cut a stream inside its header only while
    the file is shorter than that."""
    sink = pa.BufferOutputStream()
    pa.ipc.new_stream(sink, schema).close()
    return sink.getvalue().size - len(_EOS)


def read_stream(path: Path, schema: pa.Schema, *, complete: bool) -> tuple[pa.Table, str | None]:
    """All complete record batches of the IPC stream at ``path``, and a note if it was cut.

    Args:
        complete: the run's manifest flag; when true, a cut or unclosed stream is an error.

    Returns:
        ``(table, problem)``: ``problem`` is ``None`` for a whole stream.

    Raises:
        ArtifactError: the file is not an Arrow stream of ``schema`` at a supported schema
            version, a batch is damaged (``check_batch``), bytes follow the end-of-stream marker,
            an unreadable header in a file of at least twice a header's size (corrupt: a cut
            stream is shorter), or (``complete``) it is cut short or was never closed.
    """
    name = path.name
    empty = schema.empty_table()
    if path.stat().st_size == 0:
        if complete:
            raise ArtifactError(f"{path}: empty file in a complete run")
        return empty, f"{name}: empty (no batch written)"
    try:
        source = pa.memory_map(str(path))
        reader = pa.ipc.open_stream(source)
    except (pa.ArrowException, OSError) as e:
        if complete:
            raise ArtifactError(f"{path}: not a readable Arrow IPC stream ({brief(e)})") from None
        if path.stat().st_size >= 2 * _header_bytes(schema):  # the header was written whole, then damaged
            raise ArtifactError(f"{path}: its stream header is damaged ({brief(e)}), though the file "
                                "holds more than a header: corrupt, not cut short") from None
        return empty, f"{name}: unreadable header, no batch recovered ({brief(e)})"
    schema, upgrade = _table_schema(path, reader.schema, schema)
    batches, problem = [], None
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            break
        except (pa.ArrowException, OSError) as e:
            n = len(batches)
            problem = f"{name}: truncated after {n} complete batch{'es' if n != 1 else ''} ({brief(e)})"
            break
        check_batch(path, len(batches), batch, ops=schema.metadata[b"drifttool.table"] == b"ops")
        batches.append(batch)
    if problem is None:
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(max(0, size - len(_EOS)))
            closed = f.read() == _EOS
        if source.tell() != size:
            raise ArtifactError(f"{path}: {size - source.tell()} bytes after the end-of-stream "
                                "marker (not part of the stream)")
        if not closed:
            problem = f"{name}: stream not closed after {len(batches)} batches"
    if problem and complete:
        raise ArtifactError(f"{path}: corrupt file in a complete run: {problem}")
    table = pa.Table.from_batches(batches, schema=reader.schema)
    return (_upgrade(table) if upgrade else table), problem


class Run:
    """An opened artifact. Tables are read on first use and cached.

    Opening checks the manifest (``read_manifest``), the directory (``check_directory``) and the
    replay inputs (``check_inputs``); every record batch is checked as it is read
    (``check_batch``).

    Attributes:
        path: the directory. manifest: the parsed ``manifest.json``.
        complete: the manifest's ``complete`` flag.
        schema_version: the manifest's schema version.
        problems: what was found cut short or missing (filled as files are read; ``check()``
            reads all of them). Always empty for a complete run (that raises instead).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if being_written(self.path):
            raise ArtifactError(f"{self.path}: a drifttool run is writing it now (its steps are "
                                "not all there yet); read it once that run has finished or stopped")
        self.manifest = read_manifest(self.path)
        check_directory(self.path, self.manifest)
        self._raw_inputs = check_inputs(self.path, self.manifest)
        self.complete: bool = self.manifest["complete"]
        self.schema_version: int = self.manifest["schema_version"]
        self.problems: list[str] = []
        self._cache: dict[str, Any] = {}

    @property
    def capture_level(self) -> str | None:
        """``"L0"``/``"L1"``/``"L2"`` as the recorder wrote it, ``None`` if absent."""
        return self.manifest.get("capture_level")

    @property
    def world_size(self) -> int:
        """The number of ranks that wrote the run (``layout.world_size``, 1 without a layout)."""
        return world_size(self.manifest)

    def _listed(self, kind: str) -> list[str]:
        """Files of ``kind`` the manifest lists, or (incomplete run) the ones on disk; per-rank
        tables in rank order, one file per rank (of an incomplete run: the finished Parquet file
        where the process got that far, else the stream)."""
        if kind == "inputs":
            name = self.manifest["files"].get("inputs")
            if self.complete:
                return [name] if name else []
            return [S.INPUTS] if (self.path / S.INPUTS).is_file() else []
        names = (self.manifest["files"][kind] if self.complete  # check_directory: all there
                 else [p.name for p in self.path.iterdir() if S.RANK_FILE.fullmatch(p.name)])
        best: dict[int, str] = {}
        for name in names:
            table, rank, suffix = S.parse_rank_file(name)
            if table == kind and (rank not in best or suffix == S.PARQUET):
                best[rank] = name
        return [best[r] for r in sorted(best)]

    def table_file(self, kind: str, rank: int) -> Path:
        """The file rank ``rank``'s records of ``kind`` (``ops``, ``steps``, ``trace``) are read
        from: ``<kind>.rank<r>.parquet``, or the stream (``.arrows``, ``.arrow``) of a run that
        stopped before it finished the table (``_listed``'s choice).

        Raises:
            ArtifactError: the run holds no such file.
        """
        for name in self._listed(kind):
            if S.parse_rank_file(name)[1] == rank:
                return self.path / name
        raise ArtifactError(f"{self.path}: no {kind} file of rank {rank}")

    def _table(self, kind: str, name: str, schema: pa.Schema) -> pa.Table:
        key = f"{kind}:{name}"
        if key not in self._cache:
            path = self.path / name
            if name.endswith(S.PARQUET):
                digest = self.manifest["files"].get("digests", {}).get(name)
                table, problem = read_parquet(path, schema, digest=digest), None
            else:
                table, problem = read_stream(path, schema, complete=self.complete)
            rank = S.parse_rank_file(name)[1]
            if "rank" in table.column_names:
                if table.num_rows and not ac.call("all", ac.call("equal", table["rank"], rank)).as_py():
                    raise ArtifactError(f"{path}: holds records of another rank than "
                                        f"{rank} (a renamed or copied file)")
            else:  # the owning rank is the file's
                table = table.append_column(pa.field("rank", pa.int32(), nullable=False),
                                            pa.array([rank] * table.num_rows, pa.int32()))
            if "seq" in table.column_names:
                check_unique_seq(path, table)
            if problem:
                self.problems.append(problem)
            self._cache[key] = table
        return self._cache[key]

    def _tables(self, kind: str, rank: int | None) -> pa.Table:
        """Every rank's (or ``rank``'s) records of ``kind`` as one table, ranks in order."""
        names = self._listed(kind)
        if rank is not None:
            names = [n for n in names if S.parse_rank_file(n)[1] == rank]
        tables = [self._table(kind, n, S.SCHEMAS[kind]) for n in names]
        if tables:
            return pa.concat_tables(tables)
        empty = S.SCHEMAS[kind].empty_table()
        if "rank" not in empty.column_names:
            empty = empty.append_column(pa.field("rank", pa.int32(), nullable=False),
                                        pa.array([], pa.int32()))
        return empty

    def ops_table(self, rank: int | None = None) -> pa.Table:
        """Op records (``OPS_SCHEMA``) of every rank (or of ``rank``), rank by rank in file order.

        Raises:
            ArtifactError: a file is unreadable, or cut short in a complete run.
        """
        return self._tables("ops", rank)

    def steps_table(self, rank: int | None = None) -> pa.Table:
        """Step records (``STEPS_SCHEMA``) of every rank (or of ``rank``), rank by rank; empty if
        none were written (incomplete run).

        Raises:
            ArtifactError: a file is unreadable, or cut short in a complete run.
        """
        return self._tables("steps", rank)

    def trace_rows(self, rank: int | None = None) -> list[dict[str, Any]]:
        """The operator trace rows (``TRACE_SCHEMA``) of every rank (or of ``rank``), each with
        its owning ``rank``; ``[]`` if none was written."""
        return self._tables("trace", rank).to_pylist()

    def inputs(self) -> dict[str, torch.Tensor]:
        """The replay inputs as torch tensors (checked at open, ``check_inputs``), ``{}`` if none
        were written. Imports torch.

        Raises:
            ArtifactError: ``inputs.safetensors`` is corrupt.
        """
        from safetensors.torch import load_file  # torch only here: diff and trace run without it

        names = self._listed("inputs")
        if not names:
            return {}
        try:
            return load_file(str(self.path / names[0]))
        except (SafetensorError, OSError, ValueError) as e:
            raise ArtifactError(f"{self.path / names[0]}: corrupt safetensors "
                                f"({brief(e)})") from None

    def raw_inputs(self) -> dict[str, RawTensor]:
        """The replay inputs as dtype + bytes, read without torch (``drifttool.artifact.raw``) and
        checked when the run was opened (``check_inputs``); ``{}`` if none were written."""
        return self._raw_inputs  # read and checked at open

    def check(self) -> list[str]:
        """Read every Arrow file once, check that its steps carry one sigma each
        (``check_sigmas``) and that the records are what the manifest says
        (``check_records_match_manifest``), of the samples it names (``check_named_samples``)
        and ranks its layout gives them (``check_owning_ranks``, ``check_traced_ranks``); return
        ``problems`` (raises as the readers do)."""
        steps, ops = self.steps_table(), self.ops_table()
        check_sigmas(self.path, steps, ops)
        check_records_match_manifest(self.path, self.manifest, steps, ops)
        check_named_samples(self.path, self.manifest, steps, ops)
        check_owning_ranks(self.path, self.manifest, steps, ops)
        check_traced_ranks(self.path, self.manifest, steps, self.trace_rows())
        return list(self.problems)

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, complete={self.complete}, level={self.capture_level})"


def open_run(path: str | os.PathLike) -> Run:
    """Open the artifact directory at ``path``: checks the manifest, the directory's entries and
    the replay inputs (Arrow files are read and checked on first use).

    Raises:
        ArtifactError: missing directory, a run writing it now (``directory.being_written``),
            missing or corrupt manifest, unsupported schema version, an entry the manifest does
            not account for, damaged replay inputs.
    """
    return Run(path)
