"""Write a trajectory artifact directory step by step (layout: ``drifttool.artifact.schema``).

    with ArtifactWriter("runs/a", manifest={"fingerprint": fp, "settings": s}) as w:
        w.write_inputs({"x_T": x0, "noise": eps})
        for step in ...:
            w.write_ops(ops_batch, rank=0)      # one record batch per step, flushed
            w.write_steps(steps_batch)
        w.write_trace(rt.trace.rows())
    # leaving the block normally closes with complete=true; an exception leaves complete=false

``manifest.json`` is replaced atomically (temp file + rename): written with ``complete: false``
when the writer opens and rewritten with ``complete: true`` only after every stream is closed,
so a reader that sees ``complete: true`` may demand whole files. Arrow files are IPC streams,
flushed after every batch (flushed to the OS, not fsync'ed: a killed process keeps its finished
steps, a power cut may not). Source: design.md, "Artifact".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import torch
from safetensors.torch import save

from drifttool.artifact import schema as S
from drifttool.errors import ArtifactError


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    """One Arrow IPC stream file, flushed after every batch."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path = path
        self.schema = schema
        self._file: BinaryIO = open(path, "wb")
        self._writer = pa.ipc.new_stream(self._file, schema)

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch)
        self._file.flush()

    def close(self) -> None:
        self._writer.close()  # writes the schema (if no batch came) and the end-of-stream marker
        self._file.close()


def _remove_artifact(path: Path) -> None:
    """Delete an earlier artifact at ``path`` — only if everything there is drifttool's own.

    Raises:
        ArtifactError: no drifttool manifest there, or files that no artifact writes (user
            files are never deleted).
    """
    try:
        manifest = json.loads((path / S.MANIFEST).read_text())
        ours = isinstance(manifest, dict) and "schema_version" in manifest and "files" in manifest
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise ArtifactError(f"{path} is not empty and holds no drifttool run; refusing to overwrite")
    own = {S.MANIFEST, S.INPUTS, S.STEPS, S.TRACE}
    foreign = sorted(p.name for p in path.iterdir()
                     if not (p.is_file() and (p.name in own or p.name.startswith("ops.rank")
                                              or p.name.endswith(".tmp"))))
    if foreign:
        raise ArtifactError(f"{path}: refusing to overwrite: it also holds {', '.join(foreign[:5])}"
                            " (not written by drifttool)")
    for p in path.iterdir():
        p.unlink()


