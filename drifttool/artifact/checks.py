"""Checks of a run directory and its records: damage is refused, never ignored.

    >>> check_directory(Path("runs/a"), manifest)        # every entry a listed regular file
    >>> check_batch(Path("runs/a/steps.rank0.parquet"), 0, batch, ops=False)

Every entry of the run directory must be a regular file that the manifest accounts for
(``check_directory``); every record batch passes pyarrow's full validation (corrupt lengths or
offsets would otherwise crash the process), has no null in a non-nullable column and a finite
``sigma``/``sigma_next`` (``check_batch``); each ``<table>.rank<r>`` file holds rank ``r``
only, of a rank below the manifest's world size, and a complete run has every rank's steps file
(``check_directory``);
every replay input is re-hashed against the manifest's ``replay.input_digests`` and must be
finite (``check_inputs``); each step carries one sigma (``check_sigmas``) and the records are
what the manifest's ``capture_level`` and ``kind`` say (``check_records_match_manifest``).
Which ranks, samples and steps the records cover is checked in ``drifttool.artifact.coverage``.
Torch-free. Source: design.md, "Artifact".
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from drifttool.artifact import compute as ac
from drifttool.artifact import manifest_schema as MS
from drifttool.artifact import schema as S
from drifttool.artifact.manifest import brief, listed_files, world_size
from drifttool.artifact.raw import RawTensor, read_raw
from drifttool.digestcore import label
from drifttool.errors import ArtifactError


def _own_name(name: str) -> bool:
    """A name the writer creates (an incomplete run may hold one that its manifest does not list
    yet, or a ``.tmp`` left by a crash during an atomic write)."""
    name = name.removesuffix(".tmp")
    return name in (S.MANIFEST, S.INPUTS) or bool(S.RANK_FILE.fullmatch(name))


def check_directory(path: Path, manifest: dict[str, Any]) -> None:
    """Account for every entry of the run directory.

    Every entry must be a regular file (no symlinks, directories, FIFOs, devices, sockets). In a
    complete run the entries are exactly ``listed_files`` and every rank of ``layout.world_size``
    has its steps file; an incomplete run may also hold files with the writer's own names
    (``_own_name``), which the reader then reads from disk. No per-rank file may belong to a rank
    at or beyond the world size.

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
                            " (a run directory holds only its artifact's files: move them out of "
                        f"{path} to read the run)")
    missing = sorted(listed - set(entries))
    if missing and manifest["complete"]:
        raise ArtifactError(f"{path}: complete run lacks {', '.join(missing)}")
    world = world_size(manifest)
    beyond = sorted(n for n in entries for p in [S.parse_rank_file(n.removesuffix(".tmp"))]
                    if p is not None and p[1] >= world)
    if beyond:
        raise ArtifactError(f"{path}: {beyond[0]} belongs to a rank beyond layout.world_size "
                            f"{world} (ranks 0 … {world - 1})")
    has_steps = {p[1] for n in entries for p in [S.parse_rank_file(n)] if p and p[0] == "steps"}
    lacking = [S.steps_file(r) for r in range(world) if r not in has_steps]
    if lacking and manifest["complete"]:
        raise ArtifactError(f"{path}: complete run of world size {world} lacks "
                            f"{', '.join(lacking[:5])} (every rank writes its steps file)")


