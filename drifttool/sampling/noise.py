"""Pinned per-sample noise: initial latents and SDE step noise that never depend on the batch.

    >>> pinned = draw_noise(seed=1234, sample_ids=[0, 7], img_grid=(32, 32), num_steps=10)
    >>> pinned.x0.shape, pinned.noise.shape          # [B, N, 4C], [steps, B, N, 4C], fp32
    (torch.Size([2, 1024, 64]), torch.Size([10, 2, 1024, 64]))
    >>> pinned.record["generator"]
    'philox4x64-10+box-muller64-v1'

Two generators (``NOISE_GENERATORS``); every draw of sample ``sample_id`` comes from its own
stream, so a sample's noise depends only on (seed, sample id, C, grid, step index): never on its
batch, its batch position, the SDE window or the number of steps drawn after it. The same
derivation on every rank gives identical noise across ranks (RFC ``dist_sigma_noise_identity``).

``philox`` (default; portable): a counter-based generator in exact integer arithmetic and an
exactly specified float transform, so the same bytes come out on every CPU dispatch level
(``ATEN_CPU_CAPABILITY``) and on a GPU.

- key: the first 16 bytes of SHA-256 of ``"drifttool.noise.philox.v1|{seed}|{sample_id}"``, read
  as two little-endian uint64 (``philox_key``).
- block b (b = 0: the initial latent; b = 1 + i: step i) is the word stream of
  ``numpy.random.Philox(key=key, counter=[0, b, 0, 0]).random_raw(n)``: Philox4x64-10 (Salmon
  et al., SC'11, Random123 constants), word 4j + r being word r of Philox4x64-10(key,
  counter = (j + 1, b, 0, 0)). Word counts stay far below 2^64, so blocks never overlap.
- Box–Muller (``box_muller32``): words (w_{2j}, w_{2j+1}), a = w_{2j} >> 11, b = w_{2j+1} >> 11
  (top 53 bits): u1 = (a + 1)·2^-53 in (0, 1] (exact), r = sqrt(−2·log64(u1)); the angle
  θ = 2π·b·2^-53 = (π/2)(q + f) with q = b >> 51 and f = (b mod 2^51)·2^-51 (both exact);
  normal 2j = fp32(fl64(r·cos θ)), normal 2j + 1 = fp32(fl64(r·sin θ)), with the exact-op FP64
  ``strict_math.log64``/``sincos_quadrant64`` and correctly rounded ×, sqrt.
- consumption: block 0 holds the initial latent in diffusers' unpacked layout (1, C, H', W')
  (H' = 2h, W' = 2w), C-contiguous, then packed to [N, 4C] with
  ``view(1, C, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, N, 4C)`` (numerics §3.2); block
  1 + i holds step i's noise [N, 4C], row-major. Every step has a block whether the SDE window
  uses it or not, and each block is addressed directly (no sequential stream).

``torch`` (opt-in, diffusers parity; CPU-dispatch-dependent): one CPU ``torch.Generator``
(Mersenne Twister) per logical sample, seeded by ``sample_seed``, consumed in the same order
(``randn((1, C, H', W'))`` for x0, packed, then one ``randn((N, 4C))`` per step in step order).
With ``derivation="offset"`` (seed + sample id) the initial latent equals diffusers'
``QwenImagePipeline`` called with ``generator=[torch.Generator().manual_seed(seed + i) ...]`` and
fp32 latents (bf16 pipelines draw the same bits then cast; numerics §3.2). CPU ``torch.randn``
uses SIMD Box–Muller kernels whose last bits depend on the dispatch level, so the record says
``"dispatch_dependent": true``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from drifttool.ops.strict_math import log64, sincos_quadrant64

NOISE_GENERATORS = ("philox", "torch")
PHILOX_NAME = "philox4x64-10+box-muller64-v1"
SEED_DERIVATIONS = ("sha256", "offset")
_SHA_TAG = "drifttool.noise.v1"
_PHILOX_TAG = "drifttool.noise.philox.v1"
_DERIVATION_DOC = {
    "sha256": (
        "sha256-v1",
        f"int.from_bytes(sha256(f'{_SHA_TAG}|{{seed}}|{{sample_id}}'.encode()).digest()[:8], "
        "'little') & (2**63 - 1)",
    ),
    "offset": ("offset-v1", "seed + sample_id (diffusers-style per-sample generator list)"),
}
_BLOCK = 1 << 14  # Box–Muller pairs per block: cache-sized and below torch's intra-op grain (32768),
#                   so no thread pool is woken; blocking changes no bytes (elementwise)


def sample_seed(seed: int, sample_id: int, *, derivation: str = "sha256") -> int:
    """The ``torch`` generator seed of logical sample ``sample_id`` in a run seeded with ``seed``.

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


