"""A fixture's settings checked without torch: the bounds of a run's values (``MAX_STEPS``,
``SEEDS``, ``MAX_SAMPLE_ID``, ``PATCH_PIXELS``, ``MAX_PIXELS``), the checks of single values a
run and a ``fixture.json`` share (``check_steps``, ``check_seed``, ``check_number``,
``check_sample_ids``), and the checks of a whole ``fixture.json``'s settings: their types and
ranges (``check_fixture_settings``) and whether they hold every setting a re-run needs
(``check_complete``).

    >>> check_complete(load_fixture("tiny-t2i"))      # every setting its re-run needs: fine

``drifttool.settings`` (``resolve``) and ``drifttool.setting_checks`` re-export these names and
check a run's flags with them; ``fixture seal`` and ``fixture verify`` check a fixture with them
before anything runs. Nothing here imports torch, so ``fixture verify`` can say what
``fixture seal --rebuild`` would refuse about a fixture whose seal no longer holds without
loading it (tests/cli/test_import_cost.py).
"""

from __future__ import annotations

import collections
import math
from typing import Any

from drifttool.artifact.manifest import check_manifest_value
from drifttool.artifact.manifest_schema import FIXTURE_SETTINGS
from drifttool.errors import DriftToolError, FixtureError
from drifttool.fixture import Fixture
from drifttool.sampling.preset_table import PRESETS

MAX_STEPS = 1000
"""Most denoising steps a run may ask for: the flow-matching scheduler's ``num_train_timesteps``
(FlowMatchEulerDiscreteScheduler of Qwen-Image, numerics §1); more would only re-visit timesteps."""

MAX_SAMPLE_ID = 2**31 - 1
"""Largest logical sample id: the artifact's ``sample`` columns are int32 (``artifact.schema``)."""
SEEDS = range(-(2**63), 2**64)
"""The seeds a run takes: a signed or an unsigned 64-bit integer (what a torch generator's
``manual_seed`` takes: the fixture's stand-in prompts and a preset's generators are seeded with it)."""
PATCH_PIXELS = 16
"""Image pixels per patch side: 8× VAE downsampling × 2×2 latent patches (numerics §3.2), so
``img_grid = (height / 16, width / 16)``."""
MAX_PIXELS = 16384
"""Largest height or width a run may ask for (1024 patches a side; the RFC's reference shapes
stop at 1664)."""

REQUIRED = ("img_grid", "steps", "cfg_scale", "seed", "samples", "capture", "dtype")
"""Settings a fixture must hold (``mode`` defaults to strict): it re-runs from them alone."""
PRESET_GIVES = ("eta", "cfg_layout", "timestep_policy")
"""Settings a fixture without a ``preset`` must hold too (a preset sets them; ``eta`` only where
the preset has no SDE, ``Preset.sde``)."""


def check_steps(steps: Any) -> int:
    """``steps`` if it is an integer from 2 to ``MAX_STEPS``.

    Raises:
        DriftToolError: anything else, one line naming the range.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or not 2 <= steps <= MAX_STEPS:
        raise DriftToolError(f"steps must be an integer from 2 to {MAX_STEPS} (the flow-matching "
                             f"scheduler's num_train_timesteps), got {steps!r}")
    return steps


def check_seed(seed: Any) -> Any:
    """``seed`` if it is in ``SEEDS`` (or not an integer: the manifest check names its type).

    Raises:
        DriftToolError: an integer outside [-2^63, 2^64), one line naming the range.
    """
    if isinstance(seed, int) and not isinstance(seed, bool) and seed not in SEEDS:
        shown = seed if seed.bit_length() < 128 else f"{'-' if seed < 0 else ''}a {len(str(abs(seed)))}-digit number"
        raise DriftToolError(f"seed must be an integer in [-2^63, 2^64) (a signed or unsigned 64-bit "
                             f"integer), got {shown}")
    return seed


def check_number(key: str, value: Any, floor: float | None) -> Any:
    """``value`` if it is a finite number (at least ``floor``, if given).

    Raises:
        DriftToolError: anything else, one line naming ``key``.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (floor is not None and value < floor):
        bound = "" if floor is None else f" >= {floor:g}"
        shown = f"{value:g}" if isinstance(value, float) else repr(value)  # -1, not -1.0
        raise DriftToolError(f"{key} must be a finite number{bound}, got {shown}")
    return value


