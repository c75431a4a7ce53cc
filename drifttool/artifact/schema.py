"""Every Arrow schema of the trajectory artifact, and its version, in one place.

    run_dir/
      manifest.json        {"schema_version": 4, "complete": true, "capture_level": "L1",
                            "fingerprint": {...}, "files": {...}, ...}
      inputs.safetensors   replay inputs (initial latents, SDE noise, prompt embeddings, masks)
      steps.rank<r>.arrow  STEPS_SCHEMA: one row per (component, phase, step, sample, branch, quantity)
      ops.rank<r>.arrow    OPS_SCHEMA: one row per captured operator output per logical sample
      trace.rank<r>.arrow  TRACE_SCHEMA: one row per operator call site of rank r

Every rank ``r`` of ``layout.world_size`` writes its own ``*.rank<r>.arrow`` files; rank 0 also
writes ``manifest.json`` and ``inputs.safetensors``. A single process is rank 0 of world 1
(``drifttool.artifact.writer``); the reader presents every rank's records as one run, the
owning rank a column (``drifttool.artifact.reader``).

Arrow files use the IPC *stream* format (one record batch per step, flushed), so a run cut short
keeps its finished steps readable; ``pyarrow.ipc.open_stream`` reads them without drifttool
(design.md, "Artifact"). Each schema carries ``drifttool.schema_version`` and
``drifttool.table`` in its metadata; ``manifest.json`` repeats the version. Bump
``SCHEMA_VERSION`` on any change to a schema or to the meaning of a column.

Identity columns follow design.md, "Identity of a captured tensor". The identity of a record
(``OPS_KEY``, ``STEPS_KEY``) holds no rank: ``rank`` is the owning rank (which rank computed and
holds the record), so a run over several ranks aligns with a single-device run. "First" is
decided by the rank-independent program position (``OP_ORDER``, ``STEP_ORDER``, ``op_pos``),
never by the per-rank execution counter ``seq``. Strings are plain ``utf8``
(not dictionary-encoded) so DuckDB and Polars read them without dictionary replacement.
"""

from __future__ import annotations

import re
from typing import Any

import pyarrow as pa

from drifttool import components
from drifttool.artifact import levels

SCHEMA_VERSION = 4
SUPPORTED_SCHEMA_VERSIONS = frozenset({3, SCHEMA_VERSION})
"""Versions this reader can open; anything else raises ``ArtifactError`` (``version_problem``).
Version 4 added the op records' ``rank_digests`` and ``rank_disagree`` (every rank's digest of a
record in a TP/SP layout, and the ranks whose copy of a replicated output disagrees); a version 3
file reads with both null (``RANK_COLUMNS``: not checked on every rank) and aligns with version
4 records (``ALIGNABLE_SCHEMA_VERSIONS``: the identity did not change). Version 3: ``rank`` left the identity keys (it is the owning rank), ``component``
joined them, op records carry the program position ``op_pos`` and the trace ``component``,
``rank`` and ``device``. Version 2 moved the sampler operators from block −1 to
``SAMPLER_BLOCK``. Older versions are refused: their records order "first" by a per-rank counter
and key on the rank."""


ALIGNABLE_SCHEMA_VERSIONS = frozenset({3, 4})
"""Versions whose records align with each other in a diff (same identity and digests)."""


def version_problem(version: Any) -> str | None:
    """``None`` when this drifttool reads artifacts of schema ``version``; otherwise one line
    saying why not (older: re-run or reseal; newer: upgrade drifttool)."""
    if version in SUPPORTED_SCHEMA_VERSIONS:
        return None
    if type(version) is int and 0 < version < min(SUPPORTED_SCHEMA_VERSIONS):
        return (f"schema_version {version} was written by an older drifttool (this one reads "
                f"version {SCHEMA_VERSION}); re-run it (a fixture: reseal it)")
    if type(version) is int and version > SCHEMA_VERSION:
        return (f"schema_version {version} was written by a newer drifttool (this one reads "
                f"version {SCHEMA_VERSION}); upgrade drifttool")
    return f"schema_version {version!r} is not a drifttool schema version (this one reads {SCHEMA_VERSION})"


SAMPLER_BLOCK = -2
"""``block`` of the sampler operators (``flow_sigma_table``, ``cfg_combine_renorm``,
``flow_sde_step_logp``): outside the model, neither before the blocks (−1) nor after them
(``num_layers``). Reports name it ``sampler`` (``block_name``)."""

COMPONENTS = components.COMPONENTS
"""``component`` values in program order (``drifttool.components``)."""
DEFAULT_COMPONENT = components.DEFAULT_COMPONENT

