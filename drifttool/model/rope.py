"""Three-axis RoPE tables of the Qwen-Image MMDiT (diffusers ``QwenEmbedRope``, numerics §2.2).

    >>> img, txt = rope_tables((4, 6), 7, axes_dims=(4, 6, 6))
    >>> img.shape, img.dtype, txt.shape
    (torch.Size([24, 8]), torch.complex64, torch.Size([7, 8]))

Per axis of size D_a: ``inv_a[i] = 1 / 10000^(fp32(2i) / D_a)`` (fp32); position p rotates by
``e^{i·θ}``, θ = fp32(p)·inv_a[i] (one fp32 product, as ``torch.outer`` forms it in diffusers).
A token's table row is the concatenation ``[frame axis (D_0/2) | row axis (D_1/2) | column axis
(D_2/2)]``. Two table algorithms (``ROPE_ALGORITHMS``), chosen by the operator backend
(``BACKEND_TABLES``) and recorded in the fingerprint:

- ``exact`` (strict backend): e = fp32(2i)/D_a (one fp32 division); theta^e =
  ``exp64(e·log64(theta))`` in FP64 rounded once to fp32; inv = fp32 1/that; θ the fp32 product;
  cos θ, sin θ by the exact-op FP64 ``strict_math.sincos64`` of the (exact) FP64 value of θ, each
  rounded once to fp32. Only correctly rounded IEEE operations: the same bytes on every CPU
  dispatch level (``ATEN_CPU_CAPABILITY``) and on a GPU; within half an fp32 ULP of the FP64 cos/sin
  of the fp32 angle except within ~1e-15 of a rounding tie.
- ``polar`` (production backend): diffusers' own arithmetic, fp32 ``torch.pow`` and
  ``torch.polar``; byte-equal to diffusers 0.42.1 on the same machine, but its last bit depends on
  the CPU's SIMD dispatch (as diffusers' does).

Positions (scale_rope=True):

- image token n = i·w + j of an h×w patch grid: (0, i − ⌈h/2⌉, j − ⌈w/2⌉);
- text token k: (p, p, p) with p = max(⌊h/2⌋, ⌊w/2⌋) + k, over the *padded* length L.

With condition images (the edit pipelines' ``img_shapes = [(1, h, w), (1, h_1, w_1), ...]``,
``QwenEmbedRope.forward``), the image rows are the generated image's, then each condition image's
in order: image k (0 = the generated one) has frame position k and its own centred row and
column positions, (k, i − ⌈h_k/2⌉, j − ⌈w_k/2⌉); the text offset is the largest
max(⌊h_k/2⌋, ⌊w_k/2⌋) over all the images.

Tables are computed on the CPU (as diffusers does, at construction) and then moved to the device.
Results are cached by (grid, L, axes, theta, algorithm, device); callers must not modify them in
place.
"""

from __future__ import annotations

import functools

import torch

from drifttool.ops.strict_math import exp64, log64, sincos64

ROPE_ALGORITHMS = {
    "exact": "exact-v1: fp32 angles fp32(p)*fp32(1/fp32(exp64(fp32(2i)/D*log64(theta)))), "
             "cos/sin by exact-op FP64 sincos64 rounded once to fp32 (portable)",
    "polar": "polar-v1: fp32 torch.pow and torch.polar as diffusers 0.42.1 (CPU-dispatch-dependent)",
}
BACKEND_TABLES = {"strict": "exact", "production": "polar"}  # backend family -> table algorithm


def rope_inv_freqs(axis_dim: int, theta: float = 10000, *, algorithm: str = "exact") -> torch.Tensor:
    """Inverse frequencies of one axis: ``1 / theta^(fp32(2i) / axis_dim)``, fp32 ``[axis_dim/2]``.

    ``exact``: theta^e in FP64 by exact-op ``exp64``/``log64``, rounded once to fp32, then an fp32
    division. ``polar``: fp32 ``torch.pow`` as diffusers (dispatch-dependent).

    Raises:
        ValueError: ``axis_dim`` is odd, or an unknown algorithm.
    """
    if axis_dim % 2:
        raise ValueError(f"RoPE axis size must be even, got {axis_dim}")
    exponents = torch.arange(0, axis_dim, 2).to(torch.float32).div(axis_dim)  # [axis_dim/2] fp32
    if algorithm == "exact":
        log_theta = log64(torch.tensor(float(theta), dtype=torch.float64))
        power = exp64(exponents.to(torch.float64) * log_theta).to(torch.float32)
        return 1.0 / power
    if algorithm == "polar":
        return 1.0 / torch.pow(theta, exponents)
    raise ValueError(f"unknown RoPE table algorithm {algorithm!r}; expected one of {sorted(ROPE_ALGORITHMS)}")


