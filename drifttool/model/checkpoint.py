"""Checkpoint mapper (RFC ``qwenimage_checkpoint_mapper``): diffusers-format folders in and out.

    >>> model = load_checkpoint("Qwen-Image/transformer", dtype=torch.bfloat16)
    >>> save_checkpoint(model, "fixtures/tiny/transformer")
    >>> weight_digest(model)
    'xxh3_128:5f0c…'

A folder holds ``config.json`` (diffusers ``QwenImageTransformer2DModel`` config) and either
``diffusion_pytorch_model.safetensors`` or ``diffusion_pytorch_model.safetensors.index.json`` plus
the shards it names. Only safetensors is read — never pickle (``.bin`` / ``.pt``).

Weight map: drifttool's ``MMDiT`` uses the checkpoint's own parameter names, so the map is the
identity; it is still written out literally (``weight_map``) so the fingerprint pins it and a
future rename is one dict entry (torchtitan's ``state_dict_adapter.py`` habit). Both streams:

- image stream per block: ``img_mod.1``, ``attn.to_q/to_k/to_v``, ``attn.norm_q/norm_k``,
  ``attn.to_out.0``, ``img_mlp.net.0.proj``, ``img_mlp.net.2``;
- text stream per block: ``txt_mod.1``, ``attn.add_q_proj/add_k_proj/add_v_proj``,
  ``attn.norm_added_q/norm_added_k``, ``attn.to_add_out``, ``txt_mlp.net.0.proj``, ``txt_mlp.net.2``.

RoPE tables are not weights (diffusers keeps them as plain attributes) and are not stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
import xxhash

from drifttool.errors import CheckpointError
from drifttool.model.config import MMDiTConfig, from_diffusers_config
from drifttool.model.mmdit import MMDiT

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"

# Top-level tensors (numerics §1); every Linear has weight + bias, gains have weight only.
_INPUTS = (
    "time_text_embed.timestep_embedder.linear_1.weight",
    "time_text_embed.timestep_embedder.linear_1.bias",
    "time_text_embed.timestep_embedder.linear_2.weight",
    "time_text_embed.timestep_embedder.linear_2.bias",
    "txt_norm.weight",
    "img_in.weight",
    "img_in.bias",
    "txt_in.weight",
    "txt_in.bias",
)
_OUTPUTS = (
    "norm_out.linear.weight",
    "norm_out.linear.bias",
    "proj_out.weight",
    "proj_out.bias",
)

# Per-block tensors under ``transformer_blocks.{i}.`` (32 per block).
_PER_BLOCK = (
    # image stream
    "img_mod.1.weight",
    "img_mod.1.bias",
    "attn.to_q.weight",
    "attn.to_q.bias",
    "attn.to_k.weight",
    "attn.to_k.bias",
    "attn.to_v.weight",
    "attn.to_v.bias",
    "attn.norm_q.weight",
    "attn.norm_k.weight",
    "attn.to_out.0.weight",
    "attn.to_out.0.bias",
    "img_mlp.net.0.proj.weight",
    "img_mlp.net.0.proj.bias",
    "img_mlp.net.2.weight",
    "img_mlp.net.2.bias",
    # text stream
    "txt_mod.1.weight",
    "txt_mod.1.bias",
    "attn.add_q_proj.weight",
    "attn.add_q_proj.bias",
    "attn.add_k_proj.weight",
    "attn.add_k_proj.bias",
    "attn.add_v_proj.weight",
    "attn.add_v_proj.bias",
    "attn.norm_added_q.weight",
    "attn.norm_added_k.weight",
    "attn.to_add_out.weight",
    "attn.to_add_out.bias",
    "txt_mlp.net.0.proj.weight",
    "txt_mlp.net.0.proj.bias",
    "txt_mlp.net.2.weight",
    "txt_mlp.net.2.bias",
)

def weight_map(config: MMDiTConfig) -> dict[str, str]:
    """Checkpoint tensor name → ``MMDiT`` parameter name (identity): inputs, blocks (image stream
    then text stream), outputs.

    ``len(weight_map(full())) == 1933`` (13 top-level + 60 × 32 per block).
    """
    names = list(_INPUTS)
    for i in range(config.num_layers):
        names += [f"transformer_blocks.{i}.{n}" for n in _PER_BLOCK]
    names += _OUTPUTS
    return {n: n for n in names}


# ---------------------------------------------------------------------------------------------
# load


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder (single file, or the shards an index names)."""
    single = folder / WEIGHTS_NAME
    index = folder / WEIGHTS_INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        wm = _read_json(index).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: no 'weight_map'")
        shards = sorted(set(wm.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {missing}")
        return [folder / s for s in shards]
    pickles = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f" (found {pickles}; pickle checkpoints are not loaded, convert to safetensors)" if pickles else ""
    raise CheckpointError(f"{folder}: neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}{hint}")


def _read_tensors(files: Iterable[Path]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    dupes = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for k in sf.keys():
                    if k in tensors:
                        dupes.append(f"{k} ({f.name})")
                    tensors[k] = sf.get_tensor(k)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
    if dupes:
        raise CheckpointError(f"tensor(s) stored in more than one shard: {dupes}")
    return tensors


def load_state_dict_into(model: MMDiT, tensors: dict[str, torch.Tensor]) -> None:
    """Check ``tensors`` (checkpoint names) against ``model`` and load them, cast to its dtype.

    Raises:
        CheckpointError: one error listing every missing key, unexpected key and mis-shaped key.
    """
    wmap = weight_map(model.config)
    params = dict(model.named_parameters())
    missing = [k for k in wmap if k not in tensors]
    unexpected = sorted(k for k in tensors if k not in wmap)
    misshaped = [
        f"{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(params[wmap[k]].shape)}"
        for k in wmap
        if k in tensors and tuple(tensors[k].shape) != tuple(params[wmap[k]].shape)
    ]
    bad_dtype = [f"{k}: {t.dtype}" for k, t in tensors.items() if k in wmap and not t.is_floating_point()]
    if missing or unexpected or misshaped or bad_dtype:
        lines = []
        if missing:
            lines.append(f"missing keys ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            lines.append(f"unexpected keys ({len(unexpected)}): " + ", ".join(unexpected))
        if misshaped:
            lines.append(f"mis-shaped keys ({len(misshaped)}): " + "; ".join(misshaped))
        if bad_dtype:
            lines.append(f"non-float tensors ({len(bad_dtype)}): " + ", ".join(bad_dtype))
        raise CheckpointError("checkpoint does not match the MMDiT:\n  " + "\n  ".join(lines))
    state = {}
    for ckpt_name, model_name in wmap.items():
        p = params[model_name]
        device = p.device if p.device.type != "meta" else torch.device("cpu")
        state[model_name] = tensors[ckpt_name].to(device=device, dtype=p.dtype).contiguous()
    model.load_state_dict(state, strict=True, assign=True)


def load_checkpoint(
    path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> MMDiT:
    """Load a diffusers-format transformer folder into an ``MMDiT``.

    Args:
        path: folder with ``config.json`` and safetensors weights (single file or sharded index).
        dtype: model dtype W (fp32 or bf16); ``None`` keeps the checkpoint's own dtype, which must
            then be one dtype for all tensors.
        device: where the parameters live.

    Raises:
        CheckpointError: missing/unreadable files; missing, unexpected or mis-shaped keys (all
            listed in one error); mixed checkpoint dtypes with ``dtype=None``.
        UnsupportedConfigError: a config that drifttool does not implement
            (``guidance_embeds``, ``zero_cond_t``, ``use_additional_t_cond``, ``use_layer3d_rope``).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    config = from_diffusers_config(_read_json(folder / CONFIG_NAME))
    tensors = _read_tensors(_weight_files(folder))
    if dtype is None:
        dtypes = sorted({str(t.dtype) for t in tensors.values()})
        if len(dtypes) != 1:
            raise CheckpointError(f"{folder}: tensors have mixed dtypes {dtypes}; pass dtype= explicitly")
        dtype = next(iter(tensors.values())).dtype
    with torch.device("meta"):
        model = MMDiT(config, dtype=dtype)
    load_state_dict_into(model, tensors)
    return model.to(device)


# ---------------------------------------------------------------------------------------------
# save and digest


def save_checkpoint(model: MMDiT, path: str | Path, *, max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` as a diffusers-format folder (what ``load_checkpoint`` and diffusers'
    ``QwenImageTransformer2DModel.from_pretrained`` read).

    Args:
        model: the MMDiT (any device; tensors are written from the CPU, in the model dtype).
        path: target folder (created).
        max_shard_bytes: when set, split into ``diffusion_pytorch_model-0000k-of-0000n.safetensors``
            shards of at most this many bytes (a tensor is never split) plus the index JSON.

    Returns:
        The folder path.
    """
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(model.config.to_diffusers_config(), indent=2) + "\n")
    params = dict(model.named_parameters())
    state = {ck: params[mn].detach().to("cpu").contiguous() for ck, mn in weight_map(model.config).items()}
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(state, str(folder / WEIGHTS_NAME), metadata=meta)
        return folder
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    n = len(shards)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}, "weight_map": {}}
    for i, shard in enumerate(shards, start=1):
        name = f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / name), metadata=meta)
        index["weight_map"].update({k: name for k in shard})
    (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return folder


def weight_digest(model: MMDiT | dict[str, torch.Tensor]) -> str:
    """``xxh3_128`` over every tensor in sorted key order: name, dtype, shape, then raw bytes.

    Equal digests ⇔ same names, dtypes, shapes and bytes (to the hash's collision bound); the same
    on every device. Accepts a model or a state dict. Returns ``"xxh3_128:<32 hex>"``.
    """
    state = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else model
    h = xxhash.xxh3_128()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
        h.update(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return "xxh3_128:" + h.hexdigest()