def philox_key(seed: int, sample_id: int) -> tuple[int, int]:
    """The Philox4x64 key of logical sample ``sample_id``: SHA-256 of
    ``"drifttool.noise.philox.v1|{seed}|{sample_id}"``, bytes 0–7 and 8–15 as little-endian uint64."""
    digest = hashlib.sha256(f"{_PHILOX_TAG}|{int(seed)}|{int(sample_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little")


def philox_words(key: tuple[int, int], block: int, count: int) -> np.ndarray:
    """``count`` uint64 words of block ``block``: ``numpy.random.Philox(key, counter=[0, block,
    0, 0]).random_raw(count)`` (Philox4x64-10; word 4j + r = word r of the output for counter
    (j + 1, block, 0, 0)). Pure integer arithmetic: the same words on every machine."""
    bitgen = np.random.Philox(key=np.array(key, dtype=np.uint64),
                              counter=np.array([0, block, 0, 0], dtype=np.uint64))
    return bitgen.random_raw(count)  # [count] uint64


def box_muller32(top53: torch.Tensor) -> torch.Tensor:
    """Normal fp32 values from pairs of 53-bit integers (the module's Box–Muller).

    Args:
        top53: int64 ``[2n]`` with values in [0, 2^53) (a word's top 53 bits, ``w >> 11``), on
            any device; pair j is (a, b) = (top53[2j], top53[2j+1]).

    Returns:
        fp32 ``[2n]`` on the same device: element 2j = fp32(r·cos θ), 2j + 1 = fp32(r·sin θ) with
        u1 = (a + 1)·2^-53 ∈ (0, 1], r = sqrt(−2·log64(u1)), and θ = 2π·b·2^-53 = (π/2)(q + f)
        with q = b >> 51 and f = (b mod 2^51)·2^-51 (``sincos_quadrant64``). Only exact integer
        and integer→FP64 steps, correctly rounded FP64 ×, −, sqrt and the exact-op
        ``log64``/``sincos_quadrant64``: the bytes depend on the integers alone.

    Raises:
        ValueError: an odd number of integers.
    """
    if top53.numel() % 2:
        raise ValueError(f"box_muller32 needs an even number of integers, got {top53.numel()}")
    pairs = top53.reshape(-1, 2)
    out = torch.empty(pairs.shape, dtype=torch.float32, device=top53.device)  # [n, 2]
    for i in range(0, pairs.shape[0], _BLOCK):
        a, b = pairs[i : i + _BLOCK, 0], pairs[i : i + _BLOCK, 1]
        u1 = (a + 1).to(torch.float64) * 2.0**-53  # (0, 1], exact
        r = torch.sqrt(-2.0 * log64(u1))
        f = (b & ((1 << 51) - 1)).to(torch.float64) * 2.0**-51  # [0, 1), exact
        sin, cos = sincos_quadrant64(b >> 51, f)
        out[i : i + _BLOCK, 0] = r * cos
        out[i : i + _BLOCK, 1] = r * sin
    return out.reshape(-1)


