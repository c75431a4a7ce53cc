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
from typing import Any, NamedTuple

import pyarrow as pa

from drifttool import components
from drifttool.capture import levels

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
"""Capture levels (``drifttool.capture.levels``)."""


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


def ops_file(rank: int) -> str:
    """File name of rank ``rank``'s operator records."""
    return rank_file("ops", rank)


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
OPS_NAME = re.compile(r"ops\.rank(0|[1-9][0-9]{0,5})\.arrow")
"""``ops_file(rank)`` names and nothing else (group 1: the rank)."""


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


# -- manifest.json ---------------------------------------------------------------------------------
# One declarative description of every key drifttool writes into a manifest (a key the
# manifest schema does not account for is never ignored). A spec is one of: a tuple of JSON types
# (``int`` excludes ``bool``), ``Enum``, ``ListOf``, ``MapOf`` (free keys), ``Obj`` (known keys),
# ``Nullable``, or ``ANY`` (a free JSON value, e.g. the model's ``arch`` fields, which the diff
# compares key by key). ``drifttool.artifact.reader.check_manifest_value`` applies it.


class Enum(NamedTuple):
    """One of ``values``."""
    values: tuple[Any, ...]


class ListOf(NamedTuple):
    """A JSON array whose items are ``item``."""
    item: Any


class MapOf(NamedTuple):
    """A JSON object with any keys, whose values are ``value``."""
    value: Any


class Obj(NamedTuple):
    """A JSON object with keys from ``fields`` only (each value its spec); ``required`` keys must
    be present."""
    fields: dict[str, Any]
    required: frozenset[str] = frozenset()


class Nullable(NamedTuple):
    """``null`` or ``spec``."""
    spec: Any


ANY = "any JSON value"
_INT, _NUM, _STR, _BOOL = (int,), (int, float), (str,), (bool,)
_INTS = ListOf(_INT)

KINDS = ("rollout", "recompute")
"""``kind``: a sampled trajectory (``drifttool run``/``replay``) or its training recompute."""
MODES = ("strict", "audit", "auto", "off")
"""``drifttool.runtime.Mode`` values (tests/artifact/test_manifest_schema.py checks they agree)."""
MODEL_DTYPES = ("float32", "bfloat16")
"""``drifttool.settings.DTYPES``: the model dtypes a run may use."""
CFG_LAYOUTS = ("batched", "sequential")
"""``drifttool.sampling.rollout.CFG_LAYOUTS``."""
TIMESTEP_POLICIES = ("sigma_fp32", "pipeline_bf16", "t_div_1000_fp32")
"""``drifttool.ops.scheduler.TIMESTEP_POLICIES``."""
PRESETS = ("diffusers", "flow-grpo")
"""``drifttool.sampling.presets.PRESET_NAMES`` (tests/sampling/test_presets.py checks they agree)."""
LORA_MODES = ("merged", "fused", "unfused", "unfused-fp32")
"""``drifttool.model.lora.LORA_MODES`` (tests/model/test_lora_modes.py checks they agree)."""

_SETTINGS = Obj({
    "fixture": Nullable(_STR), "checkpoint": Nullable(_STR), "variant": _STR, "lora": _STR,
    "lora_mode": Enum(LORA_MODES),
    "mode": Enum(MODES), "capture": Enum(LEVELS), "dtype": Enum(MODEL_DTYPES),
    "cfg_layout": Enum(CFG_LAYOUTS), "timestep_policy": Enum(TIMESTEP_POLICIES),
    "steps": _INT, "cfg_scale": _NUM, "eta": _NUM, "seed": Nullable(_INT), "samples": _INTS,
    "img_grid": _INTS, "pad_prompts_to": _INT, "sample_labels": _INTS, "preset": Enum(PRESETS),
    "device": _STR,
    "input_files": MapOf(Obj({"path": _STR, "sha256": _STR}, frozenset({"path", "sha256"}))),
}, frozenset({"fixture", "checkpoint", "mode", "capture", "dtype", "cfg_layout",
              "timestep_policy", "steps", "cfg_scale", "eta", "seed", "samples", "img_grid"}))
"""``drifttool.settings.RunSettings.record``: the fixture's settings merged with the run's
(``seed`` null: a captured diffusers pipeline call, whose generator is not drifttool's)."""