def check_sample_ids(ids: list[int]) -> None:
    """Distinct, non-negative, at most ``MAX_SAMPLE_ID``.

    Raises:
        DriftToolError: the ids at fault, named.
    """
    if min(ids) < 0 or len(set(ids)) != len(ids):
        neg = sorted({i for i in ids if i < 0})
        twice = sorted({i for i, n in collections.Counter(ids).items() if n > 1})
        words = [f"{', '.join(map(str, xs[:5]))}{' …' if len(xs) > 5 else ''} {what}"
                 for xs, what in ((neg, "negative"), (twice, "given more than once")) if xs]
        raise DriftToolError(f"sample ids must be distinct and >= 0 ({'; '.join(words)})")
    if max(ids) > MAX_SAMPLE_ID:
        raise DriftToolError(f"sample ids must be at most {MAX_SAMPLE_ID} (the artifact's int32 "
                             f"sample column), got {max(ids)}")


def check_fixture_settings(fx: Fixture) -> None:
    """Refuse a fixture whose ``fixture.json`` settings are of the wrong type or range (a step
    count, CFG scale, eta or seed a run refuses, repeated sample ids), an unknown key or no sample, in
    one line naming the file and the key (not later, as a flag's error or
    a failure mid-run).

    Raises:
        FixtureError: the first problem found.
    """
    st = fx.settings
    steps = st.get("steps")
    if type(steps) is int and steps < 2:  # the run's own bound (the manifest's is 1): as --steps says it
        raise FixtureError(f"{fx.path / 'fixture.json'}: settings: steps must be an integer from 2 to "
                           f"{MAX_STEPS}, got {steps}")
    try:  # in a run's words, before the manifest's check of the same range
        check_seed(st.get("seed"))
    except DriftToolError as e:
        raise FixtureError(f"{fx.path / 'fixture.json'}: settings: {e}") from None
    problem = check_manifest_value("settings", st, FIXTURE_SETTINGS)
    if problem is None and st.get("samples") == []:
        problem = "settings.samples is empty"
    if problem is None and "seed" in st and st["seed"] is None:  # (a manifest's may be: a capture's)
        problem = "settings.seed is null, not an integer (a fixture's run draws its noise from it)"
    if problem is None:  # the values a run takes, checked as its flags are
        try:
            if "steps" in st:
                check_steps(st["steps"])
            for key, floor in (("cfg_scale", 0.0), ("eta", 0.0)):
                if key in st:
                    check_number(key, st[key], floor)
            if st.get("samples"):
                check_sample_ids(st["samples"])
            if "img_grid" in st and max(st["img_grid"]) * PATCH_PIXELS > MAX_PIXELS:
                h, w = st["img_grid"]
                raise DriftToolError(f"img_grid {h}x{w} patches is {h * PATCH_PIXELS}x{w * PATCH_PIXELS} "
                                     f"px, past the {MAX_PIXELS} px a side a run takes")
        except DriftToolError as e:
            problem = f"settings: {e}"
    if problem is not None:
        raise FixtureError(f"{fx.path / 'fixture.json'}: {problem}")


def check_complete(fx: Fixture) -> None:
    """Raise unless ``fx``'s settings hold every key its re-run needs (``REQUIRED``; without a
    ``preset``, ``PRESET_GIVES`` too; with a preset that has an SDE, ``eta``): a fixture re-runs
    from its own settings alone, where ``drifttool run`` would take the rest from its flags.

    Raises:
        FixtureError: naming the file and the keys missing (``settings.steps``: an incomplete or
            corrupt fixture).
    """
    name = fx.settings.get("preset")
    preset = PRESETS.get(name) if isinstance(name, str) else None
    keys = REQUIRED + (PRESET_GIVES if "preset" not in fx.settings
                       else ("eta",) if preset is not None and preset.sde else ())
    missing = [k for k in keys if k not in fx.settings]
    if missing:
        raise FixtureError(f"{fx.path / 'fixture.json'}: lacks {', '.join('settings.' + k for k in missing)} "
                           "(an incomplete or corrupt fixture: a fixture re-runs from its own settings "
                           "alone)")
