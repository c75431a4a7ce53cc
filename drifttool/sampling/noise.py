"""Pinned per-sample noise: initial latents and SDE step noise that never depend on the batch.

    >>> pinned = draw_noise(seed=1234, sample_ids=[0, 7], img_grid=(32, 32), num_steps=10)
    >>> pinned.x0.shape, pinned.noise.shape          # [B, N, 4C], [steps, B, N, 4C], fp32
    (torch.Size([2, 1024, 64]), torch.Size([10, 2, 1024, 64]))
    >>> pinned.record["seed_derivation"]
    'sha256-v1'

Each logical sample owns one CPU ``torch.Generator`` (Mersenne Twister), seeded from
(run seed, sample id) by ``sample_seed``. Its stream is consumed in this fixed order:

1. the initial latent, ``randn((1, C, H', W'), fp32)`` in diffusers' unpacked layout (numerics
   §3.2, §5 trap 13; H' = 2h, W' = 2w for the patch grid (h, w)), then packed to [N, 4C] with
   ``view(1, C, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, N, 4C)``;
2. then one ``randn((N, 4C), fp32)`` per sampler step i = 0 … num_steps − 1, in step order.
   Steps outside the SDE window draw too (the draw is simply unused), so the noise of step i
   never depends on where the window is.

A sample's noise therefore depends only on (seed, sample id, C, grid, step index): never on its
batch, its batch position, the SDE window or the number of steps drawn after it. The same
derivation on every rank gives identical noise across ranks (RFC ``dist_sigma_noise_identity``).
With ``derivation="offset"`` (seed + sample id) the initial latent equals diffusers'
``QwenImagePipeline`` called with ``generator=[torch.Generator().manual_seed(seed + i) ...]`` and
fp32 latents (bf16 pipelines draw the same bits then cast; numerics §3.2).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

SEED_DERIVATIONS = ("sha256", "offset")
_SHA_TAG = "drifttool.noise.v1"
_DERIVATION_DOC = {
    "sha256": (
        "sha256-v1",
        f"int.from_bytes(sha256(f'{_SHA_TAG}|{{seed}}|{{sample_id}}'.encode()).digest()[:8], "
        "'little') & (2**63 - 1)",
    ),
    "offset": ("offset-v1", "seed + sample_id (diffusers-style per-sample generator list)"),
}


def sample_seed(seed: int, sample_id: int, *, derivation: str = "sha256") -> int:
    """The generator seed of logical sample ``sample_id`` in a run seeded with ``seed``.

    ``"sha256"`` (default): the first 8 bytes (little-endian) of SHA-256 of the UTF-8 string
    ``"drifttool.noise.v1|{seed}|{sample_id}"``, masked to 63 bits — distinct streams for
    distinct (seed, sample) pairs, stable across platforms and Python versions.
    ``"offset"``: ``seed + sample_id`` (reproduces a diffusers run with per-sample generators).

    Raises:
        ValueError: unknown derivation, or an ``offset`` seed outside [0, 2^63).
    """
    seed, sample_id = int(seed), int(sample_id)
    if derivation == "sha256":
        digest = hashlib.sha256(f"{_SHA_TAG}|{seed}|{sample_id}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    if derivation == "offset":
        out = seed + sample_id
        if not 0 <= out < (1 << 63):
            raise ValueError(f"offset seed {out} outside [0, 2^63)")
        return out
    raise ValueError(f"unknown seed derivation {derivation!r}; expected one of {SEED_DERIVATIONS}")


def sample_generator(seed: int, sample_id: int, *, derivation: str = "sha256") -> torch.Generator:
    """A fresh CPU ``torch.Generator`` seeded with ``sample_seed(seed, sample_id)``."""
    g = torch.Generator(device="cpu")
    g.manual_seed(sample_seed(seed, sample_id, derivation=derivation))
    return g


def pack_latents(z: torch.Tensor) -> torch.Tensor:
    """2×2-pack unpacked latents, diffusers' layout (numerics §3.2): [B, C, H', W'] → [B, N, 4C].

    Token n = i·(W'/2) + j, channel c·4 + dy·2 + dx. Pure data movement (bytes preserved).

    Raises:
        ValueError: not 4-D or odd H'/W'.
    """
    if z.dim() != 4 or z.shape[2] % 2 or z.shape[3] % 2:
        raise ValueError(
            f"pack_latents expects [B, C, H', W'] with even H', W', got {tuple(z.shape)}"
        )
    B, C, H, W = z.shape
    z = z.view(B, C, H // 2, 2, W // 2, 2)  # [B, C, h, 2, w, 2]
    z = z.permute(0, 2, 4, 1, 3, 5)  # [B, h, w, C, 2, 2]
    return z.reshape(B, (H // 2) * (W // 2), C * 4)  # [B, N, 4C]


def draw_sample_noise(
    seed: int,
    sample_id: int,
    *,
    img_grid: tuple[int, int],
    num_steps: int,
    channels: int = 16,
    derivation: str = "sha256",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's pinned noise, in the module's consumption order.

    Args:
        seed, sample_id: see ``sample_seed``.
        img_grid: (h, w) patch grid; the latent is (C, 2h, 2w), N = h·w tokens.
        num_steps: number of sampler steps (one [N, 4C] draw each).
        channels: latent channels C (16 for Qwen-Image; 4C packed channels per token).

    Returns:
        ``(x0 [N, 4C] fp32, noise [num_steps, N, 4C] fp32)`` on CPU.
    """
    h, w = (int(a) for a in img_grid)
    if h < 1 or w < 1 or channels < 1 or num_steps < 0:
        raise ValueError(
            f"bad noise geometry img_grid={img_grid}, channels={channels}, num_steps={num_steps}"
        )
    g = sample_generator(seed, sample_id, derivation=derivation)
    z = torch.randn((1, channels, 2 * h, 2 * w), generator=g, dtype=torch.float32)  # [1, C, H', W']
    x0 = pack_latents(z)[0].contiguous()  # [N, 4C]
    steps = [
        torch.randn((h * w, 4 * channels), generator=g, dtype=torch.float32)  # [N, 4C]
        for _ in range(num_steps)
    ]
    noise = torch.stack(steps) if steps else torch.empty(0, h * w, 4 * channels)  # [S, N, 4C]
    return x0, noise


@dataclass(kw_only=True)
class PinnedNoise:
    """Batched pinned noise for a list of logical samples.

    Attributes:
        x0: [B, N, 4C] fp32 initial packed latents (row b is sample ``sample_ids[b]``).
        noise: [num_steps, B, N, 4C] fp32 SDE step noise.
        record: the manifest record (``noise_record``).
    """

    sample_ids: list[int]
    x0: torch.Tensor
    noise: torch.Tensor
    record: dict[str, Any]


def noise_record(
    seed: int,
    *,
    img_grid: tuple[int, int],
    num_steps: int,
    channels: int = 16,
    derivation: str = "sha256",
) -> dict[str, Any]:
    """The manifest record of the noise policy: generator device and dtype, seed derivation,
    consumption order (JSON-serialisable)."""
    if derivation not in SEED_DERIVATIONS:
        raise ValueError(f"unknown seed derivation {derivation!r}")
    h, w = (int(a) for a in img_grid)
    name, formula = _DERIVATION_DOC[derivation]
    return {
        "generator": "torch.Generator (mt19937), one per logical sample",
        "generator_device": "cpu",
        "dtype": "float32",
        "torch_version": torch.__version__,
        "seed": int(seed),
        "seed_derivation": name,
        "seed_formula": formula,
        "channels": int(channels),
        "img_grid": [h, w],
        "latent_shape": [1, int(channels), 2 * h, 2 * w],
        "num_steps": int(num_steps),
        "consumption_order": [
            f"x0: randn(1, {channels}, {2 * h}, {2 * w}) fp32, packed "
            f"view(1,C,h,2,w,2).permute(0,2,4,1,3,5).reshape(1,{h * w},{4 * channels})",
            f"steps 0..{int(num_steps) - 1}: randn({h * w}, {4 * channels}) fp32 each, in step "
            "order (drawn for every step, used inside the SDE window only)",
        ],
    }


def draw_noise(
    seed: int,
    sample_ids: Sequence[int],
    *,
    img_grid: tuple[int, int],
    num_steps: int,
    channels: int = 16,
    derivation: str = "sha256",
) -> PinnedNoise:
    """Pinned noise for ``sample_ids`` stacked along the batch axis (each drawn independently by
    ``draw_sample_noise``); returns ``PinnedNoise`` with the manifest record."""
    ids = [int(s) for s in sample_ids]
    if not ids:
        raise ValueError("draw_noise needs at least one sample id")
    pairs = [
        draw_sample_noise(seed, sid, img_grid=img_grid, num_steps=num_steps, channels=channels,
                          derivation=derivation)
        for sid in ids
    ]
    x0 = torch.stack([p[0] for p in pairs])  # [B, N, 4C]
    noise = torch.stack([p[1] for p in pairs], dim=1)  # [S, B, N, 4C]
    record = noise_record(seed, img_grid=img_grid, num_steps=num_steps, channels=channels,
                          derivation=derivation)
    return PinnedNoise(sample_ids=ids, x0=x0, noise=noise, record=record)
