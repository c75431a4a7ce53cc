"""Log-prob drift in the user's units: per step and branch, against a PPO clip range.

    >>> r = clip_drift(st, clip_range=1e-4)     # st: the aligned step tables of diff_runs
    >>> r.verdict, r.words()
    ('below', 'max |exp(Δlogp) − 1| 3.7e-05 = 37 % of the clip range 0.0001 (rollout step 2 cfg):
     below the clip noise floor')

A policy-gradient trainer clips the ratio ``exp(logp_train − logp_rollout)`` to ``[1 − ε, 1 + ε]``.
Drift between the runs moves that ratio before any update: when ``|exp(Δlogp) − 1|`` reaches
``ε`` the clip acts on noise. For each (phase, step, branch) holding ``logp_t`` records in both
runs (one scalar per sample: branch ``cfg`` with CFG on, ``cond`` without), this module reports
over the common samples ``mean|Δlogp_t|``, ``max|Δlogp_t|`` and ``max|exp(Δlogp_t) − 1|``, with
``Δlogp = logp_B − logp_A`` computed in fp64 from the stored bytes. Verdict: ``below`` the clip
noise floor when every step's max ratio deviation is below ``ε``, ``above`` otherwise,
``no logp`` when the runs share no ``logp_t`` record (a diffusers pipeline capture has none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from drifttool.diff.align import TableDiff
from drifttool.diff.values import values
from drifttool.errors import DriftToolError


@dataclass(kw_only=True)
class ClipStep:
    """Log-prob drift of one (phase, step, branch) over its common samples; ``fraction`` is
    ``ratio_dev_max / clip_range``."""

    phase: str
    step: int
    branch: str
    samples: int
    mean_abs: float
    max_abs: float
    ratio_dev_max: float
    fraction: float


@dataclass(kw_only=True)
class ClipDrift:
    """Result of ``clip_drift``: the clip range ``ε``, ``verdict`` (``below``, ``above`` or
    ``no logp``), the per-step rows in program order and the worst of them."""

    clip_range: float
    verdict: str
    steps: list[ClipStep] = field(default_factory=list)
    worst: ClipStep | None = None

    def words(self, verdict: bool = True) -> str:
        """One line for the report, e.g. ``max |exp(Δlogp) − 1| 3.7e-05 = 37 % of the clip
        range 0.0001 (rollout step 2 cfg): below the clip noise floor``; ``verdict=False`` leaves
        out the tail after the colon (a line headed by the verdict's words says it already)."""
        if self.worst is None:
            return f"no logp_t records in both runs: nothing to judge against the clip range {self.clip_range:g}"
        w = self.worst
        tail = f": {self.verdict} the clip noise floor" if verdict else ""
        return (f"max |exp(Δlogp) − 1| {w.ratio_dev_max:.3g} = {percent(w.fraction)} of the clip "
                f"range {self.clip_range:g} ({w.phase} step {w.step} {w.branch}){tail}")


CLIP_FIELDS = ("clip_range", "clip_verdict", "clip_ratio_dev_max", "clip_fraction",
               "clip_max_abs", "clip_worst")
"""The flat fields ``clip_summary`` gives: one result row of a probe matrix or an experiment."""


def clip_summary(clip: "ClipDrift | None") -> dict:
    """``clip`` as one row's flat fields (``CLIP_FIELDS``): the clip range, the verdict, and the
    worst (phase, step, branch)'s max |exp(Δlogp) − 1|, its share of the clip range, its
    max |Δlogp| and where it is (``"rollout step 2 cfg"``); every field ``None`` for ``None`` (no
    clip range), the worst step's ``None`` when the runs share no ``logp_t`` record."""
    if clip is None:
        return dict.fromkeys(CLIP_FIELDS)
    w = clip.worst
    return {"clip_range": clip.clip_range, "clip_verdict": clip.verdict,
            "clip_ratio_dev_max": None if w is None else w.ratio_dev_max,
            "clip_fraction": None if w is None else w.fraction,
            "clip_max_abs": None if w is None else w.max_abs,
            "clip_worst": None if w is None else f"{w.phase} step {w.step} {w.branch}"}


def percent(fraction: float) -> str:
    """``0.37`` → ``"37 %"``; small and large fractions keep three significant digits."""
    return f"{fraction * 100:.3g} %"


def check_clip_range(clip_range: float) -> float:
    """``clip_range`` as a float.

    Raises:
        DriftToolError: not a finite number > 0.
    """
    ok = isinstance(clip_range, (int, float)) and not isinstance(clip_range, bool)
    if not (ok and math.isfinite(clip_range) and clip_range > 0):
        raise DriftToolError(f"the clip range must be a finite number > 0, got {clip_range!r}")
    return float(clip_range)


def clip_drift(st: TableDiff, clip_range: float) -> ClipDrift:
    """Per-step log-prob drift of the aligned step tables ``st`` (``drifttool.diff.align``,
    columns ``quantity``, ``phase``, ``step``, ``branch``, ``dtype``, ``shape``, ``data``) against
    ``clip_range`` (module docstring).

    Raises:
        DriftToolError: ``clip_range`` not a finite number > 0 (``check_clip_range``).
    """
    clip_range = check_clip_range(clip_range)
    qa = st.a.column("quantity").to_numpy(zero_copy_only=False)[st.al.ia]
    pairs = [(int(i), int(j)) for i, j, q in zip(st.al.ia, st.al.ib, qa) if q == "logp_t"]
    groups: dict[tuple[str, int, str], list[float]] = {}
    order: dict[tuple[str, int, str], int] = {}
    for i, j in pairs:
        ra = st.a.slice(i, 1).select(["phase", "step", "branch", "dtype", "shape", "data"]).to_pylist()[0]
        rb = st.b.slice(j, 1).select(["dtype", "shape", "data"]).to_pylist()[0]
        a = values(ra["dtype"], ra["shape"], ra["data"])
        b = values(rb["dtype"], rb["shape"], rb["data"])
        key = (ra["phase"], int(ra["step"]), ra["branch"])
        groups.setdefault(key, []).extend((b - a).ravel().tolist())
        order.setdefault(key, int(st.pos_a[i]))
    steps = []
    for key in sorted(groups, key=order.get):
        d = np.abs(np.asarray(groups[key], dtype=np.float64))
        dev = float(np.abs(np.expm1(np.asarray(groups[key], dtype=np.float64))).max())
        steps.append(ClipStep(phase=key[0], step=key[1], branch=key[2], samples=int(d.size),
                              mean_abs=float(d.mean()), max_abs=float(d.max()),
                              ratio_dev_max=dev, fraction=dev / clip_range))
    if not steps:
        return ClipDrift(clip_range=clip_range, verdict="no logp")
    worst = max(steps, key=lambda s: (math.isnan(s.ratio_dev_max), s.ratio_dev_max))
    below = all(s.ratio_dev_max < clip_range for s in steps)
    return ClipDrift(clip_range=clip_range, verdict="below" if below else "above", steps=steps,
                     worst=worst)
