"""Every Arrow schema of the trajectory artifact, its version and its file names, in one place.

    run_dir/
      manifest.json          {"schema_version": 5, "complete": true, "capture_level": "L1",
                              "fingerprint": {...}, "files": {...}, ...}
      inputs.safetensors     replay inputs (initial latents, SDE noise, prompt embeddings, masks)
      steps.rank<r>.parquet  STEPS_SCHEMA: one row per (component, phase, step, sample, branch, quantity)
      ops.rank<r>.parquet    OPS_SCHEMA: one row per captured operator output per logical sample
      trace.rank<r>.parquet  TRACE_SCHEMA: one row per operator call site of rank r

Every rank ``r`` of ``layout.world_size`` writes its own ``<table>.rank<r>`` files; rank 0 also
writes ``manifest.json`` and ``inputs.safetensors``. A single process is rank 0 of world 1
(``drifttool.artifact.writer``); the reader presents every rank's records as one run, the
owning rank a column (``drifttool.artifact.reader``).

File formats (``suffix_fits``): while a run writes, op and step records go to Arrow IPC
*streams* (``<table>.rank<r>.arrows``, one record batch per step, flushed), so a run cut short
keeps its finished steps readable. When the writer closes, each stream becomes a Parquet file
(``<table>.rank<r>.parquet``, one row group per step) and the stream is removed: a finished
artifact is read by pyarrow (``pyarrow.parquet``, ``pyarrow.dataset``), Polars (``scan_parquet``)
and DuckDB (``read_parquet``) without drifttool (docs/artifacts.md). Schema versions 3 and 4
kept the streams (``<table>.rank<r>.arrow``); they still read. Each schema carries
``drifttool.schema_version`` and ``drifttool.table`` in its metadata, and every column its
meaning (``description``, and ``unit`` where it has one) in its field metadata;
``manifest.json`` repeats the version. Bump ``SCHEMA_VERSION`` on any change to a schema, to
the meaning of a column or to the files' format.

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

SCHEMA_VERSION = 5
SUPPORTED_SCHEMA_VERSIONS = frozenset({3, 4, SCHEMA_VERSION})
"""Versions this reader can open; anything else raises ``ArtifactError`` (``version_problem``).
Version 5 writes the finished tables as Parquet (``suffix_fits``; the columns are version
4's, with their meaning in the field metadata). Version 4 added the op records' ``rank_digests`` and ``rank_disagree`` (every rank's digest of a
record in a TP/SP layout, and the ranks whose copy of a replicated output disagrees); a version 3
file reads with both null (``RANK_COLUMNS``: not checked on every rank) and aligns with version
4 records (``ALIGNABLE_SCHEMA_VERSIONS``: the identity did not change). Version 3: ``rank`` left the identity keys (it is the owning rank), ``component``
joined them, op records carry the program position ``op_pos`` and the trace ``component``,
``rank`` and ``device``. Version 2 moved the sampler operators from block −1 to
``SAMPLER_BLOCK``. Older versions are refused: their records order "first" by a per-rank counter
and key on the rank."""


ALIGNABLE_SCHEMA_VERSIONS = frozenset({3, 4, 5})
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
"""Tables every rank writes to its own ``<table>.rank<r>`` file (``rank_file``)."""

MAX_WORLD_SIZE = 1_000_000
"""Ranks are 0 … 999999 (``RANK_FILE`` spells at most six digits)."""

PARQUET, STREAM, LEGACY_STREAM = ".parquet", ".arrows", ".arrow"
"""File name suffixes of the per-rank tables: a finished table (Parquet), a table being written
(Arrow IPC stream), a table of schema version 3 or 4 (Arrow IPC stream)."""

PARQUET_SINCE = 5
"""The first schema version whose finished tables are Parquet files (and whose streams are
``.arrows``); earlier versions wrote ``.arrow`` streams only."""


def suffix_fits(suffix: str, version: int) -> bool:
    """Whether a table file with ``suffix`` belongs to an artifact of schema ``version``. A
    complete run of version 5 or later holds Parquet only; an incomplete one also streams (its
    process died while writing them)."""
    return (suffix == LEGACY_STREAM) == (version < PARQUET_SINCE)


def rank_file(table: str, rank: int, suffix: str = PARQUET) -> str:
    """File name of rank ``rank``'s records of ``table`` (one of ``RANK_TABLES``): the finished
    Parquet file, or the file of another suffix (``STREAM``, ``LEGACY_STREAM``).

    Raises:
        ValueError: an unknown table or suffix, or a rank outside ``[0, MAX_WORLD_SIZE)``.
    """
    if table not in RANK_TABLES:
        raise ValueError(f"no per-rank table {table!r} (tables: {', '.join(RANK_TABLES)})")
    if type(rank) is not int or not 0 <= rank < MAX_WORLD_SIZE:
        raise ValueError(f"rank must be an int in [0, {MAX_WORLD_SIZE}), got {rank!r}")
    if suffix not in (PARQUET, STREAM, LEGACY_STREAM):
        raise ValueError(f"no table file suffix {suffix!r}")
    return f"{table}.rank{rank}{suffix}"


def steps_file(rank: int) -> str:
    """File name of rank ``rank``'s finished step records."""
    return rank_file("steps", rank)


def trace_file(rank: int) -> str:
    """File name of rank ``rank``'s operator trace."""
    return rank_file("trace", rank)


DTYPE_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "int64": 8,
               "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
               "complex128": 16}