_ENVIRONMENT = Obj({
    "drifttool": _STR, "python": _STR, "torch": _STR, "numpy": _STR, "platform": _STR,
    "machine": _STR, "cpu": Nullable(_STR), "cpu_count": Nullable(_INT), "torch_threads": _INT,
    "cpu_capability": Nullable(_STR), "aten_cpu_capability_env": Nullable(_STR),
    "cuda": Nullable(_STR), "gpu": Nullable(_STR),
})
"""``drifttool.environment.environment``."""

_FINGERPRINT = Obj({
    "version": _INT,
    "arch": MapOf(ANY),  # MMDiTConfig.arch_fields() + img_grid; the diff compares every key
    "weights": _STR,
    "dtype_policy": Obj({"weights": _STR, "activations": _STR, "accumulation": _STR,
                         "latents_between_steps": _STR, "sde_step_and_logp": _STR,
                         "tf32": _BOOL}),
    "scheduler": Obj({"num_steps": _INT, "timestep_policy": Enum(TIMESTEP_POLICIES),
                      "image_seq_len": Nullable(_INT), "sigma_table": ListOf(_NUM),
                      "sigma_table_digest": _STR}),
    "cfg": Obj({"cfg_scale": _NUM, "cfg_layout": Enum(CFG_LAYOUTS)}),
    "sde": Obj({"eta": _NUM, "sde_window": Nullable(_INTS), "logp_reduction": _STR}),
    "runtime": Obj({"mode": Enum(MODES), "backend": Enum(("strict", "production"))}),
    "inputs": Obj({"rope_tables": _STR, "noise": Nullable(_STR),
                   "cpu_capability": Nullable(_STR)}),
})
"""``drifttool.fingerprint.arch_fingerprint``."""

_NOISE = Obj({
    "generator": _STR, "dispatch_dependent": _BOOL, "numpy_version": _STR, "torch_version": _STR,
    "generator_device": _STR, "dtype": _STR, "seed": _INT, "channels": _INT, "img_grid": _INTS,
    "latent_shape": _INTS, "num_steps": _INT, "seed_derivation": _STR, "seed_formula": _STR,
    "bits": _STR, "transform": _STR, "consumption_order": ListOf(_STR),
}, frozenset({"generator", "dispatch_dependent", "generator_device", "dtype", "seed",
              "channels", "img_grid", "latent_shape", "num_steps", "seed_derivation",
              "seed_formula", "consumption_order"}))
"""``drifttool.sampling.noise.noise_record`` (Philox and torch generators)."""

_REPLAY = Obj({
    "noise": Nullable(_NOISE), "inputs": Enum((INPUTS,)), "prompt_lengths": _INTS,
    "input_digests": MapOf(_STR),
}, frozenset({"noise", "inputs", "prompt_lengths", "input_digests"}))
"""``drifttool.runner.execute``'s replay record."""

LAYOUT_KINDS = ("single", "sample_parallel", "parallel")
"""``layout.kind``: one process, the batch's logical samples split across ranks
(``drifttool.distributed.samples``), or a TP/SP/CFG-parallel plan (``drifttool.distributed.plan``:
degrees in ``tp``, ``sp``, ``cfg_parallel``, ``sp_attention``)."""

_LAYOUT = Obj({"world_size": _INT, "kind": Enum(LAYOUT_KINDS), "tp": _INT, "sp": _INT,
               "cfg_parallel": _INT, "cfg_layout": Enum(CFG_LAYOUTS),
               "sp_attention": Enum(("agrs", "ulysses", "ring")),
               "mesh": Obj({"dims": ListOf(_STR), "shape": _INTS}, frozenset({"dims", "shape"})),
               "samples": MapOf(_INTS)},
              frozenset({"world_size"}))
"""How the run was laid out over ranks. ``world_size`` (written by the writer: the ranks that
wrote the artifact) is the only required key; ``samples`` maps each rank (``"0"``, ``"1"``, …)
to the logical sample ids it ran (``sample_parallel``); ``mesh`` names the ``DeviceMesh``
dimensions and sizes (``drifttool.distributed.context``)."""

_MODEL_SOURCE = Obj({"implementation": _STR, "adapter": _STR, "diffusers_version": Nullable(_STR),
                     "scheduler": _STR, "scheduler_config": MapOf(ANY)},
                    frozenset({"implementation", "adapter"}))
"""``drifttool.adapters.diffusers_qwenimage``'s ``source``; a captured pipeline call
(``drifttool.adapters.diffusers_pipeline``) adds its scheduler's class and configuration."""

_UNCAPTURED = Obj({"steps": ListOf(_STR), "ops": ListOf(Obj({"op": _STR, "index": _INT},
                                                              frozenset({"op", "index"}))),
                   "reason": _STR}, frozenset({"steps", "ops", "reason"}))
