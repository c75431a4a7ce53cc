"""Environment record for the manifest: what produced the bytes (versions, CPU, threads).

Strict CPU bytes are reproducible within a pinned hardware/runtime profile (RFC: "CUDA and ROCm
qualify separately within pinned hardware/runtime profiles"); this record names the profile,
including the CPU dispatch level torch's kernels use (``cpu_capability``, settable with the
``ATEN_CPU_CAPABILITY`` environment variable) and the matrix extensions oneDNN's bf16 kernels
use (``cpu_matrix``: AMX, AVX512-BF16, ...). The strict inputs (RoPE tables, pinned noise) do
not depend on it; what they depend on is in the fingerprint's ``inputs``.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import numpy as np
import torch

import drifttool


MATRIX_FLAGS = ("amx_bf16", "amx_fp16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_fp16",
                "avx512_vnni", "avx_vnni")
"""The CPU's bf16/fp16 matrix and dot-product extensions (``/proc/cpuinfo`` flags). oneDNN picks
its bf16 GEMM and convolution kernels by them, beside ATen's dispatch level: two CPUs of one
``cpu_capability`` (AVX512) give production bf16 matmuls different bytes when one has AMX."""


def _cpu() -> tuple[str, list[str] | None]:
    """The CPU's model name and the ``MATRIX_FLAGS`` it has (sorted), from the first processor
    of ``/proc/cpuinfo``; where that is not readable, ``platform.processor()`` and None."""
    model, flags = None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if model is None and key.strip() == "model name":
                    model = value.strip()
                elif flags is None and key.strip() == "flags":
                    flags = sorted(set(value.split()) & set(MATRIX_FLAGS))
                if model is not None and flags is not None:
                    break
    except OSError:
        pass
    return model or platform.processor() or "unknown", flags


def _gpu(device: str | torch.device | None) -> str | None:
    """The name of the GPU a run uses: ``device``'s (``cuda:N``; ``cuda`` = the current one),
    else the first visible GPU's; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return torch.cuda.get_device_name(0)
    return torch.cuda.get_device_name(dev.index if dev.index is not None else torch.cuda.current_device())


def environment(device: str | torch.device | None = None) -> dict[str, Any]:
    """JSON-serialisable description of the interpreter, libraries and hardware; ``gpu`` names
    the run's GPU when ``device`` is a CUDA device (else the first visible one, or None)."""
    cpu, matrix = _cpu()
    env: dict[str, Any] = {
        "drifttool": drifttool.__version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the SIMD dispatch level in use
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),  # its override, if any
        "cpu_matrix": matrix,  # the extensions oneDNN's bf16 kernels dispatch on
        "cuda": torch.version.cuda,
        "gpu": _gpu(device),
    }
    return env
