"""Read a trajectory artifact directory (layout: ``drifttool.artifact.schema``).

    >>> run = open_run("runs/a")
    >>> run.complete, run.manifest["capture_level"], run.ops_table().num_rows
    (True, 'L1', 123456)
    >>> run.problems                      # for an incomplete run: what was cut short
    ['ops.rank0.arrow: truncated after 7 complete batches (...)']

Arrow files are read batch by batch from a memory map (columns the caller never touches are
never paged in). A run whose manifest says ``complete: false`` may end in a cut batch or lack a
file: the finished batches are returned and the cut is listed in ``Run.problems``. A run that
says ``complete: true`` must be whole; anything else raises ``ArtifactError``.
Source: design.md, "Artifact".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from safetensors import SafetensorError

from drifttool.artifact import schema as S
from drifttool.artifact.raw import RawTensor, read_raw
from drifttool.errors import ArtifactError

if TYPE_CHECKING:
    import torch

_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # IPC end-of-stream marker written by close()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the artifact at ``path``, checked for a supported schema version.

    Raises:
        ArtifactError: ``path`` is not a directory, the manifest is missing, not JSON, not an
            object, or of a schema version this reader does not support.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ArtifactError(f"{path}: is a file, not an artifact directory")
    if not path.is_dir():
        raise ArtifactError(f"{path}: no such artifact directory")
    mpath = path / S.MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{path}: missing {S.MANIFEST} (not an artifact, or the run never "
                            "started)")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{mpath}: corrupt manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{mpath}: corrupt manifest (not a JSON object)")
    version = manifest.get("schema_version")
    if version not in S.SUPPORTED_SCHEMA_VERSIONS:
        raise ArtifactError(f"{mpath}: schema_version {version!r} is not supported by this "
                            f"drifttool (supports {sorted(S.SUPPORTED_SCHEMA_VERSIONS)})")
    if not isinstance(manifest.get("complete"), bool):
        raise ArtifactError(f"{mpath}: corrupt manifest ('complete' is not true/false)")
    _check_manifest_shape(mpath, manifest)
    return manifest


def _plain_name(x: Any) -> bool:
    return isinstance(x, str) and x == Path(x).name and x not in ("", ".", "..")


def _check_manifest_shape(mpath: Path, m: dict[str, Any]) -> None:
    """Refuse manifests whose structure was damaged by hand: wrong types, or file entries that
    are not plain names inside the run directory (no ``..``, no paths to other runs)."""
    for key in ("fingerprint", "settings", "environment", "layout", "replay"):
        if key in m and not isinstance(m[key], dict):
            raise ArtifactError(f"{mpath}: corrupt manifest ({key!r} is not an object)")
    fp = m.get("fingerprint")
    if isinstance(fp, dict) and "arch" in fp and not isinstance(fp["arch"], dict):
        raise ArtifactError(f"{mpath}: corrupt manifest ('fingerprint.arch' is not an object)")
    files = m.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{mpath}: corrupt manifest ('files' is not an object)")
    for key in ("inputs", "steps", "trace"):
        if files.get(key) is not None and not _plain_name(files[key]):
            raise ArtifactError(f"{mpath}: corrupt manifest (files.{key}={files[key]!r} is not a "
                                "file name inside the run directory)")
    ops = files.get("ops", [])
    if not isinstance(ops, list) or not all(_plain_name(o) for o in ops):
        raise ArtifactError(f"{mpath}: corrupt manifest (files.ops={ops!r} must list file names "
                            "inside the run directory)")


def read_stream(path: Path, schema: pa.Schema, *, complete: bool) -> tuple[pa.Table, str | None]:
    """All complete record batches of the IPC stream at ``path``, and a note if it was cut.

    Args:
        complete: the run's manifest flag; when true, a cut or unclosed stream is an error.

    Returns:
        ``(table, problem)``: ``problem`` is ``None`` for a whole stream.

    Raises:
        ArtifactError: the file is not an Arrow stream of ``schema`` at a supported schema
            version, or (``complete``) it is cut short or was never closed.
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
            raise ArtifactError(f"{path}: not a readable Arrow IPC stream ({e})") from None
        return empty, f"{name}: unreadable header, no batch recovered ({e})"
    version = S.schema_version_of(reader.schema)
    if version not in S.SUPPORTED_SCHEMA_VERSIONS:
        raise ArtifactError(f"{path}: schema_version {version!r} is not supported "
                            f"(supports {sorted(S.SUPPORTED_SCHEMA_VERSIONS)})")
    if not reader.schema.equals(schema, check_metadata=False):
        raise ArtifactError(f"{path}: columns differ from schema version {version}:\n"
                            f"{reader.schema}")
    batches, problem = [], None
    while True:
        try:
            batches.append(reader.read_next_batch())
        except StopIteration:
            break
        except (pa.ArrowException, OSError) as e:
            problem = f"{name}: truncated after {len(batches)} complete batches ({e})"
            break
    if problem is None:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - len(_EOS)))
            if f.read() != _EOS:
                problem = f"{name}: stream not closed after {len(batches)} batches"
    if problem and complete:
        raise ArtifactError(f"{path}: corrupt file in a complete run: {problem}")
    return pa.Table.from_batches(batches, schema=reader.schema), problem


