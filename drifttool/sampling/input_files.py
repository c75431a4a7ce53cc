"""Replay inputs from files: a real pipeline's prompt embeddings and initial latents.

    >>> ext = read_external_inputs(prompt_embeds="pe.safetensors", negative_prompt_embeds=None,
    ...                            latents="x0.safetensors", config=cfg, img_grid=(64, 64))
    >>> ext.txt.shape, ext.txt_mask, ext.x0.shape, ext.files["latents"]["sha256"][:8]
    (torch.Size([1, 128, 3584]), None, torch.Size([1, 4096, 64]), '5c1e…')

Formats (safetensors only: never pickle):

- ``--prompt-embeds`` / ``--negative-prompt-embeds``: ``prompt_embeds`` [B, L, joint_attention_dim]
  (float32, bfloat16 or float16) and optionally ``prompt_embeds_mask`` [B, L] (integer or bool,
  0/1), as ``QwenImagePipeline.encode_prompt`` returns them (it returns the mask as None when
  every token is valid: an absent mask means all valid). Prompts are right-padded: the valid
  tokens of each row are a prefix of it. L is kept as given (the padding length is part of what a
  production run computes).
- ``--latents``: ``latents`` [B, N, in_channels], packed exactly as ``QwenImagePipeline.__call__
  (latents=...)`` takes them (numerics §3.2: N = (H/16)(W/16) image tokens, in_channels = 4·C).
- ``--condition``: the edit pipelines' condition images, already VAE-encoded, normalised and
  packed: ``image_latents`` [B or 1, Nc, in_channels] (each image's packed latents concatenated
  along the tokens, as ``QwenImageEdit[Plus]Pipeline.prepare_latents`` returns them) and
  ``condition_grids`` [K, 2] integers, the (h_k, w_k) patch grid of each image in order
  (Σ h_k·w_k = Nc; the pipeline's ``img_shapes[0][1:]``). One row serves every sample.

Every tensor is upcast exactly to float32 (the fixture's embeddings and drawn latents are fp32;
the model-input cast to W then gives the same bytes as casting the file's values directly).
Each file is read once into memory; its SHA-256 (of exactly the bytes parsed) is recorded
(``ExternalInputs.files``). Every check fails with one line naming the file and the key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from drifttool.errors import DriftToolError
from drifttool.model.config import MMDiTConfig

EMBEDS_KEY = "prompt_embeds"
MASK_KEY = "prompt_embeds_mask"
LATENTS_KEY = "latents"
COND_KEY = "image_latents"
COND_GRIDS_KEY = "condition_grids"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Value dtypes accepted in the files (each upcasts exactly to float32)."""
MASK_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
ROLES = ("prompt_embeds", "negative_prompt_embeds", "latents", "condition")
"""The ``input_files`` keys of the manifest's settings, one per option."""


@dataclass(frozen=True, kw_only=True)
class ExternalInputs:
    """Replay inputs read from files (CPU tensors), each None when its file was not given.

    Attributes:
        txt: [B, L, D] fp32 prompt embeddings; txt_mask: [B, L] bool, None when all valid.
        neg_txt: [B, L', D] fp32 negative prompt embeddings; neg_mask likewise.
        x0: [B, N, Cp] fp32 initial packed latents.
        cond: [B or 1, Nc, Cp] fp32 packed condition latents; cond_grids: their (h, w) grids.
        files: role (``ROLES``) → ``{"path": resolved path, "sha256": hex digest}``.
    """

    txt: torch.Tensor | None = None
    txt_mask: torch.Tensor | None = None
    neg_txt: torch.Tensor | None = None
    neg_mask: torch.Tensor | None = None
    x0: torch.Tensor | None = None
    cond: torch.Tensor | None = None
    cond_grids: tuple[tuple[int, int], ...] = ()
    files: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def batch(self) -> int | None:
        """The batch size the files fix (None when no file holds one)."""
        for t in (self.txt, self.x0):
            if t is not None:
                return int(t.shape[0])
        if self.cond is not None and self.cond.shape[0] > 1:
            return int(self.cond.shape[0])
        return None


