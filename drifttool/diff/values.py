"""Value drift of step quantities from their stored bytes, in fp64: max abs, rel L2, SDE KL.

    >>> a, b = values("float32", [2], bytes_a), values("float32", [2], bytes_b)   # fp64 arrays
    >>> compare_values(a, b)
    {'max_abs': 0.0039, 'rel_l2': 1.2e-06, 'nonfinite_mismatch': 0, 'note': ''}
    >>> transition_kl(mu_a, mu_b, std_t=np.float64(4.5), sigma=1.0, sigma_next=0.9)
    (3.1e-08, 1.4230)                   # (KL, noise scale s)

KL of the SDE transition (docs/architecture.md, "Step records"; numerics §4): both runs step
x' ~ N(mu, s² I) with ``s = std_t·sqrt(−Δ)``, ``Δ = sigma_next − sigma``, so
``KL = mean over elements of (mu_a − mu_b)² / (2 s²)``, with run A's ``std_t`` and sigmas. (Flow-
GRPO's training KL term divides by ``2·std_t²`` instead of ``2·s²``; this is the transition KL.)

Plain single-threaded numpy (no BLAS, whose spinning threads stall when the cores are busy), with
exact widening (bf16 is its bits shifted into fp32).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

_NUMPY = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
          "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
          "uint8": np.uint8, "bool": np.bool_, "complex64": np.complex64,
          "complex128": np.complex128}


def values(dtype: str, shape: list[int], data: bytes) -> np.ndarray:
    """The tensor stored as raw row-major bytes in a step record, widened exactly to fp64
    (complex to complex128)."""
    if dtype == "bfloat16":
        bits = np.frombuffer(data, np.uint16).astype(np.uint32) << 16
        x = bits.view(np.float32)
    elif dtype in _NUMPY:
        x = np.frombuffer(data, _NUMPY[dtype])
    else:  # fp8 and other torch-only dtypes (torch imported only for them: diff runs without it)
        import torch

        from drifttool.capture.digest import dtype_from_name  # lazy: diff runs without torch

        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype_from_name(dtype))
        x = t.to(torch.float64).numpy()
    wide = np.complex128 if np.iscomplexobj(x) else np.float64
    return x.astype(wide).reshape(shape)


def compare_values(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """``max_abs``, ``rel_l2`` (``‖a−b‖/‖a‖``) over elements finite in both; ``None`` when the
    shapes differ. ``nonfinite_mismatch``: elements finite in one array only."""
    if a.shape != b.shape:
        return {"max_abs": None, "rel_l2": None, "nonfinite_mismatch": 0,
                "note": f"shape {list(a.shape)} vs {list(b.shape)}"}
    fa, fb = np.isfinite(a), np.isfinite(b)
    both = fa & fb
    d = np.abs(a[both] - b[both])
    max_abs = float(d.max()) if d.size else 0.0
    num = float(np.sqrt(np.square(d).sum()))  # not np.dot: BLAS threads stall on busy cores
    den = float(np.sqrt(np.square(np.abs(a[both])).sum()))
    rel = (0.0 if num == 0 else math.inf) if den == 0 else num / den
    mismatch = int(np.count_nonzero(fa != fb))
    return {"max_abs": max_abs, "rel_l2": rel, "nonfinite_mismatch": mismatch, "note": ""}


def transition_kl(mu_a: np.ndarray, mu_b: np.ndarray, *, std_t: np.ndarray, sigma: float,
                  sigma_next: float) -> tuple[float | None, float | None]:
    """``(KL, s)`` of the SDE transitions N(mu_a, s²) vs N(mu_b, s²); ``KL`` is ``None`` when
    ``s`` is 0 anywhere (deterministic step) or the shapes cannot broadcast.

    ``std_t`` may be 0-dim or broadcastable to ``mu``; the KL is then elementwise before the mean.
    """
    s = np.abs(std_t) * math.sqrt(max(sigma - sigma_next, 0.0))
    s_report = float(s.max()) if s.size else None
    if s.size == 0 or bool((s == 0).any()) or mu_a.shape != mu_b.shape:
        return None, s_report
    dmu = np.abs(mu_a - mu_b)
    try:
        kl = (dmu * dmu / (2 * s * s)).mean()
    except ValueError:
        return None, s_report
    return float(kl), s_report
