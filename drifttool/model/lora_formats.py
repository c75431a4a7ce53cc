"""LoRA adapter files exactly as peft and diffusers write them: one reader, one writer.

    >>> tensors, cfg = read_adapter("adapter/")   # {"<module>.lora_A.weight": [r, in], ...}
    >>> cfg.scale("transformer_blocks.0.attn.to_q")          # lora_alpha / r (or / sqrt(r), rsLoRA)
    >>> write_adapter("adapter/", tensors, cfg)               # peft folder + diffusers file

The three layouts (read from peft 0.21.2 and diffusers 0.42.1; ``<module>`` is a module name of
diffusers' ``QwenImageTransformer2DModel``, e.g. ``transformer_blocks.0.attn.to_q``):

* peft ``PeftModel.save_pretrained``: ``adapter_model.safetensors`` with keys
  ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``; the config
  (``LoraConfig.to_dict()``) in ``adapter_config.json``.
* diffusers ``ModelMixin.save_lora_adapter``: ``pytorch_lora_weights.safetensors`` with keys
  ``<module>.lora_A.weight``; the same config as JSON in the safetensors metadata key
  ``lora_adapter_metadata``.
* diffusers ``QwenImagePipeline.save_lora_weights``: the same file name and metadata key, with
  every tensor key and every config key prefixed ``transformer.``.

``write_adapter`` writes a folder that is both a peft adapter (first layout) and a diffusers LoRA
(third layout, the one ``QwenImagePipeline.load_lora_weights`` and
``load_lora_adapter(..., prefix="transformer")`` read), with the same FP32 tensors and config.
Reading a folder takes every layout present; when both are there they must agree bit for bit.

Scale (peft ``LoraLayer.update_layer``): per module, ``r`` and ``lora_alpha`` come from
``rank_pattern`` / ``alpha_pattern`` (first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", module)``,
peft's ``get_pattern_key``), else the config's ``r`` / ``lora_alpha``; scale = α/r, or α/√r with
``use_rslora``. A file with no config at all (no ``adapter_config.json``, no metadata) gets
diffusers' convention for alpha-less LoRAs: α = r per module (scale 1, ``W + B·A``); the config
then says ``alpha_given: false`` so the manifest shows it.

Also read: kohya-style files (``lora_unet_…`` names, ``.lora_down`` / ``.lora_up`` / ``.alpha``),
converted as diffusers' Qwen-Image loader converts them (``from_kohya``: alpha folded into the
factors); DoRA (``use_dora``: ``<module>.lora_magnitude_vector`` ``[out]``); ``all-linear``.

Refused (fail closed, one error naming the fields): anything but ``peft_type`` LORA;
``lora_bias``, ``bias`` other than ``"none"`` (base biases saved in the adapter),
``fan_in_fan_out``, ``modules_to_save``, ``layers_to_transform`` / ``layers_pattern``,
``exclude_modules``, initialisations that rewrite the base weights (PiSSA, OLoRA, LoftQ, CorDA,
LoRA-GA), and any other config field set to a non-default value that drifttool does not know
(peft variants such as aLoRA, QALoRA, Arrow). ``lora_dropout`` is accepted and has no effect: it
acts only in peft's training forward, and drifttool's forward is the eval one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from drifttool.errors import CheckpointError
from drifttool.model.lora_kohya import from_kohya, is_kohya
from drifttool.model.lora_paths import DIFFUSERS_WEIGHTS, PEFT_CONFIG, PEFT_WEIGHTS, adapter_location

# Flow-GRPO's LoRA target modules for Qwen-Image (numerics §4.1: attention q/k/v/out of both
# streams and both MLPs), as module-name suffixes inside ``transformer_blocks.{i}``.
LORA_TARGET_MODULES = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
BLOCK_MODULES = LORA_TARGET_MODULES + ("img_mod.1", "txt_mod.1")
"""Every Linear of a block, as suffixes inside ``transformer_blocks.{i}``: the Flow-GRPO targets
and the modulation projections (``adaln_mod_projection``)."""
INPUT_MODULES = (
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
    "txt_in",
    "img_in",
)
"""The embedders' Linears (block −1: ``timestep_embed_mlp``, ``txt_in_rmsnorm_linear``,
``latent_proj_gemm``), in call order."""
OUTPUT_MODULES = ("norm_out.linear", "proj_out")
"""The final Linears (block ``num_layers``: ``final_adaln_out``, ``latent_proj_gemm``)."""
ALL_LINEAR = "all-linear"
"""peft's shorthand for every ``nn.Linear`` of the model (``_maybe_include_all_linear_layers``:
a diffusers model is no ``PreTrainedModel``, so no output layer is left out)."""

PEFT_PREFIX = "base_model.model."
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
DIFFUSERS_PREFIX = "transformer."  # QwenImagePipeline's transformer_name + "."

_KNOWN = {  # config fields with no effect on the adapted weight, or honoured below
    "peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
    "peft_version", "r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern",
    "lora_dropout", "init_lora_weights", "megatron_core", "qalora_group_size", "runtime_config",
    "ensure_weight_tying", "eva_config", "loftq_config", "corda_config", "lora_ga_config", "use_dora",
}
_REFUSED = {  # field: (why, value that is fine)
    "lora_bias": ("a bias on lora_B", False),
    "bias": ("trained base biases", "none"), "fan_in_fan_out": ("transposed (Conv1D) weights", False),
    "modules_to_save": ("fully trained modules", None),
    "layers_to_transform": ("a layer subset", None), "layers_pattern": ("a layer subset", None),
    "exclude_modules": ("excluded modules", None),
}
_BASE_REWRITING_INITS = ("pissa", "olora", "loftq", "corda", "lora_ga")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """The fields of peft's ``LoraConfig`` that decide the adapted weight.

    ``target_modules`` is a sorted tuple of module names / suffixes or one regex (peft's two
    forms); ``alpha_given`` is False for a file without any config, whose α = r per module
    (diffusers' convention, scale 1).
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    rank_pattern: dict[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: dict[str, float] = dataclasses.field(default_factory=dict)
    lora_dropout: float = 0.0
    use_dora: bool = False
    alpha_given: bool = True

    def targets(self, module: str) -> bool:
        """peft's ``check_target_module_exists`` for LoRA: regex fullmatch, or name/suffix match;
        ``all-linear`` (any case) matches every module (callers ask about Linears only)."""
        if isinstance(self.target_modules, str) and self.target_modules.lower() == ALL_LINEAR:
            return True
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        return any(module == t or module.endswith("." + t) for t in self.target_modules)

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """(r, lora_alpha) of ``module`` (peft ``LoraModel._create_and_replace``)."""
        return (int(_pattern_value(self.rank_pattern, module, self.r)),
                float(_pattern_value(self.alpha_pattern, module, self.lora_alpha)))

    def scale(self, module: str) -> float:
        """α/r, or α/√r with rsLoRA (peft ``LoraLayer.update_layer``), a Python float."""
        r, alpha = self.rank_alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def to_peft(self) -> dict[str, Any]:
        """A complete ``LoraConfig.to_dict()``-style dict that peft and diffusers accept."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": None, "revision": None,
                "inference_mode": True, "r": self.r, "lora_alpha": self.lora_alpha, "target_modules": targets,
                "use_rslora": self.use_rslora, "rank_pattern": dict(self.rank_pattern),
                "alpha_pattern": dict(self.alpha_pattern), "lora_dropout": self.lora_dropout,
                "bias": "none", "use_dora": self.use_dora, "lora_bias": False, "fan_in_fan_out": False,
                "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
                "layers_pattern": None, "exclude_modules": None}

    def record(self) -> dict[str, Any]:
        """JSON-ready fields for the manifest."""
        d = dataclasses.asdict(self)
        if not self.use_dora:  # recorded only when set (earlier manifests have no such key)
            del d["use_dora"]
        if not isinstance(self.target_modules, str):
            d["target_modules"] = list(self.target_modules)
        return d


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    for key in patterns:  # peft.utils.other.get_pattern_key: first key in dict order
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def parse_config(raw: Any, where: str) -> AdapterConfig:
    """Check a ``LoraConfig`` dict and keep its weight-relevant fields.

    Raises:
        CheckpointError: not a dict, not LORA, bad r / alpha / patterns, or any refused field
            (module docstring), all named in one message.
    """
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: the LoRA config is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{where}: peft_type {raw.get('peft_type')!r} is not a LoRA adapter")
    bad = [f"{k}={raw[k]!r} ({why})" for k, (why, ok) in _REFUSED.items()
           if k in raw and (raw[k] != ok if isinstance(ok, str) else bool(raw[k]))]
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        bad.append(f"init_lora_weights={init!r} (rewrites the base weights)")
    bad += [f"{k}={raw[k]!r} (unknown to drifttool)" for k in sorted(raw)
            if k not in _KNOWN and k not in _REFUSED and raw[k] not in (None, False, {}, [], "")]
    if bad:
        raise CheckpointError(f"{where}: unsupported LoRA config: " + "; ".join(bad))
    try:
        r, alpha = int(raw.get("r", 8)), float(raw.get("lora_alpha", 8))  # peft's defaults
        ranks = {str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()}
        alphas = {str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()}
        dropout = float(raw.get("lora_dropout") or 0.0)
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{where}: bad r / lora_alpha / rank_pattern / alpha_pattern ({e!r})") from None
    targets = raw.get("target_modules")
    try:  # peft matches these as regular expressions
        for rx in (*ranks, *alphas, *([targets] if isinstance(targets, str) else [])):
            re.compile(rx)
    except re.error as e:
        raise CheckpointError(f"{where}: bad regular expression in target_modules / rank_pattern / "
                              f"alpha_pattern ({e})") from None
    if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                         and all(isinstance(t, str) for t in targets))):
        raise CheckpointError(f"{where}: target_modules must be a regex or a list of names, got {targets!r}")
    if r < 1 or min(ranks.values(), default=1) < 1 or not all(
            math.isfinite(a) for a in (alpha, *alphas.values())):
        raise CheckpointError(f"{where}: bad rank or alpha (r={r}, lora_alpha={alpha}, {ranks}, {alphas})")
    return AdapterConfig(r=r, lora_alpha=alpha, use_rslora=bool(raw.get("use_rslora", False)),
                         use_dora=bool(raw.get("use_dora", False)),
                         target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
                         rank_pattern=ranks, alpha_pattern=alphas, lora_dropout=dropout)


def _load_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Keys without ``prefix`` (keys lacking it stay as they are, to be reported as unexpected)
    and without peft's in-memory adapter name (``lora_A.default.weight`` → ``lora_A.weight``,
    ``lora_magnitude_vector.default.weight`` → ``lora_magnitude_vector``)."""
    def name(k: str) -> str:
        k = re.sub(r"\.(lora_[AB])\.default\.", r".\1.", k.removeprefix(prefix))
        return re.sub(r"\.lora_magnitude_vector\.default\.weight$", ".lora_magnitude_vector", k)

    return {name(k): t for k, t in tensors.items()}


def _read_peft(folder: Path) -> tuple[dict[str, torch.Tensor], AdapterConfig]:
    cpath = folder / PEFT_CONFIG
    try:
        raw = json.loads(cpath.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cpath}: unreadable adapter config ({e})") from None
    tensors, _ = _load_safetensors(folder / PEFT_WEIGHTS)
    return _strip(tensors, PEFT_PREFIX), parse_config(raw, str(cpath))


def _read_diffusers(path: Path) -> tuple[dict[str, torch.Tensor], AdapterConfig | None]:
    tensors, meta = _load_safetensors(path)
    if is_kohya(tensors):  # no config: scale 1 after folding alpha in (diffusers)
        tensors, alpha_given = from_kohya(tensors, path, (*INPUT_MODULES, *OUTPUT_MODULES), BLOCK_MODULES)
        return tensors, dataclasses.replace(_config_from_shapes(tensors, path), alpha_given=alpha_given)
    prefixed = any(k.startswith(DIFFUSERS_PREFIX) for k in tensors)
    cfg = None
    if DIFFUSERS_METADATA_KEY in meta:
        try:
            raw = json.loads(meta[DIFFUSERS_METADATA_KEY])
        except ValueError as e:
            raise CheckpointError(f"{path}: unreadable {DIFFUSERS_METADATA_KEY} metadata ({e})") from None
        if prefixed and isinstance(raw, dict):  # pipeline layout: keep the transformer's keys
            raw = {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in raw.items()
                   if k.startswith(DIFFUSERS_PREFIX)}
        cfg = parse_config(raw, f"{path} metadata {DIFFUSERS_METADATA_KEY}")
    return _strip(tensors, DIFFUSERS_PREFIX if prefixed else PEFT_PREFIX), cfg


def _config_from_shapes(tensors: dict[str, torch.Tensor], where: Path) -> AdapterConfig:
    """diffusers' ``get_peft_kwargs`` for a file without config: r per module from the
    ``lora_B`` shape (``lora_A``'s when B is absent), the most common one as ``r`` and the others
    in ``rank_pattern``; α = r everywhere; targets = the modules the keys name."""
    ranks: dict[str, int] = {}
    for k, t in sorted(tensors.items(), key=lambda kv: ".lora_B." not in kv[0]):  # B first
        for factor, dim in ((".lora_B.", 1), (".lora_A.", 0)):
            if factor in k and t.dim() == 2:
                ranks.setdefault(k.split(factor)[0], int(t.shape[dim]))
    if not ranks:
        raise CheckpointError(f"{where}: no key names a LoRA factor (expected names such as "
                              f"transformer_blocks.0.attn.to_q.lora_A.weight); its {len(tensors)} keys: "
                              f"{', '.join(sorted(tensors)[:4])}{', …' if len(tensors) > 4 else ''}")
    values = sorted(ranks.values())
    r = max(set(values), key=lambda v: (values.count(v), -v))
    odd = {f"^{re.escape(m)}": v for m, v in ranks.items() if v != r}
    dora = any(k.endswith(".lora_magnitude_vector") for k in tensors)  # diffusers' get_peft_kwargs
    return AdapterConfig(r=r, lora_alpha=float(r), target_modules=tuple(sorted(ranks)), rank_pattern=odd,
                         alpha_pattern={k: float(v) for k, v in odd.items()}, use_dora=dora, alpha_given=False)


def read_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], AdapterConfig]:
    """Adapter tensors (keys ``<module>.lora_A.weight`` / ``.lora_B.weight``, prefixes removed,
    dtypes as stored) and config from a folder (peft and/or diffusers layout) or one
    ``.safetensors`` file (diffusers layouts; a peft ``adapter_model.safetensors`` next to its
    ``adapter_config.json`` is read as its folder).

    Raises:
        CheckpointError: no adapter at ``path`` (``lora_paths.adapter_location``: missing, a
            folder without adapter files, a file that is no ``.safetensors``); unreadable file
            or config; a refused config (``parse_config``); a folder whose peft and diffusers
            adapters differ.
    """
    p = adapter_location(path)
    if p.is_file():
        tensors, cfg = _read_diffusers(p)
        return tensors, cfg or _config_from_shapes(tensors, p)
    has_peft = (p / PEFT_CONFIG).is_file() and (p / PEFT_WEIGHTS).is_file()
    has_diff = (p / DIFFUSERS_WEIGHTS).is_file()
    read = [_read_peft(p)] if has_peft else []
    if has_diff:
        tensors, cfg = _read_diffusers(p / DIFFUSERS_WEIGHTS)
        read.append((tensors, cfg or _config_from_shapes(tensors, p / DIFFUSERS_WEIGHTS)))
    (tensors, cfg), *others = read
    for t2, c2 in others:
        same_cfg = c2 == cfg
        same_t = tensors.keys() == t2.keys() and all(
            tensors[k].dtype == t2[k].dtype and torch.equal(tensors[k], t2[k]) for k in tensors)
        if not (same_cfg and same_t):
            raise CheckpointError(f"{p}: the peft adapter ({PEFT_WEIGHTS}, {PEFT_CONFIG}) and the diffusers "
                                  f"one ({DIFFUSERS_WEIGHTS}) differ in their "
                                  + ("config" if not same_cfg else "tensors") + "; keep one of them")
    return tensors, cfg


def write_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], cfg: AdapterConfig) -> Path:
    """Write ``tensors`` (``<module>.lora_{A,B}.weight``) as a peft adapter folder and, in the
    same folder, the diffusers pipeline file (module docstring). Returns the folder."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    peft_cfg = cfg.to_peft()
    contiguous = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    save_file({PEFT_PREFIX + k: t for k, t in contiguous.items()}, str(out / PEFT_WEIGHTS),
              metadata={"format": "pt"})
    (out / PEFT_CONFIG).write_text(json.dumps(peft_cfg, indent=2, sort_keys=True) + "\n")
    meta = json.dumps({DIFFUSERS_PREFIX + k: v for k, v in peft_cfg.items()}, indent=2, sort_keys=True)
    save_file({DIFFUSERS_PREFIX + k: t for k, t in contiguous.items()}, str(out / DIFFUSERS_WEIGHTS),
              metadata={"format": "pt", DIFFUSERS_METADATA_KEY: meta})
    return out