def _read(path: str | Path, option: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a safetensors file and its record; the digest is of the bytes parsed."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_bytes

    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise DriftToolError(f"{option} {p}: cannot read ({e.strerror or e})") from None
    try:
        tensors = load_bytes(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise DriftToolError(f"{option} {p}: not a readable safetensors file "
                             f"({type(e).__name__}: {str(e)[:160]})") from None
    return tensors, {"path": str(p.resolve()), "sha256": hashlib.sha256(data).hexdigest()}


def _only(tensors: dict[str, torch.Tensor], keys: tuple[str, ...], where: str) -> None:
    """Refuse a tensor under a key outside ``keys``: it would be ignored silently (e.g. a
    ``negative_prompt_embeds`` in the prompt file would silently turn CFG off)."""
    unexpected = sorted(set(tensors) - set(keys))
    if unexpected:
        raise DriftToolError(f"{where}: unexpected key(s) {unexpected[:5]} (this file holds "
                             f"{' and '.join(repr(k) for k in keys)} only; a negative prompt goes "
                             "in its own --negative-prompt-embeds file)")


def _tensor(tensors: dict[str, torch.Tensor], key: str, where: str, rank: int,
            dims: str) -> torch.Tensor:
    if key not in tensors:
        held = ", ".join(sorted(tensors)[:6]) or "nothing"
        raise DriftToolError(f"{where}: no tensor {key!r} (the file holds {held})")
    t = tensors[key]
    if t.dim() != rank or 0 in t.shape:
        raise DriftToolError(f"{where}: {key!r} has shape {list(t.shape)}, expected {dims} "
                             "with every size > 0")
    return t


def _floats(t: torch.Tensor, key: str, where: str) -> torch.Tensor:
    """``t`` upcast exactly to fp32, refusing other dtypes and non-finite values."""
    if t.dtype not in FLOAT_DTYPES:
        raise DriftToolError(f"{where}: {key!r} is {str(t.dtype).removeprefix('torch.')}, expected "
                             "float32, bfloat16 or float16")
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        first = tuple(bad.nonzero()[0].tolist())
        raise DriftToolError(f"{where}: {key!r} holds {int(bad.sum())} non-finite value(s), "
                             f"first at index {first}")
    return t.to(torch.float32).contiguous()


def _mask(tensors: dict[str, torch.Tensor], shape: tuple[int, int], where: str) -> torch.Tensor | None:
    """The [B, L] bool key mask (None: absent or all valid), checked 0/1 and right-padded."""
    if MASK_KEY not in tensors:
        return None
    m = _tensor(tensors, MASK_KEY, where, 2, f"[B, L] = {list(shape)}")
    if tuple(m.shape) != shape:
        raise DriftToolError(f"{where}: {MASK_KEY!r} has shape {list(m.shape)}, {EMBEDS_KEY!r} "
                             f"needs [B, L] = {list(shape)}")
    if m.dtype not in MASK_DTYPES:
        raise DriftToolError(f"{where}: {MASK_KEY!r} is {str(m.dtype).removeprefix('torch.')}, "
                             "expected an integer or bool 0/1 mask")
    wide = m.to(torch.int64)
    odd = (wide != 0) & (wide != 1)
    if bool(odd.any()):
        first = tuple(odd.nonzero()[0].tolist())
        raise DriftToolError(f"{where}: {MASK_KEY!r} must hold 0 or 1, found {int(wide[first])} "
                             f"at index {first}")
    mask = wide.to(torch.bool)
    # right padding only: once a row has a masked token, every later token is masked too
    gap = (~mask).to(torch.int64).cummax(dim=1).values.to(torch.bool) & mask
    if bool(gap.any()):
        b, t = gap.nonzero()[0].tolist()
        raise DriftToolError(f"{where}: {MASK_KEY!r} row {b}: valid tokens are not a prefix (token "
                             f"{t} is valid after a masked one); only right-padded prompts are read")
    return None if bool(mask.all()) else mask


def read_embeds(path: str | Path, option: str, joint_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, str]]:
    """(txt [B, L, D] fp32, mask [B, L] bool or None, file record) of a prompt-embeddings file.

    Raises:
        DriftToolError: unreadable file; missing or unexpected key; wrong rank, width ≠
            ``joint_dim``, dtype or non-finite values; a mask of another shape, not 0/1, or not
            right-padded.
    """
    tensors, record = _read(path, option)
    where = f"{option} {path}"
    t = _tensor(tensors, EMBEDS_KEY, where, 3, f"[B, L, joint_attention_dim={joint_dim}]")
    _only(tensors, (EMBEDS_KEY, MASK_KEY), where)
    if t.shape[2] != joint_dim:
        raise DriftToolError(f"{where}: {EMBEDS_KEY!r} has width {t.shape[2]}, the model's "
                             f"joint_attention_dim is {joint_dim}")
    txt = _floats(t, EMBEDS_KEY, where)
    return txt, _mask(tensors, tuple(t.shape[:2]), where), record


def read_latents(path: str | Path, option: str, img_grid: tuple[int, int], channels: int
                 ) -> tuple[torch.Tensor, dict[str, str]]:
    """(x0 [B, N, Cp] fp32, file record) of a packed-latents file (N = h·w, Cp = ``channels``).

    Raises:
        DriftToolError: unreadable file; missing or unexpected key; wrong rank, token count,
            channels, dtype or non-finite values.
    """
    tensors, record = _read(path, option)
    where = f"{option} {path}"
    h, w = img_grid
    t = _tensor(tensors, LATENTS_KEY, where, 3, f"packed [B, N={h * w}, in_channels={channels}]")
    _only(tensors, (LATENTS_KEY,), where)
    if t.shape[1] != h * w:
        raise DriftToolError(f"{where}: {LATENTS_KEY!r} holds {t.shape[1]} image tokens, the "
                             f"{h}x{w} patch grid ({16 * h}x{16 * w} px) has {h * w}; give the "
                             "image's --height/--width")
    if t.shape[2] != channels:
        raise DriftToolError(f"{where}: {LATENTS_KEY!r} has {t.shape[2]} packed channels, the "
                             f"model's in_channels is {channels}")
    return _floats(t, LATENTS_KEY, where), record


def read_condition(path: str | Path, option: str, channels: int
                   ) -> tuple[torch.Tensor, tuple[tuple[int, int], ...], dict[str, str]]:
    """(cond [B, Nc, Cp] fp32, grids ((h_k, w_k), ...), file record) of a condition-latents file.

    Raises:
        DriftToolError: unreadable file; missing or unexpected key; wrong rank, channels, dtype
            or non-finite values; grids that are not [K, 2] positive integers or do not sum to Nc.
    """
    tensors, record = _read(path, option)
    where = f"{option} {path}"
    t = _tensor(tensors, COND_KEY, where, 3, f"packed [B, Nc, in_channels={channels}]")
    g = _tensor(tensors, COND_GRIDS_KEY, where, 2, "[K, 2] (h, w) patch grids")
    _only(tensors, (COND_KEY, COND_GRIDS_KEY), where)
    if t.shape[2] != channels:
        raise DriftToolError(f"{where}: {COND_KEY!r} has {t.shape[2]} packed channels, the "
                             f"model's in_channels is {channels}")
    if g.shape[1] != 2 or g.dtype not in MASK_DTYPES[:-1] or bool((g.to(torch.int64) < 1).any()):
        raise DriftToolError(f"{where}: {COND_GRIDS_KEY!r} must be [K, 2] positive integers (the "
                             f"(h, w) patch grid of each condition image), got "
                             f"{str(g.dtype).removeprefix('torch.')} {list(g.shape)}")
    grids = tuple((int(a), int(b)) for a, b in g.to(torch.int64).tolist())
    nc = sum(a * b for a, b in grids)
    if t.shape[1] != nc:
        raise DriftToolError(f"{where}: {COND_KEY!r} holds {t.shape[1]} tokens, the condition "
                             f"grids {[list(x) for x in grids]} give {nc}")
    return _floats(t, COND_KEY, where), grids, record


def read_external_inputs(
    *,
    prompt_embeds: str | Path | None,
    negative_prompt_embeds: str | Path | None,
    latents: str | Path | None,
    config: MMDiTConfig,
    img_grid: tuple[int, int],
    batch: int | None = None,
    condition: str | Path | None = None,
) -> ExternalInputs | None:
    """Read and check the given files (module docstring); None when none is given.

    Args:
        batch: the run's sample count when the user fixed it (``--batch``/``--samples``); the
            files must then hold that many rows. Otherwise they must agree with each other.

    Raises:
        DriftToolError: as ``read_embeds``/``read_latents``/``read_condition``; a negative prompt
            without a prompt; files (or the run) disagreeing on the batch size (a condition file
            of one row fits any batch).
    """
    if prompt_embeds is None and negative_prompt_embeds is None and latents is None \
            and condition is None:
        return None
    if negative_prompt_embeds is not None and prompt_embeds is None:
        raise DriftToolError("--negative-prompt-embeds goes with --prompt-embeds (the prompts "
                             "of the same pipeline call)")
    kw: dict[str, Any] = {}
    files: dict[str, dict[str, str]] = {}
    rows: list[tuple[str, int]] = []
    if prompt_embeds is not None:
        kw["txt"], kw["txt_mask"], files["prompt_embeds"] = read_embeds(
            prompt_embeds, "--prompt-embeds", config.joint_attention_dim)
        rows.append((f"--prompt-embeds {prompt_embeds}", kw["txt"].shape[0]))
    if negative_prompt_embeds is not None:
        kw["neg_txt"], kw["neg_mask"], files["negative_prompt_embeds"] = read_embeds(
            negative_prompt_embeds, "--negative-prompt-embeds", config.joint_attention_dim)
        rows.append((f"--negative-prompt-embeds {negative_prompt_embeds}", kw["neg_txt"].shape[0]))
    if latents is not None:
        kw["x0"], files["latents"] = read_latents(latents, "--latents", tuple(img_grid),
                                                  config.in_channels)
        rows.append((f"--latents {latents}", kw["x0"].shape[0]))
    if condition is not None:
        kw["cond"], kw["cond_grids"], files["condition"] = read_condition(
            condition, "--condition", config.in_channels)
        if kw["cond"].shape[0] != 1:
            rows.append((f"--condition {condition}", kw["cond"].shape[0]))
    if not rows:
        return ExternalInputs(**kw, files=files)
    want = batch if batch is not None else rows[0][1]
    for where, b in rows:
        if b != want:
            whose = ("the run has" if batch is not None else f"{rows[0][0]} holds")
            raise DriftToolError(f"{where}: holds {b} batch row{'s' * (b != 1)}, {whose} {want} "
                                 f"sample{'s' * (want != 1)}"
                                 f"{' (--batch/--samples)' if batch is not None else ''}")
    return ExternalInputs(**kw, files=files)
