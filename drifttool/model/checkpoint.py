"""Checkpoint mapper (RFC ``qwenimage_checkpoint_mapper``): diffusers-format folders in and out.

    >>> model = load_checkpoint("Qwen-Image/transformer", dtype=torch.bfloat16)
    >>> save_checkpoint(model, "fixtures/tiny/transformer")
    >>> weight_digest(model)                      # drifttool.model.weights
    'xxh3_128:5f0c…'

A folder holds ``config.json`` (diffusers ``QwenImageTransformer2DModel`` config) and either
``diffusion_pytorch_model.safetensors`` or ``diffusion_pytorch_model.safetensors.index.json`` plus
the shards it names (with a weight variant: ``diffusion_pytorch_model.fp16.safetensors``, as
``save_pretrained(variant=)`` writes). A pipeline folder (``model_index.json`` + ``transformer/``)
loads from its root. Only safetensors is read — never pickle (``.bin`` / ``.pt``). The config is
checked against the safetensors headers before any tensor is read, so a config claiming absurd
sizes fails at once.

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
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from drifttool.errors import CheckpointError, UnsupportedConfigError
from drifttool.model.config import MMDiTConfig, from_diffusers_config
from drifttool.model.mmdit import MMDiT

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
PIPELINE_INDEX_NAME = "model_index.json"
TRANSFORMER_SUBFOLDER = "transformer"

def _top_shapes(c: MMDiTConfig) -> dict[str, tuple[int, ...]]:
    """Top-level tensors (numerics §1): inputs, then outputs. Linears are ``[out, in]`` + bias."""
    d, dj = c.inner_dim, c.joint_attention_dim
    return {
        "time_text_embed.timestep_embedder.linear_1.weight": (d, 256),  # 256-channel sinusoid
        "time_text_embed.timestep_embedder.linear_1.bias": (d,),
        "time_text_embed.timestep_embedder.linear_2.weight": (d, d),
        "time_text_embed.timestep_embedder.linear_2.bias": (d,),
        "txt_norm.weight": (dj,),
        "img_in.weight": (d, c.in_channels),
        "img_in.bias": (d,),
        "txt_in.weight": (d, dj),
        "txt_in.bias": (d,),
    }


def _output_shapes(c: MMDiTConfig) -> dict[str, tuple[int, ...]]:
    d = c.inner_dim
    return {
        "norm_out.linear.weight": (2 * d, d),
        "norm_out.linear.bias": (2 * d,),
        "proj_out.weight": (c.out_dim, d),
        "proj_out.bias": (c.out_dim,),
    }


def _block_shapes(c: MMDiTConfig) -> dict[str, tuple[int, ...]]:
    """Tensors under ``transformer_blocks.{i}.`` (32 per block): image stream, then text stream."""
    d, dh, m = c.inner_dim, c.attention_head_dim, c.mlp_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for mod, q, k, v, out, nq, nk, mlp in (
        ("img_mod.1", "to_q", "to_k", "to_v", "to_out.0", "norm_q", "norm_k", "img_mlp"),
        ("txt_mod.1", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "norm_added_q",
         "norm_added_k", "txt_mlp"),
    ):
        shapes |= {f"{mod}.weight": (6 * d, d), f"{mod}.bias": (6 * d,)}  # shift/scale/gate × 2
        for lin in (q, k, v):
            shapes |= {f"attn.{lin}.weight": (d, d), f"attn.{lin}.bias": (d,)}
        shapes |= {f"attn.{nq}.weight": (dh,), f"attn.{nk}.weight": (dh,)}
        shapes |= {f"attn.{out}.weight": (d, d), f"attn.{out}.bias": (d,)}
        shapes |= {f"{mlp}.net.0.proj.weight": (m, d), f"{mlp}.net.0.proj.bias": (m,),
                   f"{mlp}.net.2.weight": (d, m), f"{mlp}.net.2.bias": (d,)}
    return shapes


def tensor_shapes(config: MMDiTConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name → shape for ``config``, in ``weight_map`` order (the shapes
    diffusers' ``QwenImageTransformer2DModel`` gives its parameters, numerics §1).

    Builds ``13 + 32 · num_layers`` entries: call it only once ``num_layers`` is known to match
    the stored weights (``check_shapes`` does).
    """
    shapes = dict(_top_shapes(config))
    block = _block_shapes(config)
    for i in range(config.num_layers):
        shapes |= {f"transformer_blocks.{i}.{n}": s for n, s in block.items()}
    return shapes | _output_shapes(config)


