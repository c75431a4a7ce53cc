"""Checks of single run settings, shared by ``drifttool run`` (``settings.resolve``), ``replay``,
``recompute``, the experiments and the probes, so each refuses a bad value with the same line.

    >>> check_mode("strict"), check_level("L1"), check_pixels("height", 64)
    (<Mode.STRICT: 'strict'>, 'L1', 64)
    >>> check_level("L3")
    Traceback (most recent call last):
    drifttool.errors.DriftToolError: unknown capture level 'L3' (L0, L1, L2)

Each ``check_*`` returns its value (as the run uses it) or raises ``DriftToolError`` with one line
naming the setting; ``DTYPES``, ``PATCH_PIXELS`` and ``MAX_PIXELS`` are the bounds they check
against (the last two from ``drifttool.fixture_settings``, which checks a ``fixture.json``'s
settings without torch). Capture levels are the artifact's (``drifttool.artifact.levels``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from drifttool.artifact.levels import LEVELS
from drifttool.components import DEFAULT_COMPONENT
from drifttool.errors import DriftToolError, SigmaTableError, UnsupportedConfigError
from drifttool.fixture_settings import MAX_PIXELS, PATCH_PIXELS  # torch-free, with a fixture's checks
from drifttool.ops.lora import PRODUCTION_ONLY
from drifttool.ops.registry import families, impls, specs
from drifttool.ops.scheduler.sigmas import flow_sigma_table
from drifttool.runtime import Mode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Model dtypes a run may use (``manifest_schema.MODEL_DTYPES`` repeats the names)."""
_DEVICE = re.compile(r"cpu|cuda(?::(\d+))?")


def check_mode(mode: Any) -> Mode:
    """``mode`` as a ``Mode`` (a name in any case, as capture levels: ``STRICT`` is ``strict``).

    Raises:
        DriftToolError: not one of strict, audit, auto, off.
    """
    try:
        return Mode(mode.lower() if isinstance(mode, str) else mode)
    except ValueError:
        raise DriftToolError(f"unknown mode {mode!r} (strict, audit, auto, off)") from None


def device_type(device: Any) -> str:
    """The type (``cpu`` or ``cuda``) of a device string ``cpu``, ``cuda`` or ``cuda:N``, whether
    or not such a device is here (a listing that runs nothing names another machine's).

    Raises:
        DriftToolError: another string.
    """
    if not (isinstance(device, str) and _DEVICE.fullmatch(device)):
        raise DriftToolError(f"unknown device {device!r} (cpu, cuda or cuda:N)")
    return device.split(":")[0]


def check_device(device: Any) -> str:
    """``device`` if it names a device a run can use: ``cpu``, ``cuda`` or ``cuda:N`` (in any
    case, returned in lower case: ``CPU`` is ``cpu``, as a mode or capture level is read).

    Raises:
        DriftToolError: another string; CUDA asked for but ``torch.cuda.is_available()`` is
            false; ``cuda:N`` beyond the visible devices.
    """
    device = device.lower() if isinstance(device, str) else device
    device_type(device)
    m = _DEVICE.fullmatch(device)
    if device == "cpu":
        return device
    if not torch.cuda.is_available():
        raise DriftToolError(f"device {device!r} asked for, but CUDA is not available here "
                             f"(torch {torch.__version__}, {_cuda_build()}); use --device cpu")
    if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise DriftToolError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) "
                             f"visible (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return device


def _cuda_build() -> str:
    """What CUDA this torch was built for, in words: ``CUDA 13.0`` or ``a CPU-only build``."""
    return f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"


def device_operators(device_type: str) -> list[str]:
    """The declared operators a run dispatches on ``device_type``: the MMDiT's and its
    sampler's (component ``mmdit``: a run calls no text encoder or VAE yet) that some family
    registers an implementation for there (``ops.registry``). The others run on the CPU
    wherever the model is (``flow_sigma_table`` takes no tensors)."""
    return [op for op in specs(component=DEFAULT_COMPONENT) if any(impls(op, f, device_type) for f in families(op))]


def check_mode_device(mode: Mode, device: str) -> None:
    """Fail closed when ``mode``'s family has no implementation on ``device`` of some operator the
    run dispatches there and the mode has no fallback. Read from the registry, so a family
    passes once it registers every such operator.

    Raises:
        UnsupportedConfigError: one line naming the mode, family, device and missing operators.
    """
    dev = torch.device(device).type
    if mode.fallback is not None:
        return
    family = mode.family
    missing = [op for op in device_operators(dev) if not impls(op, family, dev) and op not in PRODUCTION_ONLY]
    if missing:
        ops = ", ".join(missing[:3]) + (f", … (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        what = (f"the {family} family has no {dev.upper()} implementation yet" if family == "strict"
                else f"the {family} family has no {dev} implementation")
        raise UnsupportedConfigError(
            f"--mode {mode.value} on {device}: {what}: {len(missing)} operator(s) lack one ({ops}); "
            f"use --mode auto (production operators) on {dev}, or --device cpu for strict bytes")


def check_level(level: Any) -> str:
    """``level`` as its canonical capture level (``"l2"`` gives ``"L2"``).

    Raises:
        DriftToolError: not one of L0, L1, L2 (in either case).
    """
    canonical = level.upper() if isinstance(level, str) else level
    if canonical not in LEVELS:
        raise DriftToolError(f"unknown capture level {level!r} (L0, L1, L2)")
    return canonical




def check_pixels(key: str, value: Any) -> int:
    """``value`` if it is an image size a run can use: a multiple of 16 pixels from 16 to
    ``MAX_PIXELS``.

    Raises:
        DriftToolError: naming ``key`` (``height``, ``width``).
    """
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or not 0 < value <= MAX_PIXELS or value % PATCH_PIXELS:
        raise DriftToolError(f"{key} must be a multiple of {PATCH_PIXELS} pixels from {PATCH_PIXELS} "
                             f"to {MAX_PIXELS} (8x VAE downsampling, 2x2 patches), got {value!r}")
    return value


def finite_sigma_table(steps: int, tokens: int) -> bool:
    """Whether the ``steps``-step sigma table of ``tokens`` image tokens is finite."""
    try:
        flow_sigma_table(steps, tokens)
    except UnsupportedConfigError:
        return False
    return True


def check_sigma_table(steps: int, img_grid: tuple[int, int]) -> None:
    """Refuse an image size whose ``steps``-step sigma table (``flow_sigma_table``, the run's
    dynamic shift from the h·w image tokens) is not finite: past about 3.3e5 tokens at 3 steps,
    4.0e5 at 50 (9264x9264 and 10160x10160 px squares). Finiteness is not monotone in the token
    count near there (fp32 ties), so it is computed, not stored; the message names the largest
    square up to which every square image runs.

    Raises:
        SigmaTableError: one line naming the size, μ, why, and that largest square.
    """
    h, w = img_grid
    try:
        flow_sigma_table(steps, h * w)
        return
    except UnsupportedConfigError as e:
        why = str(e)
    side = 1  # patches a side
    while side < MAX_PIXELS // PATCH_PIXELS and finite_sigma_table(steps, (side + 1) ** 2):
        side += 1
    raise SigmaTableError(
        f"--height {h * PATCH_PIXELS} --width {w * PATCH_PIXELS}: {why}; at {steps} steps every "
        f"square image up to {side * PATCH_PIXELS}x{side * PATCH_PIXELS} px runs", why=why, steps=steps)
