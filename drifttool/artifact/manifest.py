"""Read ``manifest.json`` and check it against ``manifest_schema.MANIFEST_SCHEMA``.

    >>> m = read_manifest("runs/a")
    >>> m["schema_version"], m["complete"], m["capture_level"]
    (2, True, 'L2')

The manifest must be plain JSON (no NaN/Infinity constants, no duplicate keys, no float that
overflows, at most ``MAX_MANIFEST_DEPTH`` levels) that the schema accounts for: every key known,
every required key present, every value of its type and enumeration, and a run's manifest every
section a run's holds (``manifest_schema.section_problem``). Anything else is a corrupt manifest
(``ArtifactError``, one line). Torch-free. Source: design.md, "Artifact".
"""

from __future__ import annotations

import collections
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from drifttool.artifact import manifest_schema as MS
from drifttool.artifact import schema as S
from drifttool.errors import ArtifactError


MAX_MANIFEST_DEPTH = 32
"""Deepest nesting of objects/arrays accepted in ``manifest.json`` (drifttool's own manifests
nest a few levels; the diff walks them recursively)."""


def brief(e: BaseException) -> str:
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
            ``int``) this reader does not support, or not what ``manifest_schema.MANIFEST_SCHEMA``
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
        if (path / "fixture.json").is_file() and (path / "expected" / S.MANIFEST).is_file():
            raise ArtifactError(f"{path}: a fixture, not an artifact; its expected run is "
                                f"{path / 'expected'}") from None
        raise ArtifactError(f"{path}: missing {S.MANIFEST} (not an artifact, or the run never "
                            "started)") from None
    if not stat.S_ISREG(mode):
        raise ArtifactError(f"{mpath}: not a regular file (links and special files are refused)")
    try:
        # JSON text is UTF-8 (a leading BOM ignored, as json.loads does); never another encoding
        raw = mpath.read_bytes()
        manifest = json.loads(raw.decode("utf-8-sig"), parse_constant=_reject_constant,
                              parse_float=_finite_float, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        at = e.start + len(raw) - len(e.object)  # an offset in the file, BOM included
        raise ArtifactError(f"{mpath}: corrupt manifest (not UTF-8 JSON text: byte "
                            f"0x{e.object[e.start]:02x} at offset {at} is not UTF-8)") from None
    except (OSError, ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and the int digit limit; said in words, no class name
        what = "unreadable" if isinstance(e, OSError) else "not JSON"
        raise ArtifactError(f"{mpath}: corrupt manifest ({what}: {brief(e)})") from None
    if _depth(manifest) > MAX_MANIFEST_DEPTH:
        raise ArtifactError(f"{mpath}: corrupt manifest (nested deeper than "
                            f"{MAX_MANIFEST_DEPTH} levels)")
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{mpath}: corrupt manifest (not a JSON object)")
    version = manifest.get("schema_version")
    if "schema_version" not in manifest:
        raise ArtifactError(f"{mpath}: corrupt manifest (missing section 'schema_version')")
    if type(version) is not int:
        raise ArtifactError(f"{mpath}: schema_version must be an integer, got {version!r}")
    problem = S.version_problem(version)
    if problem:
        raise ArtifactError(f"{mpath}: {problem}")
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
        if sp is MS.ANY:
            continue
        if isinstance(sp, MS.Nullable):
            if v is not None:
                todo.append((at, v, sp.spec))
        elif isinstance(sp, MS.Enum):
            if type(v) is not str or v not in sp.values:
                shown = "null" if v is None else repr(v)  # the manifest's JSON word
                return f"{at} {shown} is not one of {', '.join(map(str, sp.values))}"
        elif type(sp) is tuple:  # JSON types (a plain tuple, not one of the NamedTuple specs)
            if type(v) not in sp and not (type(v) is int and float in sp):
                return (f"{at} is {_JSON_TYPES[type(v)]}, not "
                        f"{' or '.join(_JSON_TYPES[t] for t in sp)}")
        elif isinstance(sp, MS.Least):
            wrong = check_manifest_value(at, v, sp.types)  # a leaf: no deeper call
            if wrong is not None:
                return wrong
            if v != v:  # NaN: no comparison holds
                return f"{at} is nan, not a finite number"
            if not (v > sp.least if sp.strict else v >= sp.least):
                return f"{at} is {v!r}, not {'above' if sp.strict else 'at least'} {sp.least}"
            if sp.below is not None and not v < sp.below:
                return f"{at} is {v!r}, not below {sp.below}"
        elif isinstance(sp, MS.ListOf):
            if type(v) is not list:
                return f"{at} is {_JSON_TYPES[type(v)]}, not an array"
            if sp.length is not None and len(v) != sp.length:
                return f"{at} has {len(v)} item{'s' * (len(v) != 1)}, not {sp.length}"
            todo += [(f"{at}[{i}]", x, sp.item) for i, x in enumerate(v)]
        else:  # Obj or MapOf
            if type(v) is not dict:
                return f"{at} is {_JSON_TYPES[type(v)]}, not an object"
            if isinstance(sp, MS.MapOf):
                todo += [(f"{at}.{k}", x, sp.value) for k, x in v.items()]
                continue
            prefix = f"{at}." if at else ""
            unknown = sorted(set(v) - set(sp.fields))
            if unknown and sp.other is None:
                return f"unknown key {prefix}{unknown[0]}"
            missing = sorted(sp.required - set(v))
            if missing:
                return (f"missing key {prefix}{missing[0]}" if at else
                        f"missing section {missing[0]!r}")
            todo += [(prefix + k, x, sp.fields.get(k, sp.other)) for k, x in v.items()]
    return None


def _check_manifest_shape(mpath: Path, m: dict[str, Any]) -> None:
    """Refuse a manifest that ``manifest_schema.MANIFEST_SCHEMA`` does not account for (an unknown
    key, a missing required key, a value of the wrong type or outside its enumeration), a run's
    manifest without one of its sections (``section_problem``: ``RUN_SECTIONS``,
    ``KIND_REQUIRES``), a ``kind`` with another kind's keys (``KIND_FORBIDS``), file entries
    other than the names the writer gives (``files_problem``) or a layout that contradicts itself
    (``layout_problem``) or sample ids that cannot be a run's (``samples_problem``)."""
    problem = check_manifest_value("", m, MS.MANIFEST_SCHEMA)
    if problem is None:  # kind is now one of manifest_schema.KINDS or absent
        kind = m.get("kind")
        extra = MS.KIND_FORBIDS.get(kind, frozenset()) & set(m)
        problem = MS.section_problem(m)
        if problem is None and extra:
            problem = f"kind {kind!r} with {min(extra)!r} (a {kind} has no {min(extra)!r})"
    if problem is not None:
        raise ArtifactError(f"{mpath}: corrupt manifest ({problem})")
    problem = (layout_problem(m.get("layout", {"world_size": 1})) or files_problem(m)
               or samples_problem(m.get("settings")))
    if problem is not None:
        raise ArtifactError(f"{mpath}: corrupt manifest ({problem})")


def world_size(manifest: dict[str, Any]) -> int:
    """The number of ranks that wrote the run (``layout.world_size``; 1 without a layout)."""
    return manifest.get("layout", {}).get("world_size", 1)


def files_problem(m: dict[str, Any]) -> str | None:
    """How ``files`` departs from what the writer gives: ``ops``/``steps``/``trace`` each a list
    of distinct ``rank_file`` names of its own table (no paths), of ranks below the world size,
    with a suffix of the manifest's schema version (``schema.suffix_fits``; no stream in a
    complete run); ``digests`` naming listed Parquet files only, and (a complete run of
    version 5) every one of them."""
    world, version, files = world_size(m), m["schema_version"], m["files"]
    for table in S.RANK_TABLES:
        names = files[table]
        parsed = [S.parse_rank_file(n) for n in names]
        if len(set(names)) != len(names) or any(p is None or p[0] != table for p in parsed):
            return (f"files.{table}={names!r} must list distinct {table}.rank<r> file names "
                    "inside the run directory")
        beyond = sorted(n for n, p in zip(names, parsed) if p[1] >= world)
        if beyond:
            return f"files.{table} lists {beyond[0]}, but layout.world_size is {world}"
        odd = sorted(n for n, p in zip(names, parsed) if not S.suffix_fits(p[2], version)
                     or (m["complete"] and p[2] == S.STREAM))
        if odd:
            return (f"files.{table} lists {odd[0]}, which a {'complete ' * m['complete']}run of "
                    f"schema_version {version} does not hold")
    parquet = {n for t in S.RANK_TABLES for n in files[t] if n.endswith(S.PARQUET)}
    digests = files.get("digests", {})
    if set(digests) - parquet:
        return f"files.digests names {min(set(digests) - parquet)}, which files does not list"
    if m["complete"] and version >= S.PARQUET_SINCE and parquet - set(digests):
        return f"files.digests lacks {min(parquet - set(digests))}"
    return None


def layout_problem(layout: dict[str, Any]) -> str | None:
    """How a ``layout`` (already of ``manifest_schema._LAYOUT``'s shape) contradicts itself: a world size
    outside ``[1, MAX_WORLD_SIZE]``, a ``mesh`` whose sizes do not multiply to it, or ``samples``
    whose keys are not exactly the ranks ``"0"`` … ``"world_size-1"`` or whose ids repeat."""
    world = layout.get("world_size")
    if type(world) is not int or not 1 <= world <= S.MAX_WORLD_SIZE:
        return f"layout.world_size {world!r} is not an integer in [1, {S.MAX_WORLD_SIZE}]"
    mesh = layout.get("mesh")
    if mesh is not None and (len(mesh["dims"]) != len(mesh["shape"])
                             or len(set(mesh["dims"])) != len(mesh["dims"])
                             or any(n < 1 for n in mesh["shape"])
                             or math.prod(mesh["shape"]) != world):
        return (f"layout.mesh dims {mesh['dims']} of shape {mesh['shape']} does not cover "
                f"world_size {world}")
    samples = layout.get("samples")
    if samples is not None:
        if set(samples) != {str(r) for r in range(world)}:
            return (f"layout.samples has ranks {sorted(samples)}, not one key per rank of "
                    f"world_size {world}")
        ids = [i for r in samples.values() for i in r]
        if len(set(ids)) != len(ids):
            return "layout.samples gives a sample id to two ranks (or twice to one)"
    return None


def samples_problem(settings: Any) -> str | None:
    """How ``settings.samples`` (already a list of integers, when present) departs from the sample
    ids a run holds: at least one, each at least 0, none twice (as ``drifttool run --samples``
    takes them); ``settings.sample_labels``, when present, one id per sample.
    Whether the records hold those samples is checked once they are read
    (``coverage.check_named_samples``)."""
    samples = settings.get("samples") if isinstance(settings, dict) else None
    if samples is None:
        return None
    if not samples:
        return "settings.samples is empty: the run names no sample"
    negative = sorted({i for i in samples if i < 0})
    if negative:
        return f"settings.samples holds negative sample id(s) {negative[:5]}: ids are at least 0"
    twice = sorted(i for i, n in collections.Counter(samples).items() if n > 1)
    if twice:
        return f"settings.samples has duplicate sample ids: {twice[:5]} named more than once"
    labels = settings.get("sample_labels")
    if labels is not None and len(labels) != len(samples):
        return (f"settings.sample_labels names {len(labels)} id(s) for the "
                f"{len(samples)} sample(s) of settings.samples, not one per sample")
    return None


def listed_files(manifest: dict[str, Any]) -> list[str]:
    """Every file name the manifest's ``files`` lists (``digests`` names no other), plus
    ``manifest.json``."""
    files = manifest["files"]
    return [S.MANIFEST, *([files["inputs"]] if files.get("inputs") else []),
            *(n for t in S.RANK_TABLES for n in files.get(t, []))]
