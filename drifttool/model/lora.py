"""LoRA adapters on the MMDiT, applied through a named operator, saved in the peft key naming.

    >>> add_lora(model, rank=4, alpha=8)                 # Flow-GRPO's targets, base frozen
    >>> v = model(x, txt, mask, tau, grid, rt)            # every adapted weight goes through
    ...                                                   # call(rt, "lora_merge", ...)
    >>> save_lora(model, "adapter/")                      # adapter_model.safetensors + config
    >>> load_lora(other_model, "adapter/")                # keys checked, all problems listed

Targets (``checkpoint.LORA_TARGET_MODULES``, numerics §4.1, Flow-GRPO's ``pickscore_qwenimage``):
``attn.to_q/to_k/to_v/to_out.0``, ``attn.add_q_proj/add_k_proj/add_v_proj/to_add_out`` and both
streams' MLP projections ``img_mlp.net.0.proj``, ``img_mlp.net.2``, ``txt_mlp.net.0.proj``,
``txt_mlp.net.2``, in every block. Each adapted ``Linear`` gets two sub-modules, ``lora_A``
(weight ``[r, in]``) and ``lora_B`` (weight ``[out, r]``), so ``model.named_parameters()`` yields
exactly peft's names: ``transformer_blocks.0.attn.to_q.lora_A.weight`` … (what
``peft.get_peft_model_state_dict`` returns for a diffusers ``QwenImageTransformer2DModel`` with
``add_adapter``). The scale is ``alpha / rank`` (peft's ``lora_alpha / r``, no rsLoRA). Adapter
weights are FP32 whatever the model dtype (peft's ``autocast_adapter_dtype`` default).

How the adapter enters the forward (why merged): the fused RFC operators (``qkv_bias_gemm``
returns heads, ``mlp_up_gemm_gelu`` applies GELU after the GEMM) leave no place to add a
per-token delta ``(α/r)·B·A·x`` before their epilogue. So the adapted weight
``W' = W + (α/r)·(B·A)`` is computed by the named operator ``lora_merge`` (contract
``drifttool.lora_merge.v1``, dispatched by ``registry.call`` like every operator and listed in the
operator trace as op ``lora_merge``, stream img/txt, once per target and forward) and handed to the
unchanged base operator, whose call-site identity does not change. Its output is traced but not
captured: it has no sample axis, and a trainer that micro-batches runs it once per micro-batch,
so its records would not align with the rollout's; the adapter bytes are pinned instead by the
fingerprint's weight digest and the manifest's ``lora.digest``, a differing adapter shows as the
first drift at the base operator that consumes it, and the adapter gradients are captured
(role ``grad_weight``, ``capture_lora_grads``). Gradients reach ``lora_A``/``lora_B``
through the base operator's weight gradient: ``dA = (α/r)·Bᵀ·dW'``, ``dB = (α/r)·dW'·Aᵀ``.
Backends:

* strict: ``B·A`` by ``strict_math.tiled_linear`` (exact products, pairwise tree over r), then
  ``fp32(W) + fp32(α/r)·(B·A)``; W' stays **FP32** (the strict GEMMs accept an FP32 weight with
  bf16 activations and round once at their output boundary), so a small update is never lost to
  a bf16 rounding of the weight. With ``B = 0`` (peft's init), W' = fp32(W) and every output is
  byte-equal to the model without the adapter.
* production: peft's merge arithmetic (``merge_and_unload``): ``W + ((B @ A) · α/r).to(W.dtype)``
  in the model dtype W (two roundings in bf16), what a rollout engine serving merged weights runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from drifttool.errors import CheckpointError
from drifttool.ops.registry import OpSpec, call, declare, implements
from drifttool.ops.strict_math import tiled_linear

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
KEY_PREFIXES = ("base_model.model.", "transformer.")
"""Prefixes stripped on load: peft ``PeftModel.save_pretrained`` (``base_model.model.``) and
diffusers ``save_lora_weights`` (``transformer.``)."""

LORA_MERGE = declare(
    OpSpec(
        name="lora_merge",
        contract="drifttool.lora_merge.v1",
        differentiable=True,
        dtypes=(torch.float32, torch.bfloat16),
        summary="adapted weight W + (alpha/r)·(B·A) of a LoRA target (not an RFC row)",
    )
)


def _targets() -> tuple[str, ...]:
    from drifttool.model.checkpoint import LORA_TARGET_MODULES

    return LORA_TARGET_MODULES


# ---------------------------------------------------------------------------------------------
# the operator


@implements("lora_merge", "strict", kernel="strict_linear(B,Aᵀ)+fp32_add")
def lora_merge_strict(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W' = fp32(W) + fp32(scale)·tree_gemm(B, Aᵀ), FP32 result (module docstring).

    Args:
        w: [out, in] base weight (fp32 or bf16).  a: [r, in] fp32.  b: [out, r] fp32.
        scale: α / r (python float, rounded once to fp32).
    """
    bt = a.to(torch.float32).t().contiguous()  # [in, r]
    delta = tiled_linear(b.to(torch.float32), bt)  # [out, in], tree over r
    s = torch.tensor(float(scale), dtype=torch.float32, device=w.device)
    return w.to(torch.float32) + s * delta