PHASES = ("rollout", "train")
"""``phase`` values in program order (a training recompute follows the rollout it recomputes)."""
BRANCHES = ("cond", "uncond", "cfg", "none")
"""CFG ``branch`` values in program order; other strings (``"cond+uncond"`` of an unbatched
record under batched CFG) follow, by name."""
ROLES = ("output", "internal", "grad_input", "grad_weight")
"""``role`` values in program order: operator outputs (``internal``: a fused operator's internal
tensors, captured at L2 when dispatch expands it into its decomposition; ordered with the outputs
by ``op_pos``), then the backward's gradients."""
QUANTITIES = ("x_t", "v_t", "mu", "std_t", "x_next", "logp_t")
"""Step quantities in program order (``drifttool.sampling.rollout``: the input ``x_t``, the
velocity, the SDE transition, the next latent, its log-probability); others follow by name."""

MANIFEST = "manifest.json"
INPUTS = "inputs.safetensors"
LEVELS = levels.LEVELS
"""Capture levels (``drifttool.artifact.levels``)."""


RANK_TABLES = ("ops", "steps", "trace")
"""Tables every rank writes to its own ``<table>.rank<r>.arrow`` (``rank_file``)."""

MAX_WORLD_SIZE = 1_000_000
"""Ranks are 0 … 999999 (``RANK_FILE`` spells at most six digits)."""


def rank_file(table: str, rank: int) -> str:
    """File name of rank ``rank``'s records of ``table`` (one of ``RANK_TABLES``).

    Raises:
        ValueError: an unknown table, or a rank outside ``[0, MAX_WORLD_SIZE)``.
    """
    if table not in RANK_TABLES:
        raise ValueError(f"no per-rank table {table!r} (tables: {', '.join(RANK_TABLES)})")
    if type(rank) is not int or not 0 <= rank < MAX_WORLD_SIZE:
        raise ValueError(f"rank must be an int in [0, {MAX_WORLD_SIZE}), got {rank!r}")
    return f"{table}.rank{rank}.arrow"


def steps_file(rank: int) -> str:
    """File name of rank ``rank``'s step records."""
    return rank_file("steps", rank)


def trace_file(rank: int) -> str:
    """File name of rank ``rank``'s operator trace."""
    return rank_file("trace", rank)


DTYPE_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "int64": 8,
               "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
               "complex128": 16}
"""Bytes per element of every dtype a record may carry (the ``dtype`` column, torch's names)."""

RANK_FILE = re.compile(r"(ops|steps|trace)\.rank(0|[1-9][0-9]{0,5})\.arrow")
"""``rank_file(table, rank)`` names and nothing else (group 1: the table, group 2: the rank)."""


def parse_rank_file(name: str) -> tuple[str, int] | None:
    """``(table, rank)`` of a ``rank_file`` name, ``None`` for any other name."""
    m = RANK_FILE.fullmatch(name)
    return None if m is None else (m.group(1), int(m.group(2)))