def image_positions(h: int, w: int, frame: int = 0) -> torch.Tensor:
    """Integer positions (frame, row, column) of the h·w image tokens of the image at frame
    position ``frame`` (0: the generated image; k: the k-th condition image), row-major: int64
    ``[h·w, 3]``."""
    rows = torch.arange(h) - (h - h // 2)  # i − ⌈h/2⌉
    cols = torch.arange(w) - (w - w // 2)  # j − ⌈w/2⌉
    pos = torch.zeros(h, w, 3, dtype=torch.int64)
    pos[:, :, 0] = int(frame)
    pos[:, :, 1] = rows[:, None]
    pos[:, :, 2] = cols[None, :]
    return pos.reshape(h * w, 3)  # [N, 3]


def text_positions(h: int, w: int, txt_len: int, cond_grids: tuple[tuple[int, int], ...] = ()
                   ) -> torch.Tensor:
    """Positions of the text tokens: (p, p, p), p = max over the images (the h×w one and each
    of ``cond_grids``) of max(⌊h_k/2⌋, ⌊w_k/2⌋), plus k; int64 ``[L, 3]``."""
    offset = max(max(a // 2, b // 2) for a, b in ((h, w), *cond_grids))
    p = offset + torch.arange(txt_len, dtype=torch.int64)  # [L]
    return p[:, None].expand(txt_len, 3).clone()  # [L, 3]


def rope_table(
    positions: torch.Tensor, axes_dims: tuple[int, ...], theta: float = 10000, *, algorithm: str = "exact"
) -> torch.Tensor:
    """Complex rotations for integer ``positions [S, 3]``: complex64 ``[S, sum(axes_dims)/2]``.

    Each entry is e^{i·θ} with the fp32 angle θ = fp32(p_a) · inv_a[i] of §2.2, axes
    concatenated in order; ``algorithm`` as in the module docstring (``exact`` or ``polar``).

    Raises:
        ValueError: an unknown algorithm, or ``exact`` with an angle of magnitude ≥ 2^20.
    """
    parts = []
    for a, dim in enumerate(axes_dims):
        inv = rope_inv_freqs(dim, theta, algorithm=algorithm).to(positions.device)  # [dim/2] fp32
        angles = positions[:, a].to(torch.float32)[:, None] * inv[None, :]  # [S, dim/2] fp32
        if algorithm == "exact":
            sin, cos = sincos64(angles)  # FP64 of the exact fp32 angle
            parts.append(torch.complex(cos.to(torch.float32), sin.to(torch.float32)))
        else:
            parts.append(torch.polar(torch.ones_like(angles), angles))
    return torch.cat(parts, dim=1)  # [S, Dh/2]


@functools.lru_cache(maxsize=64)
def _cached_tables(
    h: int, w: int, txt_len: int, axes_dims: tuple[int, ...], theta: float, algorithm: str, device: str,
    cond_grids: tuple[tuple[int, int], ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    grids = ((h, w), *cond_grids)
    pos = torch.cat([image_positions(a, b, frame=k) for k, (a, b) in enumerate(grids)])  # [N + Nc, 3]
    img = rope_table(pos, axes_dims, theta, algorithm=algorithm)  # [N + Nc, Dh/2]
    txt = rope_table(text_positions(h, w, txt_len, cond_grids), axes_dims, theta,
                     algorithm=algorithm)  # [L, Dh/2]
    return img.to(device), txt.to(device)


def rope_tables(
    img_grid: tuple[int, int],
    txt_len: int,
    *,
    axes_dims: tuple[int, ...] = (16, 56, 56),
    theta: float = 10000,
    algorithm: str = "exact",
    device: torch.device | str = "cpu",
    cond_grids: tuple[tuple[int, int], ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image and text RoPE tables for one forward (numerics §2.2).

    Args:
        img_grid: (h, w) patch grid; N = h·w.
        cond_grids: the (h_k, w_k) patch grid of each condition image, in sequence order (edit
            pipelines); their rows follow the N generated-image rows, image k at frame position k
            (module docstring). Nc = Σ h_k·w_k.
        txt_len: padded text length L (RoPE ignores the mask, as diffusers 0.42.1 does).
        axes_dims: per-axis sizes (frame, row, column), each even.
        theta: RoPE base.
        algorithm: ``exact`` (portable, strict) or ``polar`` (diffusers, production); see
            ``BACKEND_TABLES``.
        device: where the tables are placed (computed on the CPU first).

    Returns:
        ``(img [N + Nc, Dh/2], txt [L, Dh/2])``, complex64, cached (do not modify in place).

    Raises:
        ValueError: unknown algorithm, odd axis size, a grid with a side < 1.
    """
    if algorithm not in ROPE_ALGORITHMS:
        raise ValueError(f"unknown RoPE table algorithm {algorithm!r}; expected one of {sorted(ROPE_ALGORITHMS)}")
    h, w = (int(v) for v in img_grid)
    conds = tuple((int(a), int(b)) for a, b in cond_grids)
    if min((h, w, *(v for g in conds for v in g))) < 1:
        raise ValueError(f"every patch grid needs sides >= 1, got {(h, w)} and conditions {conds}")
    return _cached_tables(h, w, int(txt_len), tuple(int(a) for a in axes_dims), theta, algorithm,
                          str(torch.device(device)), conds)
