"""Read a trajectory artifact directory (layout: ``drifttool.artifact.schema``).

    >>> run = open_run("runs/a")
    >>> run.complete, run.manifest["capture_level"], run.ops_table().num_rows
    (True, 'L1', 123456)
    >>> run.problems                      # for an incomplete run: what was cut short
    ['ops.rank0.arrow: truncated after 7 complete batches (...)']

Arrow files are read batch by batch from a memory map. A run whose manifest says
``complete: false`` may end in a cut batch or lack a file: the finished batches are returned and
the cut is listed in ``Run.problems``. A run that says ``complete: true`` must be whole; anything
else raises ``ArtifactError``.

Damage is refused, never ignored (issue #8, "damaged artifacts"): every entry of the run directory
must be a regular file that the manifest accounts for (``check_directory``); the manifest must be
plain JSON that ``schema.MANIFEST_SCHEMA`` accounts for, every key known, every required key
present, every value of its type and enumeration (``read_manifest``); every record batch passes pyarrow's full
validation (corrupt lengths or offsets would otherwise crash the process), has no null in a
non-nullable column and a finite ``sigma``/``sigma_next`` (``check_batch``); each
``ops.rank<r>.arrow`` holds rank ``r`` only; and every replay input is re-hashed against the
manifest's ``replay.input_digests`` and must be finite (``check_inputs``); ``Run.check`` (which
``diff``, ``replay`` and ``recompute`` call) reads every file and checks that each step carries one
sigma (``check_sigmas``) and that the records are what the manifest's ``capture_level`` and
``kind`` say (``check_records_match_manifest``).

This module does not import torch (``Run.inputs`` does, when called).
Source: design.md, "Artifact".
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from safetensors import SafetensorError

from drifttool.artifact import schema as S
from drifttool.artifact.raw import RawTensor, read_raw
from drifttool.errors import ArtifactError

if TYPE_CHECKING:
    import torch

_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # IPC end-of-stream marker written by close()
MAX_MANIFEST_DEPTH = 32
"""Deepest nesting of objects/arrays accepted in ``manifest.json`` (drifttool's own manifests
nest a few levels; the diff walks them recursively)."""


def _brief(e: BaseException) -> str:
    """An exception's message on one line, at most 200 characters (error messages are one line)."""
    return " ".join(str(e).split())[:200]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (non-finite number)")


