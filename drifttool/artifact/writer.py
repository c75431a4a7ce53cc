"""Write a trajectory artifact directory step by step, from one process or from every rank of a
distributed run (layout: ``drifttool.artifact.schema``).

    with ArtifactWriter("runs/a", manifest={"fingerprint": fp, "settings": s}) as w:
        w.write_inputs({"x_T": x0, "noise": eps})
        for step in ...:
            w.write_ops(ops_batch)              # one record batch per step, flushed
            w.write_steps(steps_batch)
        w.write_trace(rt.trace.rows())
    # leaving the block normally closes with complete=true; an exception leaves complete=false

Every rank creates its own writer on the same directory (``torchrun``: each process runs the
block above). Rank ``r`` writes ``ops.rank<r>``, ``steps.rank<r>`` and ``trace.rank<r>``
(``.parquet`` once finished); rank 0 alone removes an earlier artifact, creates the directory and
writes ``manifest.json`` and ``inputs.safetensors``. A single process is rank 0 of world 1 and
writes the same names. Coordination goes through ``drifttool.collectives`` over
torch.distributed when a process group is initialised and is a no-op otherwise:

- opening: rank 0 creates the directory while the other ranks wait for its outcome (a
  broadcast), so no rank writes into a directory being removed and every rank raises if rank 0
  could not create it;
- one writer per directory: rank 0 takes an exclusive ``flock`` on the directory itself before
  it checks that it is empty (or removes an earlier run under ``overwrite``) and holds it until
  ``close`` (the OS drops it when the process dies). A second run given the same directory
  while the first writes fails at once with an ``ArtifactError`` that says another run holds
  it, so two runs never mix their files, with ``overwrite`` or without
  (``drifttool.artifact.directory``);
- closing (two-phase ``complete``): every rank closes its streams and reports whether it
  finished, its files, its copy of the manifest keys that describe the whole run
  (``SHARED_KEYS``) and a digest of its replay inputs (an all-gather); rank 0 writes the manifest
  with ``complete: true`` only if every rank finished and they all agree, then a barrier, so
  when ``close`` returns on any rank the manifest is final. A rank that raises closes with
  ``complete=false``: the manifest stays incomplete and every rank's finished batches readable.

``manifest.json`` is replaced atomically (temp file + rename): written with ``complete: false``
when the writer opens and rewritten with ``complete: true`` only after every stream of every rank
is closed, so a reader that sees ``complete: true`` may demand whole files. Op and step records
go to Arrow IPC streams (``<table>.rank<r>.arrows``), flushed after every batch (flushed to the
OS, not fsync'ed: a killed process keeps its finished steps, a power cut may not) before
``write_ops``/``write_steps`` return. Each batch also goes to the table's Parquet file, as a row
group of its temp file (``<table>.rank<r>.parquet.tmp``, ``artifact.parquet.ParquetFile``),
written on a thread of the writer's own (``artifact.background``) while the run goes on with its
next step; a batch that could not be written there is raised by the next write or by ``close``.
Closing waits for those writes. With ``complete=True`` it completes each Parquet file (footer,
fsync'ed, renamed to ``<table>.rank<r>.parquet``), removes the stream and records the file's
digest under the manifest's ``files.digests``, so a long run's records are not read and written
once more at its end; the trace is written as Parquet at once. A writer that closes with
``complete=False`` leaves its streams as they are and removes the Parquet temp files.
A rank killed outright never reaches the closing all-gather; the other ranks then wait for the
process group's timeout and raise, and the manifest stays ``complete: false``. Source: design.md, "Artifact"; review §3(b) item 4.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch
import xxhash
from safetensors.torch import save
from torch.distributed import ProcessGroup

from drifttool import collectives as C
from drifttool.artifact import schema as S
from drifttool.artifact.directory import atomic_write, claim, release
from drifttool.artifact.manifest import layout_problem
from drifttool.artifact.background import OrderedJobs
from drifttool.artifact.parquet import ParquetFile, file_digest, write_parquet
from drifttool.errors import ArtifactError, writing

SHARED_KEYS = ("kind", "capture_level", "fingerprint", "settings", "layout", "replay")
"""Manifest keys that describe the whole run: every rank's writer must hold the same value (or
none) when it closes, else the artifact is left incomplete (rank 0's manifest is the one
written; the other ranks' copies are only compared)."""


def _json(d: dict[str, Any]) -> str:
    try:
        return json.dumps(d, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"manifest is not JSON-serialisable: {e}") from None


def as_batch(columns: pa.RecordBatch | dict[str, Any], schema: pa.Schema) -> pa.RecordBatch:
    """A record batch of ``schema`` from a batch or a dict of columns.

    Raises:
        ValueError: the columns do not match ``schema`` (names or types).
    """
    if isinstance(columns, dict):
        missing = set(schema.names) - set(columns)
        extra = set(columns) - set(schema.names)
        if missing or extra:
            raise ValueError(f"columns do not match schema: missing {sorted(missing)}, "
                             f"unknown {sorted(extra)}")
        return pa.RecordBatch.from_pydict(columns, schema=schema)
    if not columns.schema.equals(schema, check_metadata=False):
        raise ValueError(f"record batch schema differs from {schema.metadata[b'drifttool.table']!r}"
                         f" schema:\n{columns.schema}")
    return columns.replace_schema_metadata(schema.metadata)


class _Stream:
    """One Arrow IPC stream file, flushed after every batch, and the table's Parquet file written
    beside it as the batches come (``ParquetFile``, on the writer's thread ``jobs``); once closed,
    ``finish`` completes the Parquet file and removes the stream, ``abandon`` removes the Parquet
    file's temp file."""

    def __init__(self, path: Path, schema: pa.Schema, jobs: OrderedJobs) -> None:
        self.path = path
        self.schema = schema
        with writing(path):  # Arrow's own file: written without holding the GIL
            self._file = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_stream(self._file, schema)
        self._parquet = ParquetFile(path.with_suffix(S.PARQUET), schema)
        self._jobs = jobs

    def write(self, batch: pa.RecordBatch) -> None:
        with writing(self.path):
            self._writer.write_batch(batch)
            self._file.flush()
        self._jobs.submit(self._parquet.write, batch)

    def close(self) -> None:
        """Close the stream; a second call does nothing (``ArtifactWriter.close(complete=False)``
        after a failed or interrupted ``close(complete=True)`` closes every stream again)."""
        if self._file.closed:
            return
        self._writer.close()  # writes the schema (if no batch came) and the end-of-stream marker
        self._file.close()

    def finish(self) -> Path:
        """Complete the Parquet file of the closed stream's batches (one row group per batch),
        remove the stream, and return the Parquet file's path."""
        done = self._parquet.finish()
        self.path.unlink()
        return done

    def abandon(self) -> None:
        """Remove the Parquet file being written (the stream stays: an incomplete run's)."""
        self._parquet.abandon()


def _check_rank_column(batch: pa.RecordBatch | pa.Table, rank: int, table: str) -> None:
    """Refuse records of another rank than the writer's (``rank`` column, where there is one)."""
    if "rank" in batch.schema.names and batch.num_rows and not pc.all(
            pc.equal(batch.column("rank"), rank)).as_py():
        raise ValueError(f"{table} records of rank(s) "
                         f"{sorted(set(batch.column('rank').to_pylist()) - {rank})} given to the "
                         f"writer of rank {rank} (each rank writes its own records)")


class ArtifactWriter:
    """Writer of one artifact directory, for this process's rank.

    Args:
        path: directory to create (the same on every rank). It must not exist or be empty,
            unless ``overwrite`` and it holds a ``manifest.json`` (an earlier artifact), which
            rank 0 then removes.
        manifest: run description (fingerprint, environment, settings, layout, ...), stored as
            given; must be JSON-serialisable. ``schema_version``, ``complete`` and ``files`` are
            set by the writer, and ``layout.world_size`` is the real number of ranks.
        overwrite: replace an earlier artifact at ``path``.
        layout: merged into the manifest's ``layout`` (e.g.
            ``drifttool.distributed.sample_parallel_layout(...)``); checked by
            ``manifest.layout_problem``.
        group: the process group of the ranks writing this artifact (``None``: the default
            group; without a process group this is rank 0 of world 1).

    Attributes:
        rank, world_size: this writer's rank in ``group`` and the number of ranks.

    Raises:
        ArtifactError: ``path`` is a file, a non-empty non-artifact directory, or exists without
            ``overwrite``; or it cannot be created or written (a parent is a file, permission
            denied, name too long). Raised on every rank (the others name rank 0).
        ValueError: the manifest is not JSON-serialisable, or the layout states another world
            size or is malformed (before any collective: raise it on every rank or none).
    """

    def __init__(self, path: str | os.PathLike, manifest: dict[str, Any] | None = None, *,
                 overwrite: bool = False, layout: dict[str, Any] | None = None,
                 group: ProcessGroup | None = None) -> None:
        self.path = Path(path)
        self.group = group
        self.rank = C.rank(group)
        self.world_size = C.world_size(group)
        _json(dict(manifest or {}))
        self._manifest: dict[str, Any] = dict(manifest or {})
        self._manifest["layout"] = self._layout(self._manifest.get("layout", {}), layout or {})
        _json(self._manifest)
        self._streams: dict[str, _Stream] = {}
        self._writes = OrderedJobs(name=f"drifttool-parquet-rank{self.rank}")  # the Parquet files' batches
        self._files: dict[str, Any] = {"inputs": None, "steps": [], "ops": [], "trace": [],
                                       "digests": {}}
        self._inputs_digest: str | None = None
        self.closed = False
        self._lock: int | None = None
        error = None
        if self.rank == 0:
            try:
                self._lock = claim(self.path, overwrite)
                self._write_manifest(complete=False)
            except ArtifactError as e:
                error = str(e)
            except OSError as e:
                error = f"cannot create the artifact directory {self.path}: {e.strerror or e}"
            if error is not None:
                self._unlock()
        error = C.broadcast_object(error, 0, group)  # the other ranks wait for rank 0 here
        if error is not None:
            raise ArtifactError(error if self.rank == 0 else f"{error} (reported by rank 0)")

    def _layout(self, *parts: Any) -> dict[str, Any]:
        """The ``parts`` merged, with the real world size. Raises ValueError (see the class)."""
        for part in parts:
            if not isinstance(part, dict):
                raise ValueError(f"layout must be a JSON object, got {part!r}")
        layout = {k: v for part in parts for k, v in part.items()}
        stated = layout.get("world_size", self.world_size)
        if stated != self.world_size:
            raise ValueError(f"layout.world_size is {stated!r} but {self.world_size} rank(s) "
                             "write this artifact")
        layout = {**layout, "world_size": self.world_size}
        problem = layout_problem(layout)
        if problem is not None:
            raise ValueError(f"layout: {problem}")
        return layout

    def _unlock(self) -> None:
        release(self._lock)
        self._lock = None

    # -- manifest ------------------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]:
        """A copy of the manifest as last written (rank 0) or held (other ranks)."""
        return json.loads(json.dumps(self._manifest))

    def update_manifest(self, **fields: Any) -> None:
        """Merge ``fields`` into the manifest and, on rank 0, rewrite it (still
        ``complete: false``). Other ranks keep their copy, compared at ``close`` (``SHARED_KEYS``).

        Raises:
            ValueError: ``fields`` are not JSON-serialisable, or a ``layout`` as the class says.
        """
        self._check_open()
        _json(fields)
        if "layout" in fields:
            fields = {**fields, "layout": self._layout(fields["layout"])}
        self._manifest.update(fields)
        self._write_manifest(complete=False)

    def _write_manifest(self, *, complete: bool) -> None:
        self._manifest.update(schema_version=S.SCHEMA_VERSION, complete=complete,
                              files=self._files)
        if self.rank == 0:
            atomic_write(self.path / S.MANIFEST, _json(self._manifest).encode())

    # -- data ----------------------------------------------------------------------------------
    def write_inputs(self, tensors: dict[str, torch.Tensor]) -> None:
        """Store the replay inputs (initial latents, SDE noise, prompt embeddings, masks of the
        whole batch) as ``inputs.safetensors`` (atomically; a second call replaces the first).

        Every rank passes the same tensors: rank 0 writes them, the others' are compared at
        ``close`` (a digest of the serialised bytes).
        """
        self._check_open()
        host = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
        data = save(host, metadata={"schema_version": str(S.SCHEMA_VERSION)})
        self._inputs_digest = xxhash.xxh3_64_hexdigest(data)
        self._files["inputs"] = S.INPUTS
        if self.rank == 0:
            # bytes, then the same temp file + rename as the manifest: mode follows the umask
            # like every other artifact file (safetensors' save_file creates its file 0600)
            atomic_write(self.path / S.INPUTS, data)
        self._write_manifest(complete=False)

    def write_ops(self, batch: pa.RecordBatch | dict[str, Any], *, rank: int | None = None) -> None:
        """Append one batch of this rank's op records (``OPS_SCHEMA``) to ``ops.rank<r>.arrows``
        (and, on the writer's thread, to its Parquet file: module docstring).

        Args:
            rank: if given, must be this writer's rank (the recorder names its rank).

        Raises:
            ValueError: the columns do not match ``OPS_SCHEMA``, or records (or ``rank``) of
                another rank.
            OSError: the batch could not be written, or an earlier batch not to the Parquet
                file (naming the file).
        """
        self._check_open()
        if rank is not None and rank != self.rank:
            raise ValueError(f"op records of rank {rank} given to the writer of rank {self.rank}")
        batch = as_batch(batch, S.OPS_SCHEMA)
        _check_rank_column(batch, self.rank, "op")
        self._stream("ops").write(batch)

    def write_steps(self, batch: pa.RecordBatch | dict[str, Any]) -> None:
        """Append one batch of this rank's step records (``STEPS_SCHEMA``) to
        ``steps.rank<r>.arrows`` (as ``write_ops``).

        Raises:
            ValueError: the columns do not match ``STEPS_SCHEMA``, or records of another rank.
            OSError: the batch could not be written, or an earlier batch not to the Parquet
                file (naming the file).
        """
        self._check_open()
        batch = as_batch(batch, S.STEPS_SCHEMA)
        _check_rank_column(batch, self.rank, "step")
        self._stream("steps").write(batch)

    def _stream(self, table: str) -> _Stream:
        """This rank's stream of ``table``, opened (and listed) on first use."""
        if table not in self._streams:
            name = S.rank_file(table, self.rank, S.STREAM)
            self._streams[table] = _Stream(self.path / name, S.SCHEMAS[table], self._writes)
            self._files[table] = [name]
            self._write_manifest(complete=False)
        return self._streams[table]

    def write_trace(self, rows: list[dict[str, Any]]) -> None:
        """Store this rank's operator trace (``OperatorTrace.rows()``) as
        ``trace.rank<r>.parquet`` (atomically; a second call replaces the first).

        Each row's ``rank`` (the trace schema's owning rank) must be this writer's.

        Raises:
            ValueError: a row has keys outside ``TRACE_SCHEMA`` (and ``rank``), or is of another
                rank.
        """
        self._check_open()
        names = set(S.TRACE_SCHEMA.names)
        for row in rows:
            if set(row) - names:
                raise ValueError(f"trace row has unknown keys {sorted(set(row) - names)}")
        table = pa.Table.from_pylist(rows, schema=S.TRACE_SCHEMA)
        _check_rank_column(table, self.rank, "trace")
        path = self.path / S.trace_file(self.rank)
        write_parquet(path, table.to_batches(), S.TRACE_SCHEMA)
        self._files["trace"] = [path.name]
        self._files["digests"][path.name] = file_digest(path)
        self._write_manifest(complete=False)

    # -- end -----------------------------------------------------------------------------------
    def close(self, complete: bool, **fields: Any) -> None:
        """Close this rank's streams, then (every rank together) write the manifest with
        ``complete`` and ``fields`` merged.

        ``complete=True`` also creates an empty steps file if this rank wrote no step, and turns
        this rank's streams into Parquet files (``_Stream.finish``). The
        manifest says ``complete: true`` only if every rank closed with ``complete=True`` and
        they agree on ``SHARED_KEYS`` and the replay inputs. Every rank must call ``close``
        (the ``with`` block does, also on an exception). A second call does nothing.

        Raises:
            ValueError: ``fields`` are not JSON-serialisable (nothing is closed then).
            ArtifactError: ``complete=True`` here but the artifact was left incomplete (another
                rank failed, or the ranks disagree; the message says which).
        """
        if self.closed:
            return
        _json(fields)
        failed = self._writes.stop()  # every batch in its Parquet file (or the first failure)
        if failed is not None and complete:
            raise failed  # the caller closes again with complete=False
        if complete:
            self._stream("steps")
        for s in self._streams.values():
            s.close()
        for table, s in self._streams.items():
            if complete:
                done = s.finish()
                self._files[table] = [done.name]
                self._files["digests"][done.name] = file_digest(done)
            else:
                s.abandon()
        self.closed = True
        self._manifest.update(fields)
        mine = {"complete": complete, "files": self._files, "inputs": self._inputs_digest,
                "shared": {k: self._manifest.get(k) for k in SHARED_KEYS}}
        reports = C.all_gather_object(mine, self.group)
        failed = [r for r, rep in enumerate(reports) if not rep["complete"]]
        problem = (f"rank(s) {failed} did not finish" if failed
                   else _disagreement(reports))
        if self.rank == 0:
            self._files = {"inputs": self._files["inputs"],
                           **{t: sorted(n for rep in reports for n in rep["files"][t])
                              for t in S.RANK_TABLES},
                           "digests": dict(sorted((n, d) for rep in reports
                                                  for n, d in rep["files"]["digests"].items()))}
            self._write_manifest(complete=complete and problem is None)
        C.barrier(self.group)  # the manifest is final once close returns on any rank
        self._unlock()
        if complete and problem is not None:
            raise ArtifactError(f"{self.path}: left incomplete: {problem}")

    def _check_open(self) -> None:
        if self.closed:
            raise ArtifactError(f"artifact writer for {self.path} is closed")

    def __enter__(self) -> "ArtifactWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)


def _disagreement(reports: list[dict[str, Any]]) -> str | None:
    """The first way the ranks' closing reports disagree with rank 0's (a ``SHARED_KEYS`` value
    or the replay inputs' digest), or ``None``."""
    first = reports[0]
    for r, rep in enumerate(reports[1:], start=1):
        for key in SHARED_KEYS:
            if rep["shared"][key] != first["shared"][key]:
                return f"rank {r}'s manifest {key!r} differs from rank 0's"
        if rep["inputs"] != first["inputs"]:
            return f"rank {r}'s replay inputs differ from rank 0's"
    return None