"""Records a drifttool rollout writes that this run cannot (``drifttool.adapters.
diffusers_pipeline.UNCAPTURED``): step quantities by name, op outputs by (op, index). The diff
leaves them out of both runs (``drifttool.diff.uncaptured``)."""

_SOURCE = Obj({
    "path": _STR, "kind": Enum(KINDS), "mode": Enum(MODES), "weights": Nullable(_STR),
    "complete": _BOOL, "variants": ListOf(_STR), "model_source": Nullable(_MODEL_SOURCE),
}, frozenset({"path", "kind", "mode", "weights", "complete", "variants"}))
"""``drifttool.training.stored.source_record``: the run a recompute or replay was made from."""

_POLICY = Obj({
    "timestep_policy": Enum(TIMESTEP_POLICIES), "cfg_layout": Enum(CFG_LAYOUTS),
    "cfg_scale": _NUM, "eta": _NUM, "sde_window": Nullable(_INTS),
    "stored_latent_dtype": Nullable(_STR), "logp_evaluated_on": _STR,
    "sigma_table_digest": Nullable(_STR), "timesteps": ListOf(_NUM),
}, frozenset({"timestep_policy", "cfg_layout", "cfg_scale", "eta"}))
"""``drifttool.training.recompute.policy_record``."""

_TRAIN = Obj({"phase": Enum(("train",)), "autograd": _BOOL, "grad": _BOOL,
              "loss": Nullable(_STR), "gradient_checkpointing": _BOOL,
              "micro_batch": Nullable(_INT), "trim_padding": _BOOL,
              "gradient_reduction": Nullable(_STR)},
             frozenset({"phase", "autograd", "grad"}))

_LORA = Obj({
    "r": _INT, "lora_alpha": _NUM, "target_modules": (str, list), "use_rslora": _BOOL,
    "rank_pattern": MapOf(_INT), "alpha_pattern": MapOf(_NUM), "lora_dropout": _NUM,
    "alpha_given": _BOOL, "scale": Nullable(_NUM), "digest": _STR, "key_naming": _STR,
    "apply": _STR, "mode": Enum(LORA_MODES), "factor_dtype": _STR,
}, frozenset({"r", "lora_alpha", "target_modules", "digest"}))
"""``drifttool.model.lora_io.lora_record`` (``AdapterConfig.record`` + scale, digest)."""

_FILES = Obj({"inputs": Nullable(Enum((INPUTS,))), "steps": ListOf(_STR),
              "trace": ListOf(_STR), "ops": ListOf(_STR)},
             frozenset({"inputs", "steps", "trace", "ops"}))
"""``drifttool.artifact.writer.ArtifactWriter``'s file list: ``steps``, ``trace`` and ``ops`` list
``rank_file`` names of their table (``RANK_FILE``), one per rank that wrote one."""

MANIFEST_SCHEMA = Obj({
    "schema_version": _INT, "complete": _BOOL, "files": _FILES, "fingerprint": _FINGERPRINT,
    "kind": Enum(KINDS), "capture_level": Enum(LEVELS), "settings": _SETTINGS,
    "environment": _ENVIRONMENT, "replay": _REPLAY, "layout": _LAYOUT,
    "variants": ListOf(_STR), "model_source": _MODEL_SOURCE, "lora": _LORA,
    "source": _SOURCE, "replay_of": _SOURCE, "policy": _POLICY, "train": _TRAIN,
    "seconds": _NUM, "uncaptured": _UNCAPTURED, "checkpoint_warnings": ListOf(_STR),
}, frozenset({"schema_version", "complete", "files", "fingerprint"}))
"""Every key of ``manifest.json``: the writer's (``schema_version``, ``complete``, ``files``), the
recorder's ``capture_level``, ``drifttool.runner.execute``'s rollout manifest and
``drifttool.training.recompute.recompute_run``'s recompute manifest (``source``, ``policy``,
``train``, ``seconds``; a replay adds ``replay_of``)."""

KIND_REQUIRES = {"recompute": frozenset({"source", "policy", "train"})}
"""Keys a manifest of that ``kind`` must hold (a recompute names its source and pinned policy)."""
KIND_FORBIDS = {"rollout": frozenset({"source", "policy", "train"})}
"""Keys a manifest of that ``kind`` never holds."""
KIND_PHASE = {"rollout": "rollout", "recompute": "train"}
"""The one record ``phase`` of a run of that ``kind``."""