def _finite_float(text: str) -> float:
    x = float(text)
    if x in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:20]} overflows to a non-finite number")
    return x


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _depth(x: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion on hostile input)."""
    deepest, todo = 0, [(x, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_MANIFEST_DEPTH:
                todo += [(c, d + 1) for c in (v.values() if isinstance(v, dict) else v)]
    return deepest


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the artifact at ``path``, checked for a supported schema version.

    Raises:
        ArtifactError: ``path`` is not a directory, the manifest is missing, not a regular file,
            not strict JSON (NaN/Infinity, duplicate keys, integers beyond Python's digit limit,
            nesting deeper than ``MAX_MANIFEST_DEPTH``), not an object, of a schema version (an
            ``int``) this reader does not support, or not what ``schema.MANIFEST_SCHEMA``
            describes (``_check_manifest_shape``; the message names the key path).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ArtifactError(f"{path}: is a file, not an artifact directory")
    if not path.is_dir():
        raise ArtifactError(f"{path}: no such artifact directory")
    mpath = path / S.MANIFEST
    try:
        mode = mpath.lstat().st_mode
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing {S.MANIFEST} (not an artifact, or the run never "
                            "started)") from None
    if not stat.S_ISREG(mode):
        raise ArtifactError(f"{mpath}: not a regular file (links and special files are refused)")
    try:
        manifest = json.loads(mpath.read_bytes(), parse_constant=_reject_constant,
                              parse_float=_finite_float, object_pairs_hook=_unique_keys)
    except (OSError, ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError, bad UTF-8 and the int digit limit
        raise ArtifactError(f"{mpath}: corrupt manifest ({type(e).__name__}: "
                            f"{_brief(e)})") from None
    if _depth(manifest) > MAX_MANIFEST_DEPTH:
        raise ArtifactError(f"{mpath}: corrupt manifest (nested deeper than "
                            f"{MAX_MANIFEST_DEPTH} levels)")
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{mpath}: corrupt manifest (not a JSON object)")
    version = manifest.get("schema_version")
    if type(version) is not int:
        raise ArtifactError(f"{mpath}: schema_version must be an integer, got {version!r}")
    if version not in S.SUPPORTED_SCHEMA_VERSIONS:
        raise ArtifactError(f"{mpath}: schema_version {version!r} is not supported by this "
                            f"drifttool (supports {sorted(S.SUPPORTED_SCHEMA_VERSIONS)})")
    _check_manifest_shape(mpath, manifest)
    return manifest


_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object", type(None): "null"}


def check_manifest_value(where: str, value: Any, spec: Any) -> str | None:
    """The first way ``value`` (at dotted key path ``where``) departs from ``spec`` (a
    ``drifttool.artifact.schema`` manifest spec), or ``None``. Iterative over objects and
    arrays (no recursion on hostile input)."""
    todo = [(where, value, spec)]
    while todo:
        at, v, sp = todo.pop()
        if sp is S.ANY:
            continue
        if isinstance(sp, S.Nullable):
            if v is not None:
                todo.append((at, v, sp.spec))
        elif isinstance(sp, S.Enum):
            if type(v) is not str or v not in sp.values:
                return f"{at} {v!r} is not one of {', '.join(map(str, sp.values))}"
        elif type(sp) is tuple:  # JSON types (a plain tuple, not one of the NamedTuple specs)
            if type(v) not in sp and not (type(v) is int and float in sp):
                return (f"{at} is {_JSON_TYPES[type(v)]}, not "
                        f"{' or '.join(_JSON_TYPES[t] for t in sp)}")
        elif isinstance(sp, S.ListOf):
            if type(v) is not list:
                return f"{at} is {_JSON_TYPES[type(v)]}, not an array"
            todo += [(f"{at}[{i}]", x, sp.item) for i, x in enumerate(v)]
        else:  # Obj or MapOf
            if type(v) is not dict:
                return f"{at} is {_JSON_TYPES[type(v)]}, not an object"
            if isinstance(sp, S.MapOf):
                todo += [(f"{at}.{k}", x, sp.value) for k, x in v.items()]
                continue
            prefix = f"{at}." if at else ""
            unknown = sorted(set(v) - set(sp.fields))
            if unknown:
                return f"unknown key {prefix}{unknown[0]}"
            missing = sorted(sp.required - set(v))
            if missing:
                return f"missing key {prefix}{missing[0]}"
            todo += [(prefix + k, x, sp.fields[k]) for k, x in v.items()]
    return None


def _check_manifest_shape(mpath: Path, m: dict[str, Any]) -> None:
    """Refuse a manifest that ``schema.MANIFEST_SCHEMA`` does not account for (an unknown key, a
    missing required key, a value of the wrong type or outside its enumeration), a ``kind``
    without its own keys (``KIND_REQUIRES``/``KIND_FORBIDS``), or file entries other than the
    names the writer gives (``ops.rank<r>.arrow``; no paths, no duplicates)."""
    problem = check_manifest_value("", m, S.MANIFEST_SCHEMA)
    if problem is None:  # kind is now one of schema.KINDS or absent
        kind = m.get("kind")
        lacks = S.KIND_REQUIRES.get(kind, frozenset()) - set(m)
        extra = S.KIND_FORBIDS.get(kind, frozenset()) & set(m)
        if lacks:
            problem = f"kind {kind!r} without {min(lacks)!r} (a {kind} names its source and policy)"
        elif extra:
            problem = f"kind {kind!r} with {min(extra)!r} (a {kind} has no {min(extra)!r})"
    if problem is not None:
        raise ArtifactError(f"{mpath}: corrupt manifest ({problem})")
    ops = m["files"]["ops"]
    if len(set(ops)) != len(ops) or not all(S.OPS_NAME.fullmatch(o) for o in ops):
        raise ArtifactError(f"{mpath}: corrupt manifest (files.ops={ops!r} must list distinct "
                            "ops.rank<r>.arrow names inside the run directory)")


def listed_files(manifest: dict[str, Any]) -> list[str]:
    """Every file name the manifest's ``files`` lists, plus ``manifest.json``."""
    files = manifest["files"]
    return [S.MANIFEST, *(files[k] for k in ("inputs", "steps", "trace") if files.get(k)),
            *files.get("ops", [])]