def philox_normals(key: tuple[int, int], block: int, count: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """``count`` (even) fp32 normals of ``block``: ``box_muller32`` of ``philox_words >> 11``,
    the transform run on ``device`` (the words come from the CPU). Returns fp32 ``[count]``."""
    top53 = torch.from_numpy((philox_words(key, block, count) >> np.uint64(11)).astype(np.int64))
    return box_muller32(top53.to(device))


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


def _check_generator(generator: str, derivation: str) -> None:
    if generator not in NOISE_GENERATORS:
        raise ValueError(f"unknown noise generator {generator!r}; expected one of {NOISE_GENERATORS}")
    if derivation not in SEED_DERIVATIONS:
        raise ValueError(f"unknown seed derivation {derivation!r}; expected one of {SEED_DERIVATIONS}")
    if generator == "philox" and derivation != "sha256":
        raise ValueError(f"seed derivation {derivation!r} is unsupported with the philox generator "
                         "(it keys by sha256 only; use generator='torch' for diffusers parity)")


def draw_sample_noise(
    seed: int,
    sample_id: int,
    *,
    img_grid: tuple[int, int],
    num_steps: int,
    channels: int = 16,
    generator: str = "philox",
    derivation: str = "sha256",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's pinned noise, in the module's consumption order.

    Args:
        seed, sample_id: the run seed and the logical sample id.
        img_grid: (h, w) patch grid; the latent is (C, 2h, 2w), N = h·w tokens.
        num_steps: number of sampler steps (one [N, 4C] draw each).
        channels: latent channels C (16 for Qwen-Image; 4C packed channels per token).
        generator: ``philox`` (portable, default) or ``torch`` (diffusers parity).
        derivation: ``torch`` seed derivation (``sample_seed``); ``philox`` accepts ``sha256`` only.

    Returns:
        ``(x0 [N, 4C] fp32, noise [num_steps, N, 4C] fp32)`` on CPU.

    Raises:
        ValueError: bad geometry, unknown generator or derivation, or an unsupported pair.
    """
    h, w = (int(a) for a in img_grid)
    if h < 1 or w < 1 or channels < 1 or num_steps < 0:
        raise ValueError(
            f"bad noise geometry img_grid={img_grid}, channels={channels}, num_steps={num_steps}"
        )
    _check_generator(generator, derivation)
    n, c4 = h * w, 4 * channels
    if generator == "philox":
        key = philox_key(seed, sample_id)
        z = philox_normals(key, 0, n * c4).view(1, channels, 2 * h, 2 * w)  # [1, C, H', W']
        steps = [philox_normals(key, 1 + i, n * c4).view(n, c4) for i in range(num_steps)]  # [N, 4C]
    else:
        g = sample_generator(seed, sample_id, derivation=derivation)
        z = torch.randn((1, channels, 2 * h, 2 * w), generator=g, dtype=torch.float32)  # [1, C, H', W']
        steps = [torch.randn((n, c4), generator=g, dtype=torch.float32) for _ in range(num_steps)]
    x0 = pack_latents(z)[0].contiguous()  # [N, 4C]
    noise = torch.stack(steps) if steps else torch.empty(0, n, c4)  # [S, N, 4C]
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
    generator: str = "philox",
    derivation: str = "sha256",
) -> dict[str, Any]:
    """The manifest record of the noise policy: generator and what its bytes depend on, seed or
    key derivation, dtype, consumption order (JSON-serialisable).

    Raises:
        ValueError: unknown generator or derivation, or an unsupported pair.
    """
    _check_generator(generator, derivation)
    h, w = (int(a) for a in img_grid)
    n, c4 = h * w, 4 * int(channels)
    packing = f"packed view(1,C,h,2,w,2).permute(0,2,4,1,3,5).reshape(1,{n},{c4})"
    common = {
        "generator_device": "cpu",
        "dtype": "float32",
        "seed": int(seed),
        "channels": int(channels),
        "img_grid": [h, w],
        "latent_shape": [1, int(channels), 2 * h, 2 * w],
        "num_steps": int(num_steps),
    }
    if generator == "philox":
        return {
            "generator": PHILOX_NAME,
            "dispatch_dependent": False,
            "numpy_version": np.__version__,
            **common,
            "seed_derivation": "philox-key-sha256-v1",
            "seed_formula": f"key = sha256(f'{_PHILOX_TAG}|{{seed}}|{{sample_id}}'.encode()).digest()"
                            "[0:8], [8:16] as little-endian uint64",
            "bits": "numpy.random.Philox(key=key, counter=[0, block, 0, 0]).random_raw(count) "
                    "(Philox4x64-10); word 4j+r = word r of Philox4x64-10(key, (j+1, block, 0, 0))",
            "transform": "words (a, b) -> top 53 bits (a>>11, b>>11): u1 = ((a>>11)+1)*2^-53, "
                         "r = sqrt(-2*log64(u1)), t = (pi/2)*(q+f), q = b>>62, f = ((b>>11) mod 2^51)*2^-51; "
                         "fp32(r*cos t), fp32(r*sin t) (exact-op FP64 log64/sincos_quadrant64)",
            "consumption_order": [
                f"x0: block 0, {n * c4} normals as (1, {channels}, {2 * h}, {2 * w}) C-contiguous, {packing}",
                f"steps 0..{int(num_steps) - 1}: step i = block 1+i, {n * c4} normals as ({n}, {c4}) "
                "row-major (every step has a block, used inside the SDE window only)",
            ],
        }
    name, formula = _DERIVATION_DOC[derivation]
    return {
        "generator": "torch.Generator (mt19937), one per logical sample",
        "dispatch_dependent": True,
        "torch_version": torch.__version__,
        **common,
        "seed_derivation": name,
        "seed_formula": formula,
        "consumption_order": [
            f"x0: randn(1, {channels}, {2 * h}, {2 * w}) fp32, {packing}",
            f"steps 0..{int(num_steps) - 1}: randn({n}, {c4}) fp32 each, in step "
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
    generator: str = "philox",
    derivation: str = "sha256",
) -> PinnedNoise:
    """Pinned noise for ``sample_ids`` stacked along the batch axis (each drawn independently by
    ``draw_sample_noise``); returns ``PinnedNoise`` with the manifest record.

    Raises:
        ValueError: no sample ids, or as ``draw_sample_noise``.
    """
    ids = [int(s) for s in sample_ids]
    if not ids:
        raise ValueError("draw_noise needs at least one sample id")
    record = noise_record(seed, img_grid=img_grid, num_steps=num_steps, channels=channels,
                          generator=generator, derivation=derivation)
    pairs = [
        draw_sample_noise(seed, sid, img_grid=img_grid, num_steps=num_steps, channels=channels,
                          generator=generator, derivation=derivation)
        for sid in ids
    ]
    x0 = torch.stack([p[0] for p in pairs])  # [B, N, 4C]
    noise = torch.stack([p[1] for p in pairs], dim=1)  # [S, B, N, 4C]
    return PinnedNoise(sample_ids=ids, x0=x0, noise=noise, record=record)