def check_batch(path: Path, index: int, batch: pa.RecordBatch | pa.Table, *, ops: bool) -> None:
    """Refuse a record batch that pyarrow's full validation rejects (corrupt lengths, offsets or
    buffers: using it could crash the process), that holds a null in a non-nullable column, or a
    non-finite ``sigma``/``sigma_next``, an unknown ``component`` (``schema.COMPONENTS``) or a
negative ``op_pos``. Op records before the first step (``step`` −1) carry
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
        raise ArtifactError(f"{where} is corrupt ({brief(e)})") from None
    for field, col in zip(batch.schema, batch.columns):
        if not field.nullable and col.null_count:
            raise ArtifactError(f"{where}: {col.null_count} null(s) in column {field.name!r}, "
                                "which may not be null")
    names = batch.schema.names
    dtypes = set(ac.unique(batch.column("dtype")).to_pylist()) if "dtype" in names else set()
    if dtypes - set(S.DTYPE_SIZES):
        raise ArtifactError(f"{where}: unknown dtype(s) {sorted(dtypes - set(S.DTYPE_SIZES))}")
    if "data" in names:  # step records: the bytes must be the shape's
        sizes = ac.call("binary_length", batch.column("data")).to_pylist()
        for i, (dt, shape) in enumerate(zip(batch.column("dtype").to_pylist(),
                                            batch.column("shape").to_pylist())):
            if min(shape, default=0) < 0 or math.prod(shape) * S.DTYPE_SIZES[dt] != sizes[i]:
                raise ArtifactError(f"{where}: row {i} holds {sizes[i]} bytes, not the "
                                    f"{dt} {shape} its dtype and shape declare")
    components = (set(ac.unique(batch.column("component")).to_pylist()) - {None}
                  if "component" in names else set())
    if components - set(S.COMPONENTS):
        raise ArtifactError(f"{where}: unknown component(s) "
                            f"{sorted(components - set(S.COMPONENTS))} (one of {S.COMPONENTS})")
    if "op_pos" in names and (ac.call("min", batch.column("op_pos")).as_py() or 0) < 0:
        raise ArtifactError(f"{where}: negative op_pos (a program position counts from 0)")
    for name in ("sigma", "sigma_next"):
        if name not in names:
            continue
        col = batch.column(name)
        bad = ac.call("invert", ac.call("is_finite", col))
        if ops:  # op records before the first step have no sigma
            bad = ac.call("and", bad, ac.call("invert", ac.call(
                "and", ac.call("equal", batch.column("step"), -1), ac.call("is_nan", col))))
        n = ac.call("sum", ac.cast(bad, pa.int64())).as_py() or 0
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


def per_step_min_max(table: pa.Table, column: str) -> list[dict]:
    """``[{"rank", "phase", "step", "<column>_min", "<column>_max"}]`` of the records at
    ``step >= 0``, one per (rank, phase, step) in order of first appearance; NaN is ignored as
    pyarrow's ``min``/``max`` ignore it. numpy, not pyarrow's ``group_by``: that loads
    ``pyarrow.acero`` and ``pyarrow.dataset`` (about 70 ms of a ``drifttool diff``'s start-up).
    """
    t = ac.filter(table, ac.call("greater_equal", table["step"], 0))
    if t.num_rows == 0:
        return []
    phase = ac.dictionary_encode(t["phase"].combine_chunks())
    key = np.stack([t["rank"].to_numpy().astype(np.int64), phase.indices.to_numpy().astype(np.int64),
                    t["step"].to_numpy().astype(np.int64)], 1)  # [N, 3]
    uniq, first, inverse = np.unique(key, axis=0, return_index=True, return_inverse=True)
    values = t[column].to_numpy().astype(np.float64)
    lo, hi = np.full(len(uniq), np.nan), np.full(len(uniq), np.nan)
    np.fmin.at(lo, inverse.reshape(-1), values)
    np.fmax.at(hi, inverse.reshape(-1), values)
    names = phase.dictionary.to_pylist()
    return [{"rank": int(uniq[g, 0]), "phase": names[uniq[g, 1]], "step": int(uniq[g, 2]),
             f"{column}_min": float(lo[g]), f"{column}_max": float(hi[g])}
            for g in np.argsort(first, kind="stable")]


def step_sigmas(table: pa.Table, what: str) -> dict[tuple[int, str, int], float]:
    """``{(rank, phase, step): sigma}`` of the records at ``step >= 0``.

    Raises:
        ArtifactError: two records of one step carry different sigmas (``what`` names the file).
    """
    g = per_step_min_max(table, "sigma")
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
    of_steps = step_sigmas(steps, f"{path}/steps.rank*")
    of_ops = step_sigmas(ops, f"{path}/ops.rank*")
    for key in sorted(set(of_steps) & set(of_ops)):
        if of_steps[key] != of_ops[key]:
            raise ArtifactError(f"{path}: {key[1]} step {key[2]} (rank {key[0]}) has sigma "
                                f"{of_steps[key]!r} in its step records but {of_ops[key]!r} in "
                                "its op "
                                "records")
    for r in per_step_min_max(steps, "sigma_next"):
        following = of_steps.get((r["rank"], r["phase"], r["step"] + 1))
        if r["sigma_next_min"] != r["sigma_next_max"] or (
                following is not None and following != r["sigma_next_min"]):
            raise ArtifactError(f"{path}/steps.rank*: sigma_next of {r['phase']} step "
                                f"{r['step']} "
                                f"(rank {r['rank']}) is not one value equal to the next step's "
                                f"sigma {following!r}")


def check_records_match_manifest(path: Path, manifest: dict[str, Any], steps: pa.Table,
                                  ops: pa.Table) -> None:
    """The records are what the manifest declares: an ``L0`` run holds no op records, an ``L1``
    run no row digests (``schema.LEVELS``), and every record of a run of ``kind`` K has phase
    ``manifest_schema.KIND_PHASE[K]`` (a recompute's are ``train``, a rollout's ``rollout``). Checks what
    the manifest states; a key it lacks is not checked.

    Raises:
        ArtifactError: naming the manifest value and what the files hold instead.
    """
    level = manifest.get("capture_level")
    if level == "L0" and ops.num_rows:
        raise ArtifactError(f"{path}: capture_level L0 but {ops.num_rows} op records in "
                            "ops.rank* (a hand-edited manifest?)")
    if level in ("L0", "L1") and ops.num_rows and ops["row_digests"].null_count != ops.num_rows:
        raise ArtifactError(f"{path}: capture_level {level} but op records carry row digests "
                            "(L2 data; a hand-edited manifest?)")
    phase = MS.KIND_PHASE.get(manifest.get("kind"))
    for name, table in (("steps.rank*", steps), ("ops.rank*", ops)):
        other = sorted(set(ac.unique(table["phase"]).to_pylist()) - {phase}) if phase else []
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


def check_inputs(path: Path, manifest: dict[str, Any]) -> dict[str, RawTensor]:
    """Re-hash every replay input of ``inputs.safetensors`` against the manifest's
    ``replay.input_digests`` (digest v2 ``V``, one row, ``drifttool.digestcore.label``) and refuse non-finite values: ``drifttool run`` never writes
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
    got = {key: label(t.digest()) for key, t in tensors.items()}
    bad = [f"{key} ({n})" for key, t in tensors.items() for n in [t.nonfinite()] if n]
    if bad:
        raise ArtifactError(f"{where}: non-finite replay inputs: {', '.join(bad)}")
    if pinned is not None:
        wrong = sorted(k for k in set(pinned) | set(got) if pinned.get(k) != got.get(k))
        if wrong:
            raise ArtifactError(f"{where}: replay inputs {wrong} do not match the manifest's "
                                "input_digests (missing, extra, tampered or replaced)")
    return tensors