def weight_map(config: MMDiTConfig) -> dict[str, str]:
    """Checkpoint tensor name → ``MMDiT`` parameter name (identity): inputs, blocks (image stream
    then text stream), outputs.

    ``len(weight_map(full())) == 1933`` (13 top-level + 60 × 32 per block).
    """
    return {n: n for n in tensor_shapes(config)}


# ---------------------------------------------------------------------------------------------
# load


# A transformer's config.json is < 1 KiB and the full model's index ~ 150 KiB: anything past this
# is not a checkpoint file, and is refused before it is parsed.
_MAX_JSON_BYTES = 16 * 2**20

_BLOCK_KEY = re.compile(r"transformer_blocks\.(\d+)\.")
_VARIANT = r"[A-Za-z0-9_\-]+"
# diffusers' variant weight files: single, shard and index (``_add_variant``).
_VARIANT_FILE = re.compile(
    rf"diffusion_pytorch_model(?:\.safetensors\.index)?\.({_VARIANT}?)(?:-\d+-of-\d+)?\.(?:safetensors|json)"
)


def _read_json(path: Path) -> Any:
    """Parse a small JSON file. Raises ``CheckpointError`` (one line) when it is missing, too
    large, not UTF-8, not JSON, nested too deep, or holds an integer too long to convert."""
    try:
        size = path.stat().st_size
        if size > _MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {size} bytes, larger than any checkpoint JSON ({_MAX_JSON_BYTES})")
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, UTF-8, digits
        raise CheckpointError(f"{path}: unreadable JSON ({type(e).__name__}: {str(e)[:200]})") from None


def _json_object(path: Path) -> dict[str, Any]:
    obj = _read_json(path)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(obj).__name__}")
    return obj


def _variant_name(name: str, variant: str | None) -> str:
    """diffusers' ``_add_variant``: ``a.b.safetensors`` → ``a.b.<variant>.safetensors``."""
    if variant is None:
        return name
    head, _, ext = name.rpartition(".")
    return f"{head}.{variant}.{ext}"