@implements("lora_merge", "production", kernel="peft.merge(torch.matmul)")
def lora_merge_production(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """peft's merge: ``W + ((B @ A) * scale).to(W.dtype)`` in the model dtype."""
    return w + ((b @ a) * float(scale)).to(w.dtype)


# ---------------------------------------------------------------------------------------------
# modules


class LoRAFactor(nn.Module):
    """``lora_A`` ([r, in]) or ``lora_B`` ([out, r]): a bias-free weight, as peft's ``nn.Linear``."""

    def __init__(self, out_features: int, in_features: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype, device=device))


def adapted_weight(module: nn.Module, rt, stream: str) -> torch.Tensor:
    """The weight the base operator receives: ``module.weight``, or ``lora_merge`` of it when the
    module carries an adapter (called by ``MMDiT`` inside the block scope)."""
    a = getattr(module, "lora_A", None)
    if a is None:
        return module.weight
    return call(rt, "lora_merge", module.weight, a.weight, module.lora_B.weight,
                float(module.lora_scale), stream=stream, layout=None)


def _blocks(model) -> list[tuple[int, nn.Module]]:
    return list(enumerate(model.transformer_blocks))


def _module(block: nn.Module, target: str) -> nn.Module:
    m = block
    for part in target.split("."):
        m = m[part] if isinstance(m, nn.ModuleDict) else getattr(m, part)
    return m


def lora_modules(model) -> dict[str, nn.Module]:
    """``{"transformer_blocks.{i}.{target}": Linear}`` of every adapted module, in block order."""
    out = {}
    for i, block in _blocks(model):
        for t in _targets():
            m = _module(block, t)
            if getattr(m, "lora_A", None) is not None:
                out[f"transformer_blocks.{i}.{t}"] = m
    return out


def has_lora(model) -> bool:
    return bool(getattr(model, "lora_config", None))


def add_lora(
    model,
    *,
    rank: int,
    alpha: float,
    targets: Iterable[str] | None = None,
    seed: int = 0,
    init_b_std: float = 0.0,
    freeze_base: bool = True,
) -> dict[str, nn.Parameter]:
    """Attach a fresh adapter to ``targets`` (default all of ``LORA_TARGET_MODULES``) of every block.

    Init (deterministic, CPU fp32 generator, module order): ``lora_A`` ~ U(−1/√in, 1/√in)
    (peft's kaiming-uniform with a = √5 gives this bound), ``lora_B`` = 0 (peft's default) or
    N(0, init_b_std²) when ``init_b_std > 0`` (so dA is non-zero at once, for checks).

    Args:
        freeze_base: set ``requires_grad=False`` on every non-adapter parameter (their ``.grad``
            then stays ``None``).

    Returns:
        The adapter parameters by peft key name.

    Raises:
        CheckpointError: rank < 1, non-finite alpha, an unknown target, or an adapter already
            attached.
    """
    targets = tuple(_targets() if targets is None else targets)
    bad = sorted(set(targets) - set(_targets()))
    if int(rank) < 1 or not math.isfinite(float(alpha)) or bad:
        raise CheckpointError(f"bad LoRA config: rank={rank}, alpha={alpha}, unknown targets {bad} "
                              f"(known: {', '.join(_targets())})")
    if has_lora(model):
        raise CheckpointError("the model already carries a LoRA adapter")
    rank = int(rank)
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    for _, block in _blocks(model):
        for t in targets:
            m = _module(block, t)
            out_f, in_f = m.weight.shape
            dev = m.weight.device if m.weight.device.type != "meta" else "cpu"
            m.lora_A = LoRAFactor(rank, in_f, device=dev)
            m.lora_B = LoRAFactor(out_f, rank, device=dev)
            bound = 1.0 / math.sqrt(in_f)
            with torch.no_grad():
                m.lora_A.weight.copy_((torch.rand(rank, in_f, generator=g) * 2 - 1) * bound)
                if init_b_std > 0:
                    m.lora_B.weight.copy_(torch.randn(out_f, rank, generator=g) * init_b_std)
            m.lora_scale = float(alpha) / rank
    model.lora_config = {"r": rank, "lora_alpha": float(alpha), "target_modules": list(targets)}
    if freeze_base:
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return lora_parameters(model)