def _own_name(name: str) -> bool:
    """A name the writer creates (an incomplete run may hold one that its manifest does not list
    yet, or a ``.tmp`` left by a crash during an atomic write)."""
    name = name.removesuffix(".tmp")
    return name in (S.MANIFEST, S.INPUTS, S.STEPS, S.TRACE) or bool(S.OPS_NAME.fullmatch(name))


def check_directory(path: Path, manifest: dict[str, Any]) -> None:
    """Account for every entry of the run directory.

    Every entry must be a regular file (no symlinks, directories, FIFOs, devices, sockets). In a
    complete run the entries are exactly ``listed_files``; an incomplete run may also hold files
    with the writer's own names (``_own_name``), which the reader then reads from disk.

    Raises:
        ArtifactError: naming the first offending entries.
    """
    kinds = {stat.S_IFLNK: "a symlink", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO",
             stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}
    entries = {}
    with os.scandir(path) as it:
        for e in it:
            entries[e.name] = stat.S_IFMT(e.stat(follow_symlinks=False).st_mode)
    odd = sorted(f"{n} is {kinds.get(m, 'not a regular file')}" for n, m in entries.items()
                 if m != stat.S_IFREG)
    if odd:
        raise ArtifactError(f"{path}: a run directory holds regular files only: "
                            f"{'; '.join(odd[:3])}")
    listed = set(listed_files(manifest))
    extra = sorted(n for n in set(entries) - listed
                   if manifest["complete"] or not _own_name(n))
    if extra:
        raise ArtifactError(f"{path}: files not listed in the manifest: {', '.join(extra[:5])}"
                            " (a run directory holds only its artifact's files)")
    missing = sorted(listed - set(entries))
    if missing and manifest["complete"]:
        raise ArtifactError(f"{path}: complete run lacks {', '.join(missing)}")


def check_batch(path: Path, index: int, batch: pa.RecordBatch, *, ops: bool) -> None:
    """Refuse a record batch that pyarrow's full validation rejects (corrupt lengths, offsets or
    buffers: using it could crash the process), that holds a null in a non-nullable column, or a
    non-finite ``sigma``/``sigma_next``. Op records before the first step (``step`` −1) carry
    ``sigma`` NaN ("no sigma", ``drifttool.capture.recorder``); every other value must be finite.
    Every ``dtype`` must be one of ``DTYPE_SIZES``, and a step record's ``data`` must hold exactly
    the bytes of its dtype and shape.

    Args:
        ops: ``batch`` holds op records (``OPS_SCHEMA``), else step records.

    Raises:
        ArtifactError: naming the file, the batch and the column.
    """
    where = f"{path}: record batch {index}"
    try:
        batch.validate(full=True)
    except pa.ArrowException as e:
        raise ArtifactError(f"{where} is corrupt ({_brief(e)})") from None
    for field, col in zip(batch.schema, batch.columns):
        if not field.nullable and col.null_count:
            raise ArtifactError(f"{where}: {col.null_count} null(s) in column {field.name!r}, "
                                "which may not be null")
    names = batch.schema.names
    dtypes = set(batch.column("dtype").unique().to_pylist()) if "dtype" in names else set()
    if dtypes - set(S.DTYPE_SIZES):
        raise ArtifactError(f"{where}: unknown dtype(s) {sorted(dtypes - set(S.DTYPE_SIZES))}")
    if "data" in names:  # step records: the bytes must be the shape's
        sizes = pc.binary_length(batch.column("data")).to_pylist()
        for i, (dt, shape) in enumerate(zip(batch.column("dtype").to_pylist(),
                                            batch.column("shape").to_pylist())):
            if min(shape, default=0) < 0 or math.prod(shape) * S.DTYPE_SIZES[dt] != sizes[i]:
                raise ArtifactError(f"{where}: row {i} holds {sizes[i]} bytes, not the "
                                    f"{dt} {shape} its dtype and shape declare")
    for name in ("sigma", "sigma_next"):
        if name not in names:
            continue
        col = batch.column(name)
        bad = pc.invert(pc.is_finite(col))
        if ops:  # op records before the first step have no sigma
            bad = pc.and_(bad, pc.invert(pc.and_(pc.equal(batch.column("step"), -1),
                                                 pc.is_nan(col))))
        n = pc.sum(pc.cast(bad, pa.int64())).as_py() or 0
        if n:
            raise ArtifactError(f"{where}: {n} non-finite value(s) in identity column {name!r}")