"""Bytes per element of every dtype a record may carry (the ``dtype`` column, torch's names)."""

RANK_FILE = re.compile(r"(ops|steps|trace)\.rank(0|[1-9][0-9]{0,5})(\.parquet|\.arrows|\.arrow)")
"""``rank_file(table, rank, suffix)`` names and nothing else (group 1: the table, group 2: the
rank, group 3: the suffix)."""


def parse_rank_file(name: str) -> tuple[str, int, str] | None:
    """``(table, rank, suffix)`` of a ``rank_file`` name, ``None`` for any other name."""
    m = RANK_FILE.fullmatch(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def _schema(table: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(
        fields,
        metadata={b"drifttool.schema_version": str(SCHEMA_VERSION).encode(),
                  b"drifttool.table": table.encode()},
    )


def _col(name: str, type_: pa.DataType, meaning: str, *, nullable: bool = True,
         unit: str | None = None) -> pa.Field:
    """A column with its meaning in the field metadata (``description``; ``unit`` where the
    values have one), which Arrow and Parquet readers show next to the type."""
    meta = {b"description": meaning.encode()}
    if unit is not None:
        meta[b"unit"] = unit.encode()
    return pa.field(name, type_, nullable=nullable, metadata=meta)


_SEQ = "informational: execution order of the record on its rank; never used for alignment"
_RANK = "owning rank: the rank that computed and holds the record (not part of its identity)"
_COMPONENT = f"the model: one of {', '.join(components.COMPONENTS)} (in program order)"
_PHASE = "rollout (sampling) or train (training recompute); rollout comes first"
_STEP = "denoising step, 0-based (-1: before the first step)"
_SIGMA = "sigma of the step (NaN before the first step)"
_SAMPLE = "logical sample id (the batch position does not matter); -1 = unbatched"

_SUMMARY = [
    _col("dtype", pa.utf8(), "torch dtype name of the tensor: float32, bfloat16, ...",
         nullable=False),
    _col("shape", pa.list_(pa.int64()), "canonical (unsharded, unbatched) shape", nullable=False),
    _col("digest", pa.uint64(), "digest v2 of (dtype, shape, bytes): equal digests mean equal "
         "bytes (docs/digest.md)", nullable=False),
    _col("nonfinite", pa.int64(), "number of NaN and Inf elements", nullable=False,
         unit="elements"),
    _col("l2", pa.float64(), "L2 norm, computed in float64, in the tensor's own units (a "
         "summary, not identity)", nullable=False),
    _col("maxabs", pa.float64(), "largest absolute element, in the tensor's own units (a "
         "summary)", nullable=False),
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
    _col("seq", pa.int64(), _SEQ, nullable=False),
    _col("rank", pa.int32(), _RANK, nullable=False),
    _col("component", pa.utf8(), _COMPONENT, nullable=False),
    _col("phase", pa.utf8(), _PHASE, nullable=False),
    _col("step", pa.int32(), _STEP, nullable=False),
    _col("sigma", pa.float64(), _SIGMA, nullable=False, unit="noise level (sigma)"),
    _col("branch", pa.utf8(), "CFG branch, in program order cond, uncond, cfg (the combined "
         "prediction), none (outside CFG)", nullable=False),
    _col("block", pa.int32(), "transformer block in execution order: -1 before the blocks, "
         "0..depth-1, depth after them; -2 the sampler (flow_sigma_table, cfg_combine_renorm, "
         "flow_sde_step_logp), which runs after the model: order it last", nullable=False),
    _col("op_pos", pa.int32(), "program position: ordinal of the call among all operator calls "
         "of its (component, phase, step, branch, block), from 0; orders records inside a block, "
         "the same on every rank and layout", nullable=False),
    _col("stream", pa.utf8(), "token stream: img, txt, joint or none", nullable=False),
    _col("op", pa.utf8(), "RFC operator name", nullable=False),
    _col("call", pa.int32(), "occurrence of (op, stream) in its (component, phase, step, "
         "branch, block), from 0", nullable=False),
    _col("index", pa.int32(), "output index of an operator with a tuple output, else 0",
         nullable=False),
    _col("role", pa.utf8(), "output, internal (a fused operator's internal tensor), then the "
         "backward's grad_input, grad_weight, in that order", nullable=False),
    _col("sample", pa.int32(), _SAMPLE, nullable=False),
    *_SUMMARY,
    _col("row_digests", pa.list_(pa.uint64()), "L2 only: digest per row of the sequence axis "
         "(null below L2)"),
    _col("txt_len", pa.int32(), "L2: rows [0, txt_len) are the prompt's valid text tokens, in "
         "order", unit="rows"),
    _col("img_h", pa.int32(), "L2: image rows follow the text rows, patch n at (n // img_w, "
         "n % img_w) of an img_h x img_w grid", unit="patches"),
    _col("img_w", pa.int32(), "L2: width of the image patch grid", unit="patches"),
    _col("rank_digests", pa.list_(pa.uint64()), "TP/SP layouts: each global rank's digest-v2 "
         "partial of the record (0 for a rank outside the record's ranks); null elsewhere"),
    _col("rank_disagree", pa.list_(pa.int32()), "TP/SP layouts: ranks whose copy of a "
         "replicated output differs from the owning rank's ([] = all agree; null = not checked "
         "on every rank)"),
])

RANK_COLUMNS = ("rank_digests", "rank_disagree")
"""Op columns added in version 4 (a version 3 file reads with them null)."""
OPS_SCHEMA_V3 = _schema("ops", [f for f in OPS_SCHEMA if f.name not in RANK_COLUMNS])
"""The version 3 op schema (``drifttool.artifact.reader`` reads it with ``RANK_COLUMNS`` null)."""

STEPS_KEY = ("component", "phase", "step", "sample", "branch", "quantity")
"""Identity of a step record (no rank: ``rank`` is the owning rank)."""

STEPS_SCHEMA = _schema("steps", [
    _col("seq", pa.int64(), _SEQ, nullable=False),
    _col("rank", pa.int32(), _RANK, nullable=False),
    _col("component", pa.utf8(), _COMPONENT, nullable=False),
    _col("phase", pa.utf8(), _PHASE, nullable=False),
    _col("step", pa.int32(), _STEP, nullable=False),
    _col("sigma", pa.float64(), _SIGMA, nullable=False, unit="noise level (sigma)"),
    _col("sigma_next", pa.float64(), "sigma of the next step", nullable=False,
         unit="noise level (sigma)"),
    _col("sample", pa.int32(), _SAMPLE, nullable=False),
    _col("branch", pa.utf8(), "cond, uncond, cfg or none", nullable=False),
    _col("quantity", pa.utf8(), "x_t, v_t, mu, std_t, x_next, logp_t (in program order)",
         nullable=False),
    *_SUMMARY,
    _col("data", pa.large_binary(), "the tensor's raw bytes, row-major, of its dtype and shape",
         nullable=False),
])

TRACE_SCHEMA = _schema("trace", [
    _col("rank", pa.int32(), "the rank that made the calls"),
    _col("device", pa.utf8(), "where the operator ran: cpu, cuda:0, ..."),
    _col("component", pa.utf8(), _COMPONENT),
    _col("op", pa.utf8(), "RFC operator name"),
    _col("block", pa.int32(), "block of the call site (-2 the sampler)"),
    _col("stream", pa.utf8(), "token stream: img, txt, joint or none"),
    _col("call", pa.int32(), "occurrence of (op, stream) in the block"),
    _col("contract", pa.utf8(), "arithmetic contract id of the implementation"),
    _col("requested", pa.utf8(), "backend the runtime mode asked for"),
    _col("actual", pa.utf8(), "backend that ran"),
    _col("kernel", pa.utf8(), "kernel identity"),
    _col("fallback", pa.bool_(), "the call fell back from the requested backend"),
    _col("reason", pa.utf8(), "why it fell back (empty without a fallback)"),
    _col("declared", pa.bool_(), "the fallback is a declared one (strict mode refuses "
         "undeclared fallbacks)"),
    _col("calls", pa.int64(), "number of calls at this call site", unit="calls"),
])
"""Mirrors ``drifttool.capture.trace.TraceEntry``."""

SCHEMAS = {"ops": OPS_SCHEMA, "steps": STEPS_SCHEMA, "trace": TRACE_SCHEMA}


BEFORE_BLOCKS = -1
"""``block`` of the records made before a component's first block (the MMDiT's timestep
embedding and input projections, the text encoder's token embedding, the VAE outside its
blocks). Reports say it in words (``block_name``, ``short_block``, ``block_words``), as they
say the MMDiT's records after its last block (``block`` = its number of blocks:
``model_blocks``)."""


def model_blocks(manifest: dict[str, Any] | None, component: str | None) -> int | None:
    """The number of blocks of ``component`` in the run of ``manifest``, where the manifest
    records it: the MMDiT's ``fingerprint.arch.num_layers`` (its records after the last block,
    the final norm and output projection, carry ``block`` = that number); ``None`` for another
    component (the text encoder's depth is not recorded; the VAE numbers its stages) or a
    manifest without it."""
    if (component or DEFAULT_COMPONENT) != DEFAULT_COMPONENT:
        return None
    layers = (((manifest or {}).get("fingerprint") or {}).get("arch") or {}).get("num_layers")
    return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None


def _after(block: int, blocks: int | None) -> bool:
    """Whether ``block`` is a record after the last of ``blocks`` blocks (``model_blocks``)."""
    return blocks is not None and block == blocks


def block_name(block: int, blocks: int | None = None) -> str:
    """``block`` as a table cell: ``"sampler"`` for ``SAMPLER_BLOCK``, ``"before 0"`` for
    ``BEFORE_BLOCKS`` (as ``step_name`` says step −1), ``"after <n-1>"`` for a record after the
    last of ``blocks`` blocks (``model_blocks``; the final norm, the output projection), else
    the number."""
    return ("sampler" if block == SAMPLER_BLOCK else "before 0" if block == BEFORE_BLOCKS
            else f"after {block - 1}" if _after(block, blocks) else str(block))


def short_block(block: int, blocks: int | None = None) -> str:
    """``block`` in a short cell or site: ``b<n>``, ``before b0`` (``BEFORE_BLOCKS``), ``after
    b<n-1>`` (after the last of ``blocks`` blocks) or ``sampler`` (``SAMPLER_BLOCK``)."""
    return ("sampler" if block == SAMPLER_BLOCK else "before b0" if block == BEFORE_BLOCKS
            else f"after b{block - 1}" if _after(block, blocks) else f"b{block}")


def block_words(block: int, blocks: int | None = None) -> str:
    """``block`` in a one-line location: ``block <n>``, ``before block 0`` (``BEFORE_BLOCKS``),
    ``after block <n-1>`` (after the last of ``blocks`` blocks) or ``sampler``
    (``SAMPLER_BLOCK``)."""
    return ("sampler" if block == SAMPLER_BLOCK else "before block 0" if block == BEFORE_BLOCKS
            else f"after block {block - 1}" if _after(block, blocks) else f"block {block}")


def names_one(value: Any) -> bool:
    """Whether a record's branch or stream field names one: not ``none`` (a record of no CFG
    branch or no stream), not empty, not absent."""
    return value not in (None, "", "none")


def short_site(block: int, stream: Any, op: str, call: int, blocks: int | None = None) -> str:
    """A call site in a short cell or line: ``b0 img qk_rmsnorm#1``, ``before b0
    timestep_embed_mlp#0``, ``after b1 img final_adaln_out#0`` (``short_block``; a stream
    ``none`` left out, as a table's cell shows it ``-``: ``label``)."""
    return " ".join([short_block(block, blocks), *([str(stream)] if names_one(stream) else []),
                     f"{op}#{call}"])


BEFORE_STEPS = "before 0"
"""A step cell of the records made before the first step (step −1: the sigma table)."""


def step_name(step: int) -> str:
    """``step`` as a table cell: ``BEFORE_STEPS`` for the records made before the first step
    (−1), else the number."""
    return BEFORE_STEPS if step < 0 else str(step)


def label(value: Any) -> str:
    """A branch, stream or sample cell: ``-`` for a record of no branch or stream (``none``) or of
    no one sample (−1), else the value."""
    return "-" if not names_one(value) or (isinstance(value, int) and value < 0) else str(value)


def schema_version_of(schema: pa.Schema) -> int | None:
    """The ``drifttool.schema_version`` in an Arrow schema's metadata, or ``None``."""
    raw = (schema.metadata or {}).get(b"drifttool.schema_version")
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None