def lora_parameters(model) -> dict[str, nn.Parameter]:
    """Adapter parameters by peft key name (``….lora_A.weight`` / ``….lora_B.weight``)."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def base_parameters(model) -> dict[str, nn.Parameter]:
    """Every parameter that is not an adapter factor."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." not in n and ".lora_B." not in n}


def lora_state_dict(model) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the adapter weights under peft's key names."""
    return {n: p.detach().to("cpu").contiguous().clone() for n, p in lora_parameters(model).items()}


def lora_digest(model) -> str | None:
    """``weight_digest`` of the adapter weights alone, or None without an adapter."""
    from drifttool.model.checkpoint import weight_digest

    return weight_digest(lora_state_dict(model)) if has_lora(model) else None


def lora_record(model) -> dict[str, Any] | None:
    """The manifest record of the adapter: rank, alpha, targets, digest (None without one)."""
    if not has_lora(model):
        return None
    return {**model.lora_config, "scale": model.lora_config["lora_alpha"] / model.lora_config["r"],
            "digest": lora_digest(model), "key_naming": "peft/diffusers",
            "apply": "merged by op lora_merge (drifttool.lora_merge.v1)"}


# ---------------------------------------------------------------------------------------------
# save / load


def save_lora(model, path: str | Path) -> Path:
    """Write the adapter as peft does: ``adapter_model.safetensors`` (keys as ``lora_state_dict``)
    and ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules``).

    Raises:
        CheckpointError: the model has no adapter.
    """
    from safetensors.torch import save_file

    if not has_lora(model):
        raise CheckpointError("the model carries no LoRA adapter to save")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(lora_state_dict(model), str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "r": model.lora_config["r"],
           "lora_alpha": model.lora_config["lora_alpha"],
           "target_modules": sorted(model.lora_config["target_modules"]), "lora_dropout": 0.0,
           "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
           "init_lora_weights": True}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return folder


