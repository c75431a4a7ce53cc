"""Every Arrow schema of the trajectory artifact, and its version, in one place.

    run_dir/
      manifest.json        {"schema_version": 2, "complete": true, "capture_level": "L1",
                            "fingerprint": {...}, "files": {...}, ...}
      inputs.safetensors   replay inputs (initial latents, SDE noise, prompt embeddings, masks)
      steps.arrow          STEPS_SCHEMA: one row per (rank, phase, step, sample, branch, quantity)
      ops.rank<r>.arrow    OPS_SCHEMA: one row per captured operator output per logical sample
      trace.arrow          TRACE_SCHEMA: one row per operator call site

Arrow files use the IPC *stream* format (one record batch per step, flushed), so a run cut short
keeps its finished steps readable; ``pyarrow.ipc.open_stream`` reads them without drifttool
(design.md, "Artifact"). Each schema carries ``drifttool.schema_version`` and
``drifttool.table`` in its metadata; ``manifest.json`` repeats the version. Bump
``SCHEMA_VERSION`` on any change to a schema or to the meaning of a column.

Identity columns follow design.md, "Identity of a captured tensor". Strings are plain ``utf8``
(not dictionary-encoded) so DuckDB and Polars read them without dictionary replacement.
"""

from __future__ import annotations

import re

import pyarrow as pa

SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = frozenset({SCHEMA_VERSION})
"""Versions this reader can open; anything else raises ``ArtifactError``. Version 2 moved the
sampler operators from block −1 to ``SAMPLER_BLOCK``; version 1 artifacts are refused (their
block −1 mixes the model's input projections with the sampler)."""

SAMPLER_BLOCK = -2
"""``block`` of the sampler operators (``flow_sigma_table``, ``cfg_combine_renorm``,
``flow_sde_step_logp``): outside the model, neither before the blocks (−1) nor after them
(``num_layers``). Reports name it ``sampler`` (``block_name``)."""

MANIFEST = "manifest.json"
INPUTS = "inputs.safetensors"
STEPS = "steps.arrow"
TRACE = "trace.arrow"
LEVELS = ("L0", "L1", "L2")
"""Capture levels: L0 step records only, L1 plus one digest per operator output and sample,
L2 plus row digests. (L3, full tensors, is not implemented.)"""


def ops_file(rank: int) -> str:
    """File name of rank ``rank``'s operator records."""
    return f"ops.rank{rank}.arrow"


DTYPE_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "int64": 8,
               "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
               "complex128": 16}
"""Bytes per element of every dtype a record may carry (the ``dtype`` column, torch's names)."""

OPS_NAME = re.compile(r"ops\.rank(0|[1-9][0-9]{0,5})\.arrow")
"""``ops_file(rank)`` names and nothing else (group 1: the rank)."""


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

OPS_KEY = ("rank", "phase", "step", "branch", "block", "stream", "op", "call", "index", "role",
           "sample")
"""Identity of an op record (the diff aligns on it; never on position)."""

OPS_SCHEMA = _schema("ops", [
    pa.field("seq", pa.int64(), nullable=False),  # execution order on this rank (shared with steps)
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("phase", pa.utf8(), nullable=False),  # rollout | train
    pa.field("step", pa.int32(), nullable=False),
    pa.field("sigma", pa.float64(), nullable=False),
    pa.field("branch", pa.utf8(), nullable=False),  # cond | uncond | cfg | none
    pa.field("block", pa.int32(), nullable=False),  # -1 before the blocks, depth after; sampler -2
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
])

STEPS_KEY = ("rank", "phase", "step", "sample", "branch", "quantity")
"""Identity of a step record."""

STEPS_SCHEMA = _schema("steps", [
    pa.field("seq", pa.int64(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),
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