def transformer_folder(path: str | Path) -> Path:
    """The folder holding the transformer's ``config.json``: ``path`` itself, or, for a pipeline
    folder (``model_index.json`` naming a ``QwenImageTransformer2DModel`` transformer, as
    ``DiffusionPipeline.save_pretrained`` writes), its ``transformer/`` subfolder.

    Raises:
        CheckpointError: not a directory; neither kind of folder; a pipeline whose
            ``transformer`` component is missing or of another class.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    if (folder / CONFIG_NAME).is_file():
        return folder
    index = folder / PIPELINE_INDEX_NAME
    if not index.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_NAME} (a transformer folder) and no "
                              f"{PIPELINE_INDEX_NAME} (a pipeline folder)")
    component = _json_object(index).get(TRANSFORMER_SUBFOLDER)
    if not (isinstance(component, list) and component[-1:] == ["QwenImageTransformer2DModel"]):
        raise CheckpointError(f"{index}: component {TRANSFORMER_SUBFOLDER!r} is {component!r}, "
                              "not a QwenImageTransformer2DModel")
    sub = folder / TRANSFORMER_SUBFOLDER
    if not (sub / CONFIG_NAME).is_file():
        raise CheckpointError(f"{sub}: missing {CONFIG_NAME} of the pipeline's transformer")
    return sub


def _weight_files(folder: Path, variant: str | None = None) -> list[Path]:
    """The safetensors files of a folder (single file, or the shards an index names), with
    diffusers' ``variant`` file names when given (``diffusion_pytorch_model.fp16.safetensors``,
    ``diffusion_pytorch_model.safetensors.index.fp16.json``)."""
    single = folder / _variant_name(WEIGHTS_NAME, variant)
    index = folder / _variant_name(WEIGHTS_INDEX_NAME, variant)
    if single.is_file():
        return [single]
    if index.is_file():
        wm = _json_object(index).get("weight_map")
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index}: no 'weight_map' of tensor name → shard file name")
        shards = sorted(set(wm.values()))
        outside = [s for s in shards if Path(s).name != s or s in (".", "..")]
        if outside:
            raise CheckpointError(f"{index}: shard names must be file names in {folder}, got {outside[:5]}")
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {missing}")
        return [folder / s for s in shards]
    names = sorted(p.name for p in folder.iterdir())
    pickles = [n for n in names if Path(n).suffix in (".bin", ".pt", ".pth", ".ckpt")]
    variants = sorted({m.group(1) for n in names if (m := _VARIANT_FILE.fullmatch(n))})
    hint = ""
    if variants:
        hint = f" (found weight variant(s) {variants}: pass variant=/--variant)"
    elif pickles:
        hint = f" (found {pickles}; pickle checkpoints are not loaded, convert to safetensors)"
    raise CheckpointError(f"{folder}: neither {single.name} nor {index.name}{hint}")


def index_warnings(path: str | Path, variant: str | None = None) -> list[str]:
    """What a sharded checkpoint's index claims that its shards do not hold (diffusers warns of
    the same when it loads): one line per shard whose tensors the index lists but the shard
    lacks, ``[]`` for a single-file checkpoint or a true index. Reads the index and the
    safetensors headers only.

    Raises:
        CheckpointError: as ``load_checkpoint`` for files it cannot read.
    """
    folder = transformer_folder(path)
    index = folder / _variant_name(WEIGHTS_INDEX_NAME, variant)
    files = _weight_files(folder, variant)
    if len(files) == 1 and files[0].name == _variant_name(WEIGHTS_NAME, variant):
        return []
    from safetensors import safe_open

    held: dict[str, set[str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                held[f.name] = set(sf.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise _safetensors_error(f, e) from None
    lacking: dict[str, list[str]] = {}
    for name, shard in _json_object(index)["weight_map"].items():
        if name not in held.get(shard, set()):
            lacking.setdefault(shard, []).append(name)
    return [f"{index.name} lists {len(names)} tensor(s) that {shard} does not hold: "
            f"{', '.join(sorted(names)[:8])}{', …' if len(names) > 8 else ''} (the shards' own "
            "headers decide what loads; diffusers warns of the same)"
            for shard, names in sorted(lacking.items())]


def _safetensors_error(f: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"{f}: unreadable safetensors file ({type(e).__name__}: {str(e)[:200]})")


def read_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from the safetensors headers alone (no tensor data is read).

    Raises:
        CheckpointError: an unreadable or corrupt file; a tensor stored in more than one file.
    """
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    dupes = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for k in sf.keys():
                    if k in shapes:
                        dupes.append(f"{k} ({f.name})")
                    shapes[k] = tuple(sf.get_slice(k).get_shape())
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise _safetensors_error(f, e) from None
    if dupes:
        raise CheckpointError(f"tensor(s) stored in more than one shard: {dupes}")
    return shapes


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
"""safetensors header dtype names → torch dtypes (the ones a checkpoint may plausibly hold)."""


def read_dtypes(files: Iterable[Path]) -> dict[str, str]:
    """Tensor name → safetensors dtype name (``"BF16"``, ``"F32"``, …) from the headers alone.

    Raises:
        CheckpointError: an unreadable or corrupt file.
    """
    from safetensors import safe_open

    out: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                out.update({k: str(sf.get_slice(k).get_dtype()) for k in sf.keys()})
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise _safetensors_error(f, e) from None
    return out