class ArtifactWriter:
    """Writer of one artifact directory.

    Args:
        path: directory to create. It must not exist or be empty, unless ``overwrite`` and it
            holds a ``manifest.json`` (an earlier artifact), which is then removed.
        manifest: run description (fingerprint, environment, settings, ...), stored as given;
            must be JSON-serialisable. ``schema_version``, ``complete`` and ``files`` are set by
            the writer.

    Raises:
        ArtifactError: ``path`` is a file, a non-empty non-artifact directory, or exists without
            ``overwrite``; or it cannot be created or written (a parent is a file, permission
            denied, name too long).
    """

    def __init__(self, path: str | os.PathLike, manifest: dict[str, Any] | None = None, *,
                 overwrite: bool = False) -> None:
        self.path = Path(path)
        _json(dict(manifest or {}))
        self._manifest: dict[str, Any] = dict(manifest or {})
        self._ops: dict[int, _Stream] = {}
        self._steps: _Stream | None = None
        self._files: dict[str, Any] = {"inputs": None, "steps": None, "ops": [], "trace": None}
        self.closed = False
        try:
            self._create(overwrite)
            self._write_manifest(complete=False)
        except OSError as e:
            raise ArtifactError(f"cannot create the artifact directory {self.path}: "
                                f"{e.strerror or e}") from None

    def _create(self, overwrite: bool) -> None:
        existing = next((p for p in (self.path, *self.path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():  # the path itself or a parent
            raise ArtifactError(f"{existing} exists and is not a directory"
                                + ("" if existing == self.path else f" (creating {self.path})"))
        if existing == self.path and any(self.path.iterdir()):
            if not overwrite:
                raise ArtifactError(f"{self.path} is not empty (use --overwrite to replace an "
                                    "earlier drifttool run there)")
            _remove_artifact(self.path)
        self.path.mkdir(parents=True, exist_ok=True)

    # -- manifest ------------------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]:
        """A copy of the manifest as last written."""
        return json.loads(json.dumps(self._manifest))

    def update_manifest(self, **fields: Any) -> None:
        """Merge ``fields`` into the manifest and rewrite it (still ``complete: false``)."""
        self._check_open()
        _json(fields)
        self._manifest.update(fields)
        self._write_manifest(complete=False)

    def _write_manifest(self, *, complete: bool) -> None:
        self._manifest.update(schema_version=S.SCHEMA_VERSION, complete=complete,
                              files=self._files)
        _atomic_write(self.path / S.MANIFEST, _json(self._manifest).encode())

    # -- data ----------------------------------------------------------------------------------
    def write_inputs(self, tensors: dict[str, torch.Tensor]) -> None:
        """Store the replay inputs (initial latents, SDE noise, prompt embeddings, masks) as
        ``inputs.safetensors`` (atomically; a second call replaces the first)."""
        self._check_open()
        host = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
        # bytes, then the same temp file + rename as the manifest: mode follows the umask like
        # every other artifact file (safetensors' save_file creates its file 0600)
        _atomic_write(self.path / S.INPUTS, save(host, metadata={"schema_version": str(S.SCHEMA_VERSION)}))
        self._files["inputs"] = S.INPUTS
        self._write_manifest(complete=False)

    def write_ops(self, batch: pa.RecordBatch | dict[str, Any], *, rank: int) -> None:
        """Append one batch of op records (``OPS_SCHEMA``) to ``ops.rank<rank>.arrow``.

        Raises:
            ValueError: the columns do not match ``OPS_SCHEMA``.
        """
        self._check_open()
        batch = as_batch(batch, S.OPS_SCHEMA)
        if rank not in self._ops:
            name = S.ops_file(rank)
            self._ops[rank] = _Stream(self.path / name, S.OPS_SCHEMA)
            self._files["ops"] = sorted([*self._files["ops"], name])
            self._write_manifest(complete=False)
        self._ops[rank].write(batch)

    def write_steps(self, batch: pa.RecordBatch | dict[str, Any]) -> None:
        """Append one batch of step records (``STEPS_SCHEMA``) to ``steps.arrow``.

        Raises:
            ValueError: the columns do not match ``STEPS_SCHEMA``.
        """
        self._check_open()
        batch = as_batch(batch, S.STEPS_SCHEMA)
        self._open_steps()
        self._steps.write(batch)

    def _open_steps(self) -> None:
        if self._steps is None:
            self._steps = _Stream(self.path / S.STEPS, S.STEPS_SCHEMA)
            self._files["steps"] = S.STEPS
            self._write_manifest(complete=False)

    def write_trace(self, rows: list[dict[str, Any]]) -> None:
        """Store the operator trace (``OperatorTrace.rows()``) as ``trace.arrow`` (one batch).

        Raises:
            ValueError: a row has keys outside ``TRACE_SCHEMA``.
        """
        self._check_open()
        names = set(S.TRACE_SCHEMA.names)
        for row in rows:
            if set(row) - names:
                raise ValueError(f"trace row has unknown keys {sorted(set(row) - names)}")
        table = pa.Table.from_pylist(rows, schema=S.TRACE_SCHEMA)
        tmp = self.path / (S.TRACE + ".tmp")
        with open(tmp, "wb") as f, pa.ipc.new_stream(f, S.TRACE_SCHEMA) as w:
            w.write_table(table)
        os.replace(tmp, self.path / S.TRACE)
        self._files["trace"] = S.TRACE
        self._write_manifest(complete=False)

    # -- end -----------------------------------------------------------------------------------
    def close(self, complete: bool, **fields: Any) -> None:
        """Close every stream, then write the manifest with ``complete`` and ``fields`` merged.

        ``complete=True`` also creates an empty ``steps.arrow`` if no step was written. A second
        call does nothing.

        Raises:
            ValueError: ``fields`` are not JSON-serialisable (nothing is closed then).
        """
        if self.closed:
            return
        _json(fields)
        if complete:
            self._open_steps()
        for s in [*self._ops.values(), *([self._steps] if self._steps else [])]:
            s.close()
        self.closed = True
        self._manifest.update(fields)
        self._write_manifest(complete=complete)

    def _check_open(self) -> None:
        if self.closed:
            raise ArtifactError(f"artifact writer for {self.path} is closed")

    def __enter__(self) -> "ArtifactWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)