def check_unique_seq(path: Path, table: pa.Table) -> None:
    """Refuse a table in which two records share ``(rank, seq)``: the recorder numbers every
    record of a rank once (``drifttool.capture.recorder``), so a repeat is a duplicated record.

    Raises:
        ArtifactError: naming the first repeated ``seq``.
    """
    key = np.stack([table["rank"].to_numpy().astype(np.int64), table["seq"].to_numpy()], 1)
    uniq, counts = np.unique(key, axis=0, return_counts=True)
    if len(uniq) != len(key):
        rank, seq = uniq[counts > 1][0]
        raise ArtifactError(f"{path}: {len(key) - len(uniq)} duplicated record(s) (rank {rank} "
                            f"seq {seq} repeats)")


def step_sigmas(table: pa.Table, what: str) -> dict[tuple[int, str, int], float]:
    """``{(rank, phase, step): sigma}`` of the records at ``step >= 0``.

    Raises:
        ArtifactError: two records of one step carry different sigmas (``what`` names the file).
    """
    t = table.filter(pc.greater_equal(table["step"], 0)).group_by(["rank", "phase", "step"])
    g = t.aggregate([("sigma", "min"), ("sigma", "max")]).to_pylist()
    bad = [r for r in g if r["sigma_min"] != r["sigma_max"]]
    if bad:
        r = bad[0]
        raise ArtifactError(f"{what}: records of {r['phase']} step {r['step']} (rank {r['rank']}) "
                            f"carry different sigmas ({r['sigma_min']!r}, {r['sigma_max']!r})")
    return {(r["rank"], r["phase"], r["step"]): r["sigma_min"] for r in g}


def check_sigmas(path: Path, steps: pa.Table, ops: pa.Table) -> None:
    """One sigma per step: every record of a (rank, phase, step) carries the same ``sigma``, op
    and step records agree on it, and a step's ``sigma_next`` is the next step's ``sigma``
    (``drifttool.sampling.rollout``: both come from one sigma table).

    Raises:
        ArtifactError: naming the step and the disagreeing values.
    """
    of_steps = step_sigmas(steps, f"{path}/{S.STEPS}")
    of_ops = step_sigmas(ops, f"{path}/ops.rank*.arrow")
    for key in sorted(set(of_steps) & set(of_ops)):
        if of_steps[key] != of_ops[key]:
            raise ArtifactError(f"{path}: {key[1]} step {key[2]} (rank {key[0]}) has sigma "
                                f"{of_steps[key]!r} in {S.STEPS} but {of_ops[key]!r} in its op "
                                "records")
    nxt = steps.filter(pc.greater_equal(steps["step"], 0)).group_by(["rank", "phase", "step"])
    for r in nxt.aggregate([("sigma_next", "min"), ("sigma_next", "max")]).to_pylist():
        following = of_steps.get((r["rank"], r["phase"], r["step"] + 1))
        if r["sigma_next_min"] != r["sigma_next_max"] or (
                following is not None and following != r["sigma_next_min"]):
            raise ArtifactError(f"{path}/{S.STEPS}: sigma_next of {r['phase']} step {r['step']} "
                                f"(rank {r['rank']}) is not one value equal to the next step's "
                                f"sigma {following!r}")


