"""Checkpoint mapper (RFC ``qwenimage_checkpoint_mapper``): diffusers-format folders in and out.

    >>> model = load_checkpoint("Qwen-Image/transformer", dtype=torch.bfloat16)
    >>> save_checkpoint(model, "fixtures/tiny/transformer")
    >>> weight_digest(model)                      # drifttool.model.weights: computed while loading
    'xxh3_128:5f0c…'

The folder's files (layout, variants, sharded index, safetensors headers) are
``drifttool.model.checkpoint_files``'s, streaming their tensors onto a device (and into the weight
digest) is ``drifttool.model.checkpoint_stream``'s; this module maps them onto the model. The
config is checked against the safetensors headers before any tensor is read, so a config claiming
absurd sizes fails at once.

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

import contextlib
import itertools
import json
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from drifttool.errors import CheckpointError
from drifttool.model.checkpoint_files import (
    CONFIG_NAME,
    SAFETENSORS_DTYPES,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    check_variant,
    locate_tensors,
    read_dtypes,
    read_json_object,
    read_shapes,
    transformer_folder,
    weight_files,
)
from drifttool.model.checkpoint_stream import stream_tensors
from drifttool.model.config import MMDiTConfig, from_diffusers_config
from drifttool.model.lora_io import adapter_values
from drifttool.model.mmdit import MMDiT
from drifttool.model.weights import StreamingDigest


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


_BLOCK_KEY = re.compile(r"transformer_blocks\.(\d+)\.")


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
    wmap = weight_map(model.config)
    _assign(model, ((wmap[k], t) for k, t in tensors.items()))


def _assign(model: MMDiT, tensors: Iterable[tuple[str, torch.Tensor]],
            device: torch.device | None = None) -> None:
    """Load (parameter name, tensor) pairs into ``model``, each cast to its parameter's dtype on
    ``device`` (default: the parameter's own, the CPU for a meta model) as it arrives — a no-op
    for tensors already there — so no second copy of the weights is held;
    ``load_state_dict(assign=True)`` then adopts them."""
    params = dict(model.named_parameters())
    state = {}
    for name, t in tensors:
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
    return from_diffusers_config(read_json_object(transformer_folder(path) / CONFIG_NAME))


_LOAD_PROGRESS: ContextVar[Callable[[int, int], Any] | None] = ContextVar("checkpoint_load_progress",
                                                                       default=None)


@contextlib.contextmanager
def load_progress(report: Callable[[int, int], Any]) -> Iterator[None]:
    """Inside the block, every ``load_checkpoint`` calls ``report(bytes read, bytes in all)``
    after each tensor (stored bytes; the CLI's progress bar shows the load apart from the steps).
    A context variable, so the loaders deep inside ``run``, ``replay`` and ``recompute`` need no
    extra argument."""
    token = _LOAD_PROGRESS.set(report)
    try:
        yield
    finally:
        _LOAD_PROGRESS.reset(token)


def _reported(tensors: Iterator[tuple[str, torch.Tensor]], sizes: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` as they come, reported to ``load_progress``'s callback (if any)."""
    report = _LOAD_PROGRESS.get()
    if report is None:
        yield from tensors
        return
    total, done = sum(sizes), 0
    report(0, total)
    for (name, t), size in zip(tensors, sizes):
        done += size
        yield name, t
        report(done, total)


def checked_config(path: str | Path, variant: str | None = None) -> MMDiTConfig:
    """The ``MMDiTConfig`` of a transformer or pipeline folder, checked against its safetensors
    headers as ``load_checkpoint`` checks it first (no tensor read): what a run can size itself
    by before it loads anything.

    Raises:
        As ``load_checkpoint`` before it reads a tensor (files, config, shapes, variant).
    """
    check_variant(variant)
    folder = transformer_folder(path)
    config = read_config(folder)
    check_shapes(config, read_shapes(weight_files(folder, variant)))
    return config


def load_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    variant: str | None = None,
    lora: str | Path | None = None,
    lora_mode: str = "merged",
) -> MMDiT:
    """Load a diffusers-format transformer folder (or a pipeline folder, ``transformer_folder``)
    into an ``MMDiT``, its weight digest computed on the way.

    The config is checked against the safetensors headers (shapes and dtypes) before any tensor
    is read or the model is built, so a hostile config (a billion layers, huge widths) fails at
    once. The model is built on the meta device and each parameter assigned as its tensor
    arrives, tensor by tensor in the weight digest's (sorted) name order (no dict of every stored
    tensor, no second cast copy); the host bytes each one is filled from are hashed meanwhile and
    the digest is pinned to the model (``StreamingDigest.pin``): ``weight_digest(model)`` returns
    it without reading a weight again while the parameters stay unchanged.

    Args:
        path: folder with ``config.json`` and safetensors weights (single file or sharded index),
            or a pipeline folder with ``model_index.json`` and ``transformer/``.
        dtype: model dtype W (fp32 or bf16); ``None`` keeps the checkpoint's own dtype, which must
            then be one dtype for all tensors.
        device: where the parameters live: each tensor is read from its file straight there
            (through a few pinned buffers for a GPU), cast to ``dtype`` on the host on the way
            (``checkpoint_stream.stream_tensors``), so host memory peaks near the weights' size
            on the CPU and at a few 64 MiB buffers for a GPU.
        variant: diffusers weight variant (``"fp16"`` reads ``diffusion_pytorch_model.fp16.safetensors``),
            as ``from_pretrained(..., variant=)``.
        lora: a LoRA adapter to load with the weights (``lora_io.load_lora``'s formats), in LoRA
            mode ``lora_mode``: attached to the meta model, checked, and its factors hashed in
            their sorted places and assigned beside the streamed weights, so the pinned digest is
            the adapted model's (a ``load_lora`` after the load leaves the model unpinned, and
            ``weight_digest`` would read every weight again: a GPU's copied back to the host).

    Raises:
        CheckpointError: missing/unreadable files; a config that is not a JSON object; missing,
            unexpected or mis-shaped keys (all listed in one error); a block count that differs
            from ``num_layers``; non-float tensors; mixed checkpoint dtypes with ``dtype=None``.
        UnsupportedConfigError: a config that drifttool does not implement
            (``from_diffusers_config``), or a variant that is not a plain name.
    """
    check_variant(variant)
    folder = transformer_folder(path)
    config = read_config(folder)
    files = weight_files(folder, variant)
    check_shapes(config, read_shapes(files))
    stored = read_dtypes(files)
    bad_dtype = [f"{k}: {d}" for k, d in stored.items()
                 if d not in SAFETENSORS_DTYPES or not SAFETENSORS_DTYPES[d].is_floating_point]
    if bad_dtype:
        raise CheckpointError(f"non-float tensors ({len(bad_dtype)}): " + ", ".join(bad_dtype[:8]))
    if dtype is None:
        dtypes = sorted({str(SAFETENSORS_DTYPES[d]) for d in stored.values()})
        if len(dtypes) != 1:
            raise CheckpointError(f"{folder}: tensors have mixed dtypes {dtypes}; pass dtype= explicitly")
        dtype = SAFETENSORS_DTYPES[next(iter(stored.values()))]
    device = torch.device(device)
    located = locate_tensors(files)
    wmap = weight_map(config)
    order = sorted(wmap, key=wmap.__getitem__)  # checkpoint names in parameter-name order
    with torch.device("meta"):
        model = MMDiT(config, dtype=dtype)
    adapter = {} if lora is None else adapter_values(model, lora, mode=lora_mode, init=False)
    entries = [(wmap[k], located[k]) for k in order]
    with StreamingDigest(extra=adapter) as digest:
        streamed = _reported(stream_tensors(entries, device=device, dtype=dtype, digest=digest),
                             [w.nbytes for _, w in entries])
        _assign(model, itertools.chain(streamed, adapter.items()), device)
        digest.pin(model)
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
