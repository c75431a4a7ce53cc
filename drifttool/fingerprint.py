"""``qwenimage_arch_fingerprint``: what must match for two runs to be comparable, and what else
differs between them.

    {"arch":     {...MMDiTConfig.arch_fields(), "img_grid": [h, w]},   # differs → incomparable
     "weights":  "xxh3_128:…",                                         # differs → diffed, listed
     "dtype_policy": {...}, "scheduler": {...}, "cfg": {...}, "sde": {...}, "runtime": {...},
     "inputs":   {"rope_tables": "exact-v1: …", "noise": "philox4x64-10+box-muller64-v1",
                  "cpu_capability": None}}                            # version 2

``inputs`` names what the strict inputs' bytes depend on: the RoPE table algorithm (``exact``
for the strict backend, diffusers' ``polar`` for production; ``model.rope.BACKEND_TABLES``) and
the noise generator (``sampling.noise``). Where either is CPU-dispatch-dependent (``polar``, the
``torch`` generator), ``cpu_capability`` records ``torch.backends.cpu.get_cpu_capability()``;
it is None when every input is portable.

Only ``arch`` decides incomparability (record shapes and identities depend on it); every other
field is a setting whose differences ``drifttool diff`` lists first and then diffs through.

The manifest pins tensors by ``tensor_digest`` (``"digest_v2:<16 hex>"``, the capture digest of
dtype, shape and bytes): the sigma table (``sampler_record``) and the replay inputs
(``replay.input_digests``). ``check_finite`` refuses a NaN or Inf before it would be hashed as if
it were an ordinary value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from drifttool.capture.digest import digest
from drifttool.digestcore import label
from drifttool.errors import DriftToolError
from drifttool.model.rope import BACKEND_TABLES, ROPE_ALGORITHMS

FINGERPRINT_VERSION = 2  # 2: "inputs" (RoPE table algorithm, noise generator, cpu_capability)


def tensor_digest(t: torch.Tensor) -> str:
    """Digest v2 of ``t`` (one row) as written into the manifest: ``"digest_v2:<16 hex>"``
    (``drifttool.digestcore.label``; docs/digest.md)."""
    return label(digest(t))


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Refuse non-finite replay inputs or weights: a NaN must be reported, never hashed as if it
    were an ordinary value.

    Raises:
        DriftToolError: naming the first ``NAMED`` tensors with NaN/Inf (each with its count and
            first index) and how many more there are: one line of bounded length.
    """
    bad, named = 0, []
    for name, t in tensors.items():
        if t.is_floating_point():
            nf = ~torch.isfinite(t)
            if bool(nf.any()):
                bad += 1
                if len(named) < NAMED:
                    first = tuple(nf.nonzero()[0].tolist())
                    named.append(f"{name}: {int(nf.sum())} non-finite value(s), first at index {first}")
    if bad:
        more = f"; and {bad - NAMED} more" if bad > NAMED else ""
        raise DriftToolError(f"non-finite {what} in {bad} of {len(tensors)} tensor(s): " + "; ".join(named) + more)


NAMED = 3
"""``check_finite`` names this many tensors; the rest it counts."""


def sampler_record(sampler: Any, sigmas: torch.Tensor) -> dict[str, Any]:
    """``arch_fingerprint``'s ``sampler`` argument: the fields of a ``SamplerConfig`` dataclass,
    the [num_steps + 1] fp32 sigma table the run uses and its ``tensor_digest``."""
    return {**dataclasses.asdict(sampler), "sigma_table": sigmas.tolist(),
            "sigma_table_digest": tensor_digest(sigmas)}


def arch_fingerprint(
    *,
    arch: dict[str, Any],
    img_grid: tuple[int, int],
    weights: str,
    dtype: torch.dtype,
    mode: str,
    sampler: dict[str, Any],
    noise_record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the fingerprint pinned in every manifest (RFC ``qwenimage_arch_fingerprint``).

    Args:
        arch: ``MMDiTConfig.arch_fields()``.
        img_grid: (h, w) patch grid (shapes every image-stream record).
        weights: ``weight_digest(model)``.
        dtype: model (activation) dtype.
        mode: runtime mode value.
        sampler: ``dataclasses.asdict(SamplerConfig)`` plus the sigma table digest.
        noise_record: the replay record of the pinned noise (``sampling.noise.noise_record``);
            None when unknown (recorded as such).
    """
    dt = str(dtype).removeprefix("torch.")
    backend = "strict" if mode in ("strict", "audit") else "production"
    tables = BACKEND_TABLES[backend]
    noise = (noise_record or {}).get("generator")
    # records without the flag predate the portable generator: torch.randn, dispatch-dependent
    noise_portable = noise is not None and (noise_record or {}).get("dispatch_dependent") is False
    portable = tables == "exact" and noise_portable
    return {
        "version": FINGERPRINT_VERSION,
        "arch": {**arch, "img_grid": [int(img_grid[0]), int(img_grid[1])]},
        "weights": weights,
        "dtype_policy": {
            "weights": dt,
            "activations": dt,
            "accumulation": "float32" if mode in ("strict", "audit") else "backend default",
            "latents_between_steps": sampler.get("latents_dtype", "float32"),
            "sde_step_and_logp": "float32" if sampler.get("step_rule") != "diffusers_euler"
            else "diffusers scheduler.step: fp32 sum, the product in the velocity dtype; no logp",
            "tf32": False,
        },
        "scheduler": {k: sampler[k] for k in sampler if k in _SCHEDULER_KEYS},
        "cfg": {k: sampler[k] for k in sampler if k in _CFG_KEYS},
        "sde": {k: sampler[k] for k in sampler if k in _SDE_KEYS},
        "runtime": {"mode": mode, "backend": backend},
        "inputs": {
            "rope_tables": ROPE_ALGORITHMS[tables],
            "noise": noise,
            "cpu_capability": None if portable else torch.backends.cpu.get_cpu_capability(),
        },
    }


_SCHEDULER_KEYS = {"num_steps", "timestep_policy", "image_seq_len", "sigma_table", "sigma_table_digest"}
_CFG_KEYS = {"cfg_scale", "cfg_layout"}
_SDE_KEYS = {"eta", "sde_window", "logp_reduction"}


def differing_fields(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the leaves that differ between two fingerprints (sorted)."""
    out: list[str] = []
    for key in sorted(set(a) | set(b)):
        path = f"{prefix}{key}"
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += differing_fields(va, vb, path + ".")
        elif va != vb:
            out.append(path)
    return out