def check_records_match_manifest(path: Path, manifest: dict[str, Any], steps: pa.Table,
                                  ops: pa.Table) -> None:
    """The records are what the manifest declares: an ``L0`` run holds no op records, an ``L1``
    run no row digests (``schema.LEVELS``), and every record of a run of ``kind`` K has phase
    ``schema.KIND_PHASE[K]`` (a recompute's are ``train``, a rollout's ``rollout``). Checks what
    the manifest states; a key it lacks is not checked.

    Raises:
        ArtifactError: naming the manifest value and what the files hold instead.
    """
    level = manifest.get("capture_level")
    if level == "L0" and ops.num_rows:
        raise ArtifactError(f"{path}: capture_level L0 but {ops.num_rows} op records in "
                            "ops.rank*.arrow (a hand-edited manifest?)")
    if level in ("L0", "L1") and ops.num_rows and ops["row_digests"].null_count != ops.num_rows:
        raise ArtifactError(f"{path}: capture_level {level} but op records carry row digests "
                            "(L2 data; a hand-edited manifest?)")
    phase = S.KIND_PHASE.get(manifest.get("kind"))
    for name, table in ((S.STEPS, steps), ("ops.rank*.arrow", ops)):
        other = sorted(set(table["phase"].unique().to_pylist()) - {phase}) if phase else []
        if other:
            raise ArtifactError(f"{path}: kind {manifest['kind']!r} but {name} holds phase "
                                f"{other[0]!r} records (a {manifest['kind']} holds phase "
                                f"{phase!r} only)")


def schema_differences(got: pa.Schema, want: pa.Schema) -> str:
    """One line naming the missing, unexpected, retyped and reordered columns of ``got``."""
    have, need = dict(zip(got.names, got)), dict(zip(want.names, want))
    parts = [f"missing {[n for n in want.names if n not in have]}",
             f"unexpected {[n for n in got.names if n not in need]}",
             "retyped " + str([f"{n}: {have[n].type}{'' if have[n].nullable else ' not null'} "
                               f"(expected {f.type}{'' if f.nullable else ' not null'})"
                               for n, f in need.items() if n in have and not have[n].equals(f)])]
    if [n for n in got.names if n in need] != [n for n in want.names if n in have]:
        parts.append("columns in another order")
    return "; ".join(p for p in parts if not p.endswith("[]"))