def read_lora(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Adapter tensors (prefixes ``KEY_PREFIXES`` stripped) and its config from a peft folder
    (``adapter_config.json`` + ``adapter_model.safetensors``) or a bare ``.safetensors`` file
    (diffusers ``pytorch_lora_weights.safetensors``); without a config, r is read from the shapes
    and alpha defaults to r (scale 1), as diffusers does for keys without ``.alpha``.

    Raises:
        CheckpointError: missing or unreadable file, bad config, keys of no LoRA shape.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    cfg: dict[str, Any] = {}
    if p.is_dir():
        wfile = p / ADAPTER_WEIGHTS
        cpath = p / ADAPTER_CONFIG
        if cpath.is_file():
            try:
                cfg = json.loads(cpath.read_text())
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{cpath}: unreadable adapter config ({e})") from None
            if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
                raise CheckpointError(f"{cpath}: not a LoRA adapter config")
            if cfg.get("use_dora") or cfg.get("use_rslora"):
                raise CheckpointError(f"{cpath}: DoRA / rsLoRA adapters are not supported")
    else:
        wfile = p
    if not wfile.is_file():
        raise CheckpointError(f"{wfile}: no such LoRA weights file")
    try:
        raw = load_file(str(wfile))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{wfile}: unreadable safetensors file ({e})") from None
    tensors = {}
    for k, t in raw.items():
        for pre in KEY_PREFIXES:
            if k.startswith(pre):
                k = k[len(pre):]
                break
        tensors[k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")] = t
    ranks = sorted({int(t.shape[0]) for k, t in tensors.items()
                    if k.endswith(".lora_A.weight") and t.dim() == 2})
    if not ranks:
        raise CheckpointError(f"{wfile}: no key names a LoRA factor (expected peft names such as "
                              f"transformer_blocks.0.attn.to_q.lora_A.weight); got {sorted(tensors)[:4]}")
    if "r" not in cfg:
        if len(ranks) != 1:
            raise CheckpointError(f"{wfile}: cannot infer one LoRA rank from the lora_A shapes {ranks}")
        cfg["r"] = ranks[0]
    cfg.setdefault("lora_alpha", cfg["r"])
    try:
        cfg["r"], cfg["lora_alpha"] = int(cfg["r"]), float(cfg["lora_alpha"])
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: bad r / lora_alpha in the adapter config") from None
    return tensors, cfg


def load_lora(model, path: str | Path, *, freeze_base: bool = True) -> dict[str, nn.Parameter]:
    """Load an adapter (``read_lora``) into ``model``, attaching one first if it has none
    (rank and alpha from the adapter config; targets: the modules the keys name).

    Raises:
        CheckpointError: one error listing every missing, unexpected and mis-shaped key, or
            non-float / non-finite tensors (nothing is loaded then).
    """
    tensors, cfg = read_lora(path)
    targets = sorted({k.split(".", 2)[2].rsplit(".lora_", 1)[0] for k in tensors
                      if k.startswith("transformer_blocks.") and ".lora_" in k and k.count(".") >= 3},
                     key=lambda t: _targets().index(t) if t in _targets() else len(_targets()))
    known = [t for t in targets if t in _targets()]
    fresh = not has_lora(model)
    if fresh:
        if not known:
            raise CheckpointError(f"{path}: no key names a LoRA target of the MMDiT "
                                  f"(e.g. transformer_blocks.0.attn.to_q.lora_A.weight); "
                                  f"got {sorted(tensors)[:4]}")
        add_lora(model, rank=cfg["r"], alpha=cfg["lora_alpha"], targets=known, freeze_base=freeze_base)
    params = lora_parameters(model)
    missing = [k for k in params if k not in tensors]
    unexpected = sorted(k for k in tensors if k not in params)
    misshaped = [f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(params[k].shape)}"
                 for k in params if k in tensors and tensors[k].shape != params[k].shape]
    bad = [k for k, t in tensors.items() if k in params and (not t.is_floating_point()
                                                              or not bool(torch.isfinite(t).all()))]
    scale_note = ""
    if not fresh and abs(model.lora_config["lora_alpha"] / model.lora_config["r"]
                         - cfg["lora_alpha"] / cfg["r"]) > 0:
        scale_note = (f"scale alpha/r {cfg['lora_alpha']}/{cfg['r']} differs from the model's "
                      f"{model.lora_config['lora_alpha']}/{model.lora_config['r']}")
    if missing or unexpected or misshaped or bad or scale_note:
        lines = []
        if missing:
            lines.append(f"missing keys ({len(missing)}): " + ", ".join(missing[:8])
                         + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            lines.append(f"unexpected keys ({len(unexpected)}): " + ", ".join(unexpected[:8])
                         + (" ..." if len(unexpected) > 8 else ""))
        if misshaped:
            lines.append(f"mis-shaped keys ({len(misshaped)}): " + "; ".join(misshaped[:8]))
        if bad:
            lines.append(f"non-float or non-finite tensors ({len(bad)}): " + ", ".join(bad[:8]))
        if scale_note:
            lines.append(scale_note)
        if fresh:
            remove_lora(model)
        raise CheckpointError(f"LoRA file {path} does not match the model:\n  " + "\n  ".join(lines))
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(tensors[k].to(p.dtype))
    return params


def remove_lora(model) -> None:
    """Detach every adapter (the base parameters keep their ``requires_grad``)."""
    for m in lora_modules(model).values():
        del m.lora_A, m.lora_B, m.lora_scale
    model.lora_config = None


# ---------------------------------------------------------------------------------------------
# gradients


def grad_identity(name: str) -> tuple[int, str, str]:
    """(block, stream, op) of an adapter parameter's gradient record: ``op`` is the target and
    factor (``attn.to_q.lora_A``), stream img/txt by the target's stream."""
    rest = name.removeprefix("transformer_blocks.")
    block, tail = rest.split(".", 1)
    op = tail.removesuffix(".weight")
    txt = op.startswith(("attn.add_", "attn.to_add_out", "txt_mlp."))
    return int(block), "txt" if txt else "img", op


def capture_lora_grads(model, recorder, *, phase: str, step: int, sigma: float = math.nan,
                       rank: int = 0) -> int:
    """Digest every adapter gradient (``p.grad``, as accumulated so far) into ``recorder`` with
    role ``grad_weight`` (one record per parameter, sample −1). Returns the number captured;
    parameters without a gradient are skipped."""
    if recorder is None or getattr(recorder, "level", "L1") == "L0":  # L0 keeps no op records
        return 0
    n = 0
    for name, p in lora_parameters(model).items():
        if p.grad is None:
            continue
        block, stream, op = grad_identity(name)
        recorder.capture_grad(phase=phase, step=step, sigma=sigma, block=block, stream=stream,
                              op=op, tensor=p.grad, rank=rank)
        n += 1
    return n