def _read_tensors(files: Iterable[Path], *, device: torch.device | str = "cpu",
                  dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, each copied from the memory-mapped shard
    straight to ``device`` in ``dtype`` (None: the stored dtype).

    Each tensor is read through its own mapping of the shard, unmapped once its copy exists, so
    the pages of the file never pile up in the process's resident memory: host memory peaks at
    the tensors already yielded (when ``device`` is the CPU) plus one tensor's mapped pages and
    copy — not at a whole shard or a dict of every stored tensor.

    Raises:
        CheckpointError: an unreadable or corrupt file.
    """
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                names = list(sf.keys())
            for k in names:
                with safe_open(str(f), framework="pt", device="cpu") as sf:
                    mapped = sf.get_tensor(k)  # a view of the mapping: no pages read yet
                    t = mapped.to(device=device, dtype=dtype or mapped.dtype, copy=True)
                    del mapped
                yield k, t
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise _safetensors_error(f, e) from None


def _listing(what: str, items: list[str], sep: str, shown: int = 8) -> str:
    more = f"{sep}… (+{len(items) - shown} more)" if len(items) > shown else ""
    return f"{what} ({len(items)}): " + sep.join(items[:shown]) + more


def check_shapes(config: MMDiTConfig, stored: dict[str, tuple[int, ...]]) -> None:
    """Check stored tensor shapes (checkpoint names) against ``config``.

    The block count is compared first, so a config claiming absurd depth fails at once instead
    of enumerating its keys; every other size is pinned by some stored shape, so nothing is
    allocated before the config and the weights agree.

    Raises:
        CheckpointError: ``num_layers`` differs from the stored block count; or one line
            counting the missing, unexpected and mis-shaped keys and naming the first of each.
    """
    blocks = {int(m.group(1)) for k in stored if (m := _BLOCK_KEY.match(k))}
    if config.num_layers != len(blocks):
        raise CheckpointError(f"config num_layers={config.num_layers} but the weights hold {len(blocks)} "
                              "block(s) under transformer_blocks.*")
    want = tensor_shapes(config)
    missing = [k for k in want if k not in stored]
    unexpected = sorted(k for k in stored if k not in want)
    misshaped = [f"{k}: checkpoint {stored[k]} vs model {want[k]}"
                 for k in want if k in stored and stored[k] != want[k]]
    parts = [_listing(f"{what} keys", keys, sep) for what, keys, sep in (
        ("missing", missing, ", "), ("unexpected", unexpected, ", "), ("mis-shaped", misshaped, "; ")) if keys]
    if parts:
        raise CheckpointError("checkpoint does not match its config: " + " | ".join(parts))


def load_state_dict_into(model: MMDiT, tensors: dict[str, torch.Tensor]) -> None:
    """Check ``tensors`` (checkpoint names) against ``model`` and load them, cast to its dtype.

    Raises:
        CheckpointError: as ``check_shapes``; or non-float tensors (listed).
    """
    check_shapes(model.config, {k: tuple(t.shape) for k, t in tensors.items()})
    bad_dtype = [f"{k}: {t.dtype}" for k, t in tensors.items() if not t.is_floating_point()]
    if bad_dtype:
        raise CheckpointError(f"non-float tensors ({len(bad_dtype)}): " + ", ".join(bad_dtype))
    _assign(model, ((k, t) for k, t in tensors.items()))


def _assign(model: MMDiT, tensors: Iterable[tuple[str, torch.Tensor]],
            device: torch.device | None = None) -> None:
    """Load (checkpoint name, tensor) pairs into ``model`` (weight map applied), each cast to its
    parameter's dtype on ``device`` (default: the parameter's own, the CPU for a meta model) as
    it arrives — a no-op for tensors already there — so no second copy of the weights is held;
    ``load_state_dict(assign=True)`` then adopts them."""
    wmap = weight_map(model.config)
    params = dict(model.named_parameters())
    state = {}
    for ckpt_name, t in tensors:
        name = wmap[ckpt_name]
        p = params[name]
        dev = device or (p.device if p.device.type != "meta" else torch.device("cpu"))
        state[name] = t.to(device=dev, dtype=p.dtype).contiguous()
        del t
    model.load_state_dict(state, strict=True, assign=True)


def read_config(path: str | Path) -> MMDiTConfig:
    """The ``MMDiTConfig`` of a transformer or pipeline folder (``transformer_folder``).

    Raises:
        CheckpointError: as ``transformer_folder``; an unreadable ``config.json``.
        UnsupportedConfigError: as ``drifttool.model.config.from_diffusers_config``.
    """
    return from_diffusers_config(_json_object(transformer_folder(path) / CONFIG_NAME))


def load_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    variant: str | None = None,
) -> MMDiT:
    """Load a diffusers-format transformer folder (or a pipeline folder, ``transformer_folder``)
    into an ``MMDiT``.

    The config is checked against the safetensors headers (shapes and dtypes) before any tensor
    is read or the model is built, so a hostile config (a billion layers, huge widths) fails at
    once. The model is built on the meta device and each parameter assigned as its tensor
    arrives, tensor by tensor (no dict of every stored tensor, no second cast copy).

    Args:
        path: folder with ``config.json`` and safetensors weights (single file or sharded index),
            or a pipeline folder with ``model_index.json`` and ``transformer/``.
        dtype: model dtype W (fp32 or bf16); ``None`` keeps the checkpoint's own dtype, which must
            then be one dtype for all tensors.
        device: where the parameters live: each tensor is copied from the memory-mapped shard
            straight there, cast to ``dtype`` on the way (``_read_tensors``), so host memory
            peaks near the weights' size on the CPU and near one tensor for a GPU.
        variant: diffusers weight variant (``"fp16"`` reads ``diffusion_pytorch_model.fp16.safetensors``),
            as ``from_pretrained(..., variant=)``.

    Raises:
        CheckpointError: missing/unreadable files; a config that is not a JSON object; missing,
            unexpected or mis-shaped keys (all listed in one error); a block count that differs
            from ``num_layers``; non-float tensors; mixed checkpoint dtypes with ``dtype=None``.
        UnsupportedConfigError: a config that drifttool does not implement
            (``from_diffusers_config``), or a variant that is not a plain name.
    """
    if variant is not None and (not isinstance(variant, str) or not re.fullmatch(_VARIANT, variant)):
        raise UnsupportedConfigError(f"weight variant {variant!r} must be a plain name such as 'fp16'")
    folder = transformer_folder(path)
    config = read_config(folder)
    files = _weight_files(folder, variant)
    check_shapes(config, read_shapes(files))
    stored = read_dtypes(files)
    bad_dtype = [f"{k}: {d}" for k, d in stored.items()
                 if d not in _SAFETENSORS_DTYPES or not _SAFETENSORS_DTYPES[d].is_floating_point]
    if bad_dtype:
        raise CheckpointError(f"non-float tensors ({len(bad_dtype)}): " + ", ".join(bad_dtype[:8]))
    if dtype is None:
        dtypes = sorted({str(_SAFETENSORS_DTYPES[d]) for d in stored.values()})
        if len(dtypes) != 1:
            raise CheckpointError(f"{folder}: tensors have mixed dtypes {dtypes}; pass dtype= explicitly")
        dtype = _SAFETENSORS_DTYPES[next(iter(stored.values()))]
    device = torch.device(device)
    with torch.device("meta"):
        model = MMDiT(config, dtype=dtype)
    _assign(model, _read_tensors(files, device=device, dtype=dtype), device)
    return model


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
    names = {ck: params[mn] for ck, mn in weight_map(model.config).items()}
    meta = {"format": "pt"}

    def host(keys):  # one shard's tensors on the host at a time (a GPU model of 41 GB streams out)
        return {k: names[k].detach().to("cpu").contiguous() for k in keys}

    if max_shard_bytes is None:
        save_file(host(names), str(folder / WEIGHTS_NAME), metadata=meta)
        return folder
    shards: list[list[str]] = [[]]
    size = 0
    for k, t in names.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes
    n = len(shards)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in names.values())},
             "weight_map": {}}
    for i, keys in enumerate(shards, start=1):
        name = f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors"
        save_file(host(keys), str(folder / name), metadata=meta)
        index["weight_map"].update({k: name for k in keys})
    (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return folder