class Run:
    """An opened artifact. Tables are read on first use and cached.

    Attributes:
        path: the directory. manifest: the parsed ``manifest.json``.
        complete: the manifest's ``complete`` flag.
        schema_version: the manifest's schema version.
        problems: what was found cut short or missing (filled as files are read; ``check()``
            reads all of them). Always empty for a complete run (that raises instead).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.complete: bool = self.manifest["complete"]
        self.schema_version: int = self.manifest["schema_version"]
        self.problems: list[str] = []
        self._cache: dict[str, Any] = {}

    @property
    def capture_level(self) -> str | None:
        """``"L0"``/``"L1"``/``"L2"`` as the recorder wrote it, ``None`` if absent."""
        return self.manifest.get("capture_level")

    def _listed(self, kind: str) -> list[str]:
        """Files of ``kind`` the manifest lists, or (incomplete run) the ones on disk."""
        files = self.manifest.get("files") or {}
        listed = files.get(kind)
        listed = [] if listed is None else [listed] if isinstance(listed, str) else list(listed)
        if self.complete:
            for name in listed:
                if not (self.path / name).is_file():
                    raise ArtifactError(f"{self.path}: complete run lacks {name}")
            return listed
        if kind == "ops":
            return sorted(p.name for p in self.path.glob("ops.rank*.arrow"))
        default = {"steps": S.STEPS, "trace": S.TRACE, "inputs": S.INPUTS}[kind]
        return [default] if (self.path / default).is_file() else []

    def _table(self, kind: str, name: str, schema: pa.Schema) -> pa.Table:
        key = f"{kind}:{name}"
        if key not in self._cache:
            table, problem = read_stream(self.path / name, schema, complete=self.complete)
            if problem:
                self.problems.append(problem)
            self._cache[key] = table
        return self._cache[key]

    def ops_table(self, rank: int | None = None) -> pa.Table:
        """Op records (``OPS_SCHEMA``) of every rank (or of ``rank``), in file order.

        Raises:
            ArtifactError: a file is unreadable, or cut short in a complete run.
        """
        names = self._listed("ops")
        if rank is not None:
            names = [n for n in names if n == S.ops_file(rank)]
        tables = [self._table("ops", n, S.OPS_SCHEMA) for n in names]
        return pa.concat_tables(tables) if tables else S.OPS_SCHEMA.empty_table()

    def steps_table(self) -> pa.Table:
        """Step records (``STEPS_SCHEMA``); empty if none were written (incomplete run)."""
        names = self._listed("steps")
        return self._table("steps", names[0], S.STEPS_SCHEMA) if names else (
            S.STEPS_SCHEMA.empty_table())

    def trace_rows(self) -> list[dict[str, Any]]:
        """The operator trace rows (``TRACE_SCHEMA``), ``[]`` if none was written."""
        names = self._listed("trace")
        if not names:
            return []
        return self._table("trace", names[0], S.TRACE_SCHEMA).to_pylist()

    def inputs(self) -> dict[str, torch.Tensor]:
        """The replay inputs, ``{}`` if none were written.

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
            raise ArtifactError(f"{self.path / names[0]}: corrupt safetensors ({e})") from None

    def raw_inputs(self) -> dict[str, RawTensor]:
        """The replay inputs as dtype + bytes, read without torch (``drifttool.artifact.raw``);
        ``{}`` if none were written.

        Raises:
            ArtifactError: ``inputs.safetensors`` is corrupt.
        """
        names = self._listed("inputs")
        return read_raw(self.path / names[0]) if names else {}

    def check(self) -> list[str]:
        """Read every Arrow file once; return ``problems`` (raises as the readers do)."""
        self.ops_table()
        self.steps_table()
        self.trace_rows()
        return list(self.problems)

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, complete={self.complete}, level={self.capture_level})"


def open_run(path: str | os.PathLike) -> Run:
    """Open the artifact directory at ``path`` (reads and checks the manifest only).

    Raises:
        ArtifactError: missing directory, missing or corrupt manifest, unsupported schema version.
    """
    return Run(path)