def read_stream(path: Path, schema: pa.Schema, *, complete: bool) -> tuple[pa.Table, str | None]:
    """All complete record batches of the IPC stream at ``path``, and a note if it was cut.

    Args:
        complete: the run's manifest flag; when true, a cut or unclosed stream is an error.

    Returns:
        ``(table, problem)``: ``problem`` is ``None`` for a whole stream.

    Raises:
        ArtifactError: the file is not an Arrow stream of ``schema`` at a supported schema
            version, a batch is damaged (``check_batch``), bytes follow the end-of-stream marker,
            or (``complete``) it is cut short or was never closed.
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
            raise ArtifactError(f"{path}: not a readable Arrow IPC stream ({_brief(e)})") from None
        return empty, f"{name}: unreadable header, no batch recovered ({_brief(e)})"
    version = S.schema_version_of(reader.schema)
    if version not in S.SUPPORTED_SCHEMA_VERSIONS:
        raise ArtifactError(f"{path}: schema_version {version!r} is not supported "
                            f"(supports {sorted(S.SUPPORTED_SCHEMA_VERSIONS)})")
    if not reader.schema.equals(schema, check_metadata=False):
        raise ArtifactError(f"{path}: columns differ from schema version {version}: "
                            f"{schema_differences(reader.schema, schema)}")
    batches, problem = [], None
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            break
        except (pa.ArrowException, OSError) as e:
            problem = f"{name}: truncated after {len(batches)} complete batches ({_brief(e)})"
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
    return pa.Table.from_batches(batches, schema=reader.schema), problem


def check_inputs(path: Path, manifest: dict[str, Any]) -> dict[str, RawTensor]:
    """Re-hash every replay input of ``inputs.safetensors`` against the manifest's
    ``replay.input_digests`` (``xxh3_64`` of ``"<dtype>|<shape>|"`` + bytes, as
    ``drifttool.capture.digest``) and refuse non-finite values: ``drifttool run`` never writes
    them (``runner.check_finite``), so one is damage. Torch-free (``drifttool.artifact.raw``).
    Returns the inputs as read (``{}`` when the run has none).

    Raises:
        ArtifactError: unreadable file, unknown dtype, a non-finite value, a tensor missing,
            extra or different from ``input_digests`` (when the manifest has them), or no inputs
            file in a complete run whose manifest pins them.
    """
    name = manifest["files"].get("inputs")
    pinned = manifest.get("replay", {}).get("input_digests")
    if not name or not (path / name).is_file():
        if pinned and manifest["complete"]:
            raise ArtifactError(f"{path}: the manifest pins replay inputs (input_digests) but the "
                                f"run has no {S.INPUTS}")
        return {}  # an incomplete run that never wrote its inputs
    where = path / name
    tensors = read_raw(where)
    got = {key: f"xxh3_64:{t.digest():016x}" for key, t in tensors.items()}
    bad = [f"{key} ({n})" for key, t in tensors.items() for n in [t.nonfinite()] if n]
    if bad:
        raise ArtifactError(f"{where}: non-finite replay inputs: {', '.join(bad)}")
    if pinned is not None:
        wrong = sorted(k for k in set(pinned) | set(got) if pinned.get(k) != got.get(k))
        if wrong:
            raise ArtifactError(f"{where}: replay inputs {wrong} do not match the manifest's "
                                "input_digests (missing, extra, tampered or replaced)")
    return tensors


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

    def _listed(self, kind: str) -> list[str]:
        """Files of ``kind`` the manifest lists, or (incomplete run) the ones on disk."""
        listed = self.manifest["files"].get(kind)
        listed = [] if listed is None else [listed] if isinstance(listed, str) else list(listed)
        if self.complete:
            return listed  # check_directory: every listed file is there
        if kind == "ops":
            return sorted(p.name for p in self.path.iterdir() if S.OPS_NAME.fullmatch(p.name))
        default = {"steps": S.STEPS, "trace": S.TRACE, "inputs": S.INPUTS}[kind]
        return [default] if (self.path / default).is_file() else []

    def _table(self, kind: str, name: str, schema: pa.Schema) -> pa.Table:
        key = f"{kind}:{name}"
        if key not in self._cache:
            table, problem = read_stream(self.path / name, schema, complete=self.complete)
            if kind == "ops":
                rank = int(S.OPS_NAME.fullmatch(name).group(1))
                if table.num_rows and not pc.all(pc.equal(table["rank"], rank)).as_py():
                    raise ArtifactError(f"{self.path / name}: holds records of another rank than "
                                        f"{rank} (a renamed or copied file)")
            if "seq" in table.column_names:
                check_unique_seq(self.path / name, table)
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
                                f"({_brief(e)})") from None

    def raw_inputs(self) -> dict[str, RawTensor]:
        """The replay inputs as dtype + bytes, read without torch (``drifttool.artifact.raw``) and
        checked when the run was opened (``check_inputs``); ``{}`` if none were written."""
        return self._raw_inputs  # read and checked at open

    def check(self) -> list[str]:
        """Read every Arrow file once, check that its steps carry one sigma each
        (``check_sigmas``) and that the records are what the manifest says
        (``check_records_match_manifest``); return ``problems`` (raises as the readers do)."""
        steps, ops = self.steps_table(), self.ops_table()
        check_sigmas(self.path, steps, ops)
        check_records_match_manifest(self.path, self.manifest, steps, ops)
        self.trace_rows()
        return list(self.problems)

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, complete={self.complete}, level={self.capture_level})"


def open_run(path: str | os.PathLike) -> Run:
    """Open the artifact directory at ``path``: checks the manifest, the directory's entries and
    the replay inputs (Arrow files are read and checked on first use).

    Raises:
        ArtifactError: missing directory, missing or corrupt manifest, unsupported schema version,
            an entry the manifest does not account for, damaged replay inputs.
    """
    return Run(path)