def _schema(table: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(
        fields,
        metadata={b"drifttool.schema_version": str(SCHEMA_VERSION).encode(),
                  b"drifttool.table": table.encode()},
    )


_SUMMARY = [
    pa.field("dtype", pa.utf8(), nullable=False),  # "float32", "bfloat16", ...
    pa.field("shape", pa.list_(pa.int64()), nullable=False),  # canonical shape
    pa.field("digest", pa.uint64(), nullable=False),  # xxh3_64(dtype | shape | bytes)
    pa.field("nonfinite", pa.int64(), nullable=False),  # NaN + Inf count
    pa.field("l2", pa.float64(), nullable=False),  # fp64 L2 norm (summary, not identity)
    pa.field("maxabs", pa.float64(), nullable=False),
]

OPS_KEY = ("component", "phase", "step", "branch", "block", "stream", "op", "call", "index",
           "role", "sample")
"""Identity of an op record (the diff aligns on it; never on position, never on the rank)."""

OP_ORDER = ("phase", "step", "component", "role", "block", "op_pos", "index", "branch", "sample",
            "stream", "op", "call")
"""Program order of op records ("first drift"), rank-independent and the same for batched and
sequential CFG: phase (``PHASES``), step, component (``COMPONENTS``), role (outputs before
gradients, ``ROLES``; step records sit between them, ``drifttool.diff.order``), block in
execution order (−1 the input projections, 0..depth−1, depth the output part, then
``SAMPLER_BLOCK``), ``op_pos``, output index, branch (``BRANCHES``), logical sample; stream, op
and call only break ties between records that share a position (gradient records)."""

STEP_ORDER = ("phase", "step", "component", "quantity", "sample", "branch")
"""Program order of step records (``QUANTITIES``, then sample, then branch)."""

OPS_SCHEMA = _schema("ops", [
    pa.field("seq", pa.int64(), nullable=False),  # informational: execution order on this rank
    pa.field("rank", pa.int32(), nullable=False),  # owning rank: computed and holds the record
    pa.field("component", pa.utf8(), nullable=False),  # COMPONENTS: mmdit today
    pa.field("phase", pa.utf8(), nullable=False),  # rollout | train
    pa.field("step", pa.int32(), nullable=False),
    pa.field("sigma", pa.float64(), nullable=False),
    pa.field("branch", pa.utf8(), nullable=False),  # cond | uncond | cfg | none
    pa.field("block", pa.int32(), nullable=False),  # -1 before the blocks, depth after; sampler -2
    pa.field("op_pos", pa.int32(), nullable=False),  # ordinal of the call in (phase, step, branch, block)
    pa.field("stream", pa.utf8(), nullable=False),  # img | txt | joint | none
    pa.field("op", pa.utf8(), nullable=False),  # RFC operator name
    pa.field("call", pa.int32(), nullable=False),  # occurrence of (op, stream) in the scope
    pa.field("index", pa.int32(), nullable=False),  # output index for tuple outputs
    pa.field("role", pa.utf8(), nullable=False),  # output | grad_input | grad_weight
    pa.field("sample", pa.int32(), nullable=False),  # logical sample id, -1 = unbatched
    *_SUMMARY,
    pa.field("row_digests", pa.list_(pa.uint64())),  # L2 only: xxh3_64 per row of the S axis
    pa.field("txt_len", pa.int32()),  # L2: rows [0, txt_len) are the valid text tokens, in order
    pa.field("img_h", pa.int32()),  # L2: rows after them are image patches divmod(n, img_w)
    pa.field("img_w", pa.int32()),
    # TP/SP layouts (version 4; null elsewhere): each global rank's digest-v2 partial of the
    # record (what it holds of it: its block of a sharded output, its copy of a replicated one;
    # 0 for a rank outside the record's ranks), and the ranks whose copy of what is replicated
    # differs from the owning rank's ([] = every rank agrees; null = not checked on every rank)
    pa.field("rank_digests", pa.list_(pa.uint64())),
    pa.field("rank_disagree", pa.list_(pa.int32())),
])

RANK_COLUMNS = ("rank_digests", "rank_disagree")
"""Op columns added in version 4 (a version 3 file reads with them null)."""
OPS_SCHEMA_V3 = _schema("ops", [f for f in OPS_SCHEMA if f.name not in RANK_COLUMNS])
"""The version 3 op schema (``drifttool.artifact.reader`` reads it with ``RANK_COLUMNS`` null)."""

STEPS_KEY = ("component", "phase", "step", "sample", "branch", "quantity")
"""Identity of a step record (no rank: ``rank`` is the owning rank)."""

STEPS_SCHEMA = _schema("steps", [
    pa.field("seq", pa.int64(), nullable=False),  # informational: execution order on this rank
    pa.field("rank", pa.int32(), nullable=False),  # owning rank
    pa.field("component", pa.utf8(), nullable=False),
    pa.field("phase", pa.utf8(), nullable=False),
    pa.field("step", pa.int32(), nullable=False),
    pa.field("sigma", pa.float64(), nullable=False),
    pa.field("sigma_next", pa.float64(), nullable=False),
    pa.field("sample", pa.int32(), nullable=False),
    pa.field("branch", pa.utf8(), nullable=False),
    pa.field("quantity", pa.utf8(), nullable=False),  # x_t, v_t, x_next, mu, std_t, logp_t, ...
    *_SUMMARY,
    pa.field("data", pa.large_binary(), nullable=False),  # raw bytes, row-major
])

TRACE_SCHEMA = _schema("trace", [
    pa.field("rank", pa.int32()),  # the rank that made the calls
    pa.field("device", pa.utf8()),  # where the operator ran: "cpu", "cuda:0", ...
    pa.field("component", pa.utf8()),
    pa.field("op", pa.utf8()),
    pa.field("block", pa.int32()),
    pa.field("stream", pa.utf8()),
    pa.field("call", pa.int32()),
    pa.field("contract", pa.utf8()),
    pa.field("requested", pa.utf8()),
    pa.field("actual", pa.utf8()),
    pa.field("kernel", pa.utf8()),
    pa.field("fallback", pa.bool_()),
    pa.field("reason", pa.utf8()),
    pa.field("declared", pa.bool_()),
    pa.field("calls", pa.int64()),
])
"""Mirrors ``drifttool.capture.trace.TraceEntry``."""

SCHEMAS = {"ops": OPS_SCHEMA, "steps": STEPS_SCHEMA, "trace": TRACE_SCHEMA}


def block_name(block: int) -> str:
    """``block`` as people read it: ``"sampler"`` for ``SAMPLER_BLOCK``, else the number."""
    return "sampler" if block == SAMPLER_BLOCK else str(block)


def schema_version_of(schema: pa.Schema) -> int | None:
    """The ``drifttool.schema_version`` in an Arrow schema's metadata, or ``None``."""
    raw = (schema.metadata or {}).get(b"drifttool.schema_version")
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None
