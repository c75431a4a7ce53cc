"""The schema of ``manifest.json``: one declarative description of every key drifttool writes
into a manifest (a key the manifest schema does not account for is never ignored).

    >>> sorted(MANIFEST_SCHEMA.required)
    ['complete', 'files', 'fingerprint', 'schema_version']
    >>> section_problem({"kind": "rollout", "settings": {}})   # a run's manifest, cut short
    "missing section 'capture_level': a run's manifest holds kind, capture_level, settings, ..."
    >>> MANIFEST_SCHEMA.fields["capture_level"]
    Enum(values=('L0', 'L1', 'L2'))

A spec is one of: a tuple of JSON types (``int`` excludes ``bool``), ``Least`` (a number with a
lower bound), ``Enum``, ``ListOf`` (of any or of a fixed length), ``MapOf`` (free keys), ``Obj``
(known keys, each its spec; ``other`` the spec of any further key, or none allowed),
``Nullable``, or ``ANY`` (a free JSON value, e.g. an ``arch`` key of another model, which the
diff compares key by key).
``drifttool.artifact.manifest.check_manifest_value`` applies it. The Arrow tables' schemas and
the directory's file names are in ``drifttool.artifact.schema``. Constants whose owners import
torch (``MODES``, ``MODEL_DTYPES``, ``CFG_LAYOUTS``, ``TIMESTEP_POLICIES``, ``PRESETS``,
``LORA_MODES``) are repeated here for the torch-free reader; tests check they agree.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from drifttool.artifact.levels import LEVELS
from drifttool.artifact.schema import INPUTS


class Enum(NamedTuple):
    """One of ``values``."""
    values: tuple[Any, ...]


class ListOf(NamedTuple):
    """A JSON array whose items are ``item``, of ``length`` items (None: any number)."""
    item: Any
    length: int | None = None


class Least(NamedTuple):
    """A JSON number of ``types`` (a tuple of JSON types) at least ``least``, or above it when
    ``strict``; below ``below`` when given."""
    types: tuple[type, ...]
    least: int | float
    strict: bool = False
    below: int | float | None = None


class MapOf(NamedTuple):
    """A JSON object with any keys, whose values are ``value``."""
    value: Any


class Obj(NamedTuple):
    """A JSON object with keys from ``fields`` (each value its spec); ``required`` keys must be
    present; any other key is refused, or, with ``other``, is of that spec."""
    fields: dict[str, Any]
    required: frozenset[str] = frozenset()
    other: Any = None


class Nullable(NamedTuple):
    """``null`` or ``spec``."""
    spec: Any


ANY = "any JSON value"
_INT, _NUM, _STR, _BOOL = (int,), (int, float), (str,), (bool,)
_INTS = ListOf(_INT)
_SIZE = Least(_INT, 1)
_GRID = ListOf(_SIZE, 2)
"""An ``img_grid``: the (h, w) patch grid, two positive integers (pixels / 16)."""

KINDS = ("rollout", "recompute")
"""``kind``: a sampled trajectory (``drifttool run``/``replay``) or its training recompute."""
MODES = ("strict", "audit", "auto", "off")
"""``drifttool.runtime.Mode`` values (tests/artifact/test_damaged_runs.py checks they agree)."""
STRICT_MODES = ("strict", "audit")
"""The modes of the strict backend family (``drifttool.runtime.Mode.family``); the others request
the production family."""
MODEL_DTYPES = ("float32", "bfloat16")
"""``drifttool.setting_checks.DTYPES``: the model dtypes a run may use."""
CFG_LAYOUTS = ("batched", "sequential")
"""``drifttool.sampling.config.CFG_LAYOUTS``."""
TIMESTEP_POLICIES = ("sigma_fp32", "pipeline_bf16", "t_div_1000_fp32")
"""``drifttool.ops.scheduler.TIMESTEP_POLICIES``."""
PRESETS = ("diffusers", "diffusers-edit", "diffusers-edit-plus", "flow-grpo")
"""``drifttool.sampling.presets.PRESET_NAMES`` (tests/sampling/test_presets.py checks they agree)."""
LORA_MODES = ("merged", "fused", "unfused", "unfused-fp32")
"""``drifttool.model.lora.LORA_MODES`` (tests/model/test_lora_modes.py checks they agree)."""

_SETTINGS = Obj({
    "fixture": Nullable(_STR), "checkpoint": Nullable(_STR), "variant": _STR, "lora": _STR,
    "lora_mode": Enum(LORA_MODES),
    "mode": Enum(MODES), "capture": Enum(LEVELS), "dtype": Enum(MODEL_DTYPES),
    "cfg_layout": Enum(CFG_LAYOUTS), "timestep_policy": Enum(TIMESTEP_POLICIES),
    "steps": _SIZE, "cfg_scale": _NUM, "eta": Least(_NUM, 0),
    "seed": Nullable(Least(_INT, -(1 << 63), below=1 << 64)), "samples": _INTS,
    "img_grid": _GRID, "pad_prompts_to": _INT, "sample_labels": _INTS, "preset": Enum(PRESETS),
    "device": _STR, "internals": _BOOL,
    "input_files": MapOf(Obj({"path": _STR, "sha256": _STR}, frozenset({"path", "sha256"}))),
}, frozenset({"fixture", "checkpoint", "mode", "capture", "dtype", "cfg_layout",
              "timestep_policy", "steps", "cfg_scale", "eta", "seed", "samples", "img_grid"}))
"""``drifttool.settings.RunSettings.record``: the fixture's settings merged with the run's
(``seed`` null: a captured diffusers pipeline call, whose generator is not drifttool's;
``internals`` false: an L2 run without the fused attention's internals)."""

FIXTURE_SETTINGS = Obj({k: _SETTINGS.fields[k] for k in (
    "img_grid", "steps", "cfg_scale", "eta", "seed", "samples", "mode", "capture", "dtype",
    "cfg_layout", "timestep_policy", "preset")})
"""The ``settings`` of a fixture's ``fixture.json``: the run settings a fixture may set, each of
the type and range its run's manifest records (``drifttool.settings.resolve`` checks it)."""

_ENVIRONMENT = Obj({
    "drifttool": _STR, "python": _STR, "torch": _STR, "numpy": _STR, "platform": _STR,
    "machine": _STR, "cpu": Nullable(_STR), "cpu_count": Nullable(_INT), "torch_threads": _INT,
    "cpu_capability": Nullable(_STR), "aten_cpu_capability_env": Nullable(_STR),
    "cpu_matrix": Nullable(ListOf(_STR)), "cuda": Nullable(_STR), "gpu": Nullable(_STR),
})
"""``drifttool.environment.environment``."""

_ARCH = Obj({
    **{k: _SIZE for k in ("patch_size", "in_channels", "out_channels", "num_layers",
                          "attention_head_dim", "num_attention_heads", "joint_attention_dim",
                          "rope_theta", "mlp_ratio", "inner_dim", "out_dim", "mlp_dim")},
    "axes_dims_rope": ListOf(_SIZE, 3), "eps": Least(_NUM, 0, strict=True), "img_grid": _GRID,
}, other=ANY)
"""``fingerprint.arch``: ``MMDiTConfig.arch_fields()`` (sizes positive integers, three RoPE axes,
a positive ``eps``, as ``MMDiTConfig`` accepts them) and the run's ``img_grid``. The diff
compares every key, so a key of another model is kept (and compared) as it is."""

_FINGERPRINT = Obj({
    "version": _INT,
    "arch": _ARCH,
    "weights": _STR,
    "dtype_policy": Obj({"weights": _STR, "activations": _STR, "accumulation": _STR,
                         "latents_between_steps": _STR, "sde_step_and_logp": _STR,
                         "tf32": _BOOL}),
    "scheduler": Obj({"num_steps": _SIZE, "timestep_policy": Enum(TIMESTEP_POLICIES),
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
    "generator_device": _STR, "dtype": _STR, "seed": _INT, "channels": _INT, "img_grid": _GRID,
    "latent_shape": _INTS, "num_steps": _SIZE, "seed_derivation": _STR, "seed_formula": _STR,
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
    "use_dora": _BOOL, "alpha_given": _BOOL, "scale": Nullable(_NUM), "digest": _STR, "key_naming": _STR,
    "apply": _STR, "mode": Enum(LORA_MODES), "factor_dtype": _STR,
}, frozenset({"r", "lora_alpha", "target_modules", "digest"}))
"""``drifttool.model.lora_io.lora_record`` (``AdapterConfig.record`` + scale, digest)."""

_FILES = Obj({"inputs": Nullable(Enum((INPUTS,))), "steps": ListOf(_STR),
              "trace": ListOf(_STR), "ops": ListOf(_STR), "digests": MapOf(_STR)},
             frozenset({"inputs", "steps", "trace", "ops"}))
"""``drifttool.artifact.writer.ArtifactWriter``'s file list: ``steps``, ``trace`` and ``ops`` list
``rank_file`` names of their table (``RANK_FILE``), one per rank that wrote one; ``digests``
(schema version 5) maps each finished Parquet file to its ``drifttool.artifact.parquet.
file_digest`` (``drifttool.artifact.manifest.files_problem`` checks the names)."""

_CHAIN = Obj({
    "pipeline": _STR, "prompts": ListOf(_STR), "negative_prompts": Nullable(ListOf(_STR)),
    "max_sequence_length": _INT, "text_encoder_weights": _STR, "vae_weights": _STR,
    "images": ListOf(Obj({"path": _STR, "sha256": _STR}, frozenset({"path", "sha256"}))),
}, frozenset({"pipeline", "prompts", "text_encoder_weights", "vae_weights", "images"}))
"""``drifttool.chain``: a prompt run's pipeline folder, prompts (one per sample), the text
encoder's and VAE's weight digests and the PNGs written beside the artifact."""

_EDIT = Obj({
    "pipeline": _STR, "vae_weights": _STR, "vae_image_area": _SIZE, "prompt_image_area": _SIZE,
    "condition_images": ListOf(Obj({"path": _STR, "sha256": _STR, "size": ListOf(_SIZE), "vae_size": ListOf(_SIZE),
                                    "prompt_size": ListOf(_SIZE)}, frozenset({"path", "sha256"}))),
    "images": ListOf(Obj({"path": _STR, "sha256": _STR}, frozenset({"path", "sha256"}))),
    "prompts": ListOf(_STR), "negative_prompts": Nullable(ListOf(_STR)),
    "prompt_positions": Enum(("rope_index", "sequential")), "text_encoder_weights": _STR,
}, frozenset({"pipeline", "vae_weights", "condition_images", "images"}))
"""``drifttool.chain_edit``: an edit run's pipeline folder, its VAE's weight digest, the
condition images it encoded (each with its size and its resized sizes, [width, height]: the
VAE's, to about ``vae_image_area`` pixels, and under the edit-plus pipeline with prompts the
prompt image's, to about ``prompt_image_area``) and the PNGs written beside the artifact; with prompts encoded from
the images (``run --image --prompt``), the prompts (one per sample), the vision tokens' position
rule and the text encoder's weight digest (language model and vision tower)."""

STAGES = ("text_encoder", "vae_encode", "transformer", "vae_decode")
"""The stages of a captured pipeline call (``drifttool.adapters.pipeline_stages``), in program
order."""

_STAGE = Obj({
    "stage": Enum(STAGES), "component": _STR, "step": _INT, "calls": _INT,
    "prompts": ListOf(ListOf(_STR)), "weights": Nullable(_STR),
    "prompt_positions": Enum(("rope_index", "sequential")),
}, frozenset({"stage", "component", "step", "calls"}))
"""One stage a captured pipeline call recorded: its component, first step (−1 before the loop,
0 the loop, the steps run for the decode), number of calls (text-encoder calls, condition images,
scheduler steps, decodes), the prompts of each text-encoder call, the stage's weight digest (the
text encoder's language model, with its vision tower for an edit pipeline's prompts; the VAE), and
for an edit pipeline's prompts the language model's position rule (``rope_index``: it was handed
the multimodal RoPE positions; ``sequential``: none, it made 0…L−1)."""

MANIFEST_SCHEMA = Obj({
    "schema_version": _INT, "complete": _BOOL, "files": _FILES, "fingerprint": _FINGERPRINT,
    "kind": Enum(KINDS), "capture_level": Enum(LEVELS), "settings": _SETTINGS,
    "environment": _ENVIRONMENT, "replay": _REPLAY, "layout": _LAYOUT,
    "variants": ListOf(_STR), "model_source": _MODEL_SOURCE, "lora": _LORA,
    "source": _SOURCE, "replay_of": _SOURCE, "policy": _POLICY, "train": _TRAIN,
    "seconds": _NUM, "uncaptured": _UNCAPTURED, "checkpoint_warnings": ListOf(_STR),
    "chain": _CHAIN, "edit": _EDIT, "stages": ListOf(_STAGE),
}, frozenset({"schema_version", "complete", "files", "fingerprint"}))
"""Every key of ``manifest.json``: the writer's (``schema_version``, ``complete``, ``files``), the
recorder's ``capture_level``, ``drifttool.runner.execute``'s rollout manifest and
``drifttool.training.recompute.recompute_run``'s recompute manifest (``source``, ``policy``,
``train``, ``seconds``; a replay adds ``replay_of``)."""

RUN_SECTIONS = ("kind", "capture_level", "settings", "environment", "replay", "layout")
"""The sections every run's manifest holds (``drifttool run``, ``replay``, ``recompute``, a
captured pipeline or diffusers rollout, a re-executed step), whatever its kind: the readers need
each of them (the fingerprint is required of every manifest). ``FINISH_SECTIONS`` may be absent
from an incomplete run's (``complete: false``)."""
UNCAPTURED_SECTIONS = ("capture_level",)
"""Run sections a run in mode ``off`` (``settings.mode``: no capture, so no recorder to write
its level) does not hold; every other run's manifest does."""
FINISH_SECTIONS = ("replay",)
"""Run sections a writer may add only when the run finishes: a captured pipeline call writes its
replay record at the end (``drifttool.adapters.diffusers_pipeline``), so a call stopped midway
leaves none; a complete run's manifest always holds them."""
RUN_MARKERS = ("settings", "replay")
"""Keys only a run's manifest holds: a manifest with any of them is a run's and must hold every
``RUN_SECTIONS`` key (``section_problem``). A manifest with none (a bare artifact written by
``ArtifactWriter`` alone, as tools and tests write, perhaps with a ``kind``) needs only
``MANIFEST_SCHEMA.required``."""
KIND_REQUIRES = {"rollout": frozenset({"variants"}),
                 "recompute": frozenset({"source", "policy", "train"})}
"""Keys a manifest of that ``kind`` must hold besides ``RUN_SECTIONS`` (a rollout lists the
operators it replaced, none included; a recompute names its source and pinned policy)."""
KIND_FORBIDS = {"rollout": frozenset({"source", "policy", "train"})}
"""Keys a manifest of that ``kind`` never holds."""
KIND_PHASE = {"rollout": "rollout", "recompute": "train"}
"""The one record ``phase`` of a run of that ``kind``."""


def section_problem(manifest: dict[str, Any]) -> str | None:
    """The first section a run's manifest lacks (``RUN_MARKERS``, ``RUN_SECTIONS`` less
    ``FINISH_SECTIONS`` while incomplete and ``UNCAPTURED_SECTIONS`` in mode off,
    ``KIND_REQUIRES``), in words naming it, or None (a bare artifact's, or a whole one). Read
    before the values are checked against their specs; ``kind`` is one of ``KINDS`` or absent."""
    if not any(k in manifest for k in RUN_MARKERS):
        return None
    kind = manifest.get("kind")
    later = () if manifest.get("complete") is True else FINISH_SECTIONS
    settings = manifest.get("settings")
    if isinstance(settings, dict) and settings.get("mode") == "off":
        later = (*later, *UNCAPTURED_SECTIONS)
    want = [k for k in RUN_SECTIONS if k not in manifest and k not in later]
    if want:
        holds = ", ".join(RUN_SECTIONS)
        return f"missing section {want[0]!r}: a run's manifest holds {holds}"
    lacks = sorted(KIND_REQUIRES.get(kind, frozenset()) - set(manifest))
    if lacks:
        return (f"missing section {lacks[0]!r}: a {kind} manifest holds "
                f"{', '.join(sorted(KIND_REQUIRES[kind]))}")
    return None
