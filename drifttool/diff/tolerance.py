"""Tolerance profiles: differing records judged within or beyond a declared bound.

    >>> profile = load_profile("strict-cuda1-vs-cpu")       # or a path to a profile JSON
    >>> result = judge(profile, run_a, run_b, tables)         # tables: diff_runs' aligned tables
    >>> result.within, result.beyond, result.first_beyond     # counts and the first record beyond

Two runs of different qualified arithmetic (strict CPU contract v2 and strict CUDA contract cuda1,
say) differ in bytes by design: the RFC asks that "any deviation requires an explicit tolerance
profile". A profile declares, per operator and per step quantity, how far a differing record may
be from the baseline's (run A's) and still count as *within* the profile; ``drifttool diff
--tolerance PROFILE`` then reports, beside the bitwise verdict, how many differing records are
within and beyond, and names the first record beyond in run A's program order.

What each record kind can be judged on:

- step records (``x_t``, ``v_t``, ``x_next``, ``mu``, ``logp_t``, ...) hold their raw bytes: judged
  on their values, ``rel_l2 = ‖b − a‖ / ‖a‖`` and ``max_abs = max |b − a|`` (fp64,
  ``drifttool.diff.values``), non-finite elements in the same places;
- op records hold digests and two fp64 summaries (``l2``, ``maxabs``), not values: judged on the
  summaries, ``rel_l2 = |l2_b − l2_a| / l2_a`` and ``rel_maxabs = |maxabs_b − maxabs_a| /
  maxabs_a``, non-finite counts equal. A summary within its bound is necessary, not sufficient,
  for the values to be within it: the verdict says so ("within (summaries)").

A bound not declared for a quantity is not checked; a record whose operator or quantity has no
entry (and no ``"*"`` entry) is *beyond* ("no bound declared"), so a profile never passes what it
does not name. A pair with records in one run only, differing replay inputs or an incomplete run
is never *within* (``ToleranceResult.blocked``): a profile judges the same program's records.
Where the runs' settings differ from those the profile was measured on (``applies_to``), the
diff's notes say so (``scope_notes``). Profile file (JSON, ``PROFILE_SCHEMA`` version ``PROFILE_VERSION``; readers refuse
other versions)::

    {"schema": "drifttool.tolerance_profile", "version": 1, "name": "...", "description": "...",
     "applies_to": {"a": "...", "b": "..."}, "measured_on": {...},
     "ops":   {"*": {"rel_l2": 1e-2, "rel_maxabs": 5e-2}, "qk_rmsnorm": {...}},
     "steps": {"*": {"rel_l2": 1e-2, "max_abs": 1e-1}, "logp_t": {"max_abs": 1e-3}}}

Profiles shipped with drifttool live in ``drifttool/diff/profiles/<name>.json``; ``measure``
derives a profile's bounds from a pair of runs (``tools/tolerance_profile.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from drifttool.artifact import compute as ac
from drifttool.artifact.levels import captures_internals
from drifttool.artifact.manifest_schema import STRICT_MODES
from drifttool.diff.arrays import arrow_array
from drifttool.diff.values import compare_values, values
from drifttool.errors import DriftToolError

PROFILE_SCHEMA = "drifttool.tolerance_profile"
PROFILE_VERSION = 1
PROFILES_DIR = Path(__file__).with_name("profiles")
TOP_KEYS = ("schema", "version", "name", "description", "applies_to", "derivation", "measured_on",
            "ops", "steps")
"""The keys a profile file may hold (any other is refused: a typo must not pass silently)."""
SCOPE_FIELDS = ("mode", "device", "dtype", "capture", "steps", "fixture", "kind", "grad", "lora_mode",
                "internals")
"""What makes a run the program it is (``run_scope``), compared with a profile's ``applies_to``
(``scope_notes``)."""

OP_BOUNDS = ("rel_l2", "rel_maxabs")
"""Bounds an op record (summaries) is judged on."""
STEP_BOUNDS = ("rel_l2", "max_abs")
"""Bounds a step record (values) is judged on."""


@dataclass(frozen=True)
class Profile:
    """A loaded tolerance profile: ``ops`` and ``steps`` map an operator / step quantity (or
    ``"*"``) to its bounds (``OP_BOUNDS`` / ``STEP_BOUNDS``, each optional)."""

    name: str
    source: str
    ops: dict[str, dict[str, float]]
    steps: dict[str, dict[str, float]]
    description: str = ""
    applies_to: dict[str, dict] = field(default_factory=dict)

    def bounds(self, kind: str, name: str) -> dict[str, float] | None:
        table = self.ops if kind == "op" else self.steps
        return table.get(name, table.get("*"))


def available() -> list[str]:
    """Names of the profiles shipped with drifttool."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(spec: str | Path) -> Profile:
    """The profile named ``spec`` (shipped, ``available()``) or stored at path ``spec``.

    Raises:
        DriftToolError: no such profile or file; not JSON; another schema or version; a bound
            that is not a finite number >= 0, or a bound name the record kind cannot be judged on.
    """
    if not str(spec).strip():
        raise DriftToolError("tolerance profile: give a shipped profile's name or a profile file "
                             "(got an empty name)")
    path = Path(spec)
    if not path.suffix and not path.exists():
        path = PROFILES_DIR / f"{spec}.json"
        if not path.exists():
            raise DriftToolError(f"unknown tolerance profile {str(spec)!r}: give a profile file or one "
                                 f"of {', '.join(available()) or '(none shipped)'}")
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise DriftToolError(f"tolerance profile {str(path)!r}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise DriftToolError(f"tolerance profile {str(path)!r}: not JSON ({e})") from None
    return _validated(data, str(path))


def _validated(data: Any, where: str) -> Profile:
    def bad(why: str) -> DriftToolError:
        return DriftToolError(f"tolerance profile {where!r}: {why}")

    if not isinstance(data, dict) or data.get("schema") != PROFILE_SCHEMA:
        raise bad(f"not a tolerance profile (schema must be {PROFILE_SCHEMA!r})")
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise bad(f"unknown key(s) {', '.join(map(repr, unknown))} (a profile holds {', '.join(TOP_KEYS)})")
    if isinstance(data.get("version"), bool) or data.get("version") != PROFILE_VERSION:
        raise bad(f"version {data.get('version')!r} is not supported (this drifttool reads version "
                  f"{PROFILE_VERSION})")
    tables = {}
    for kind, allowed in (("ops", OP_BOUNDS), ("steps", STEP_BOUNDS)):
        table = data.get(kind, {})
        if not isinstance(table, dict):
            raise bad(f"{kind!r} must be an object")
        for name, bounds in table.items():
            if not isinstance(bounds, dict):
                raise bad(f"{kind}.{name} must be an object of bounds")
            for b, v in bounds.items():
                if b not in allowed:
                    raise bad(f"{kind}.{name}: unknown bound {b!r} (one of {', '.join(allowed)})")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise bad(f"{kind}.{name}.{b}: {v!r} is not a finite number >= 0")
        tables[kind] = {n: {b: float(v) for b, v in bs.items()} for n, bs in table.items()}
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise bad("a profile needs a name")
    applies = data.get("applies_to", {})
    if not isinstance(applies, dict) or not all(isinstance(v, dict) for v in applies.values()):
        raise bad("'applies_to' must map 'a' and 'b' to settings objects")
    return Profile(name=name, source=where, ops=tables["ops"], steps=tables["steps"],
                   description=str(data.get("description", "")), applies_to=applies)


def run_scope(run: Any) -> dict[str, Any]:
    """``SCOPE_FIELDS`` of a run (a ``Run``): its settings (mode, device — the CPU where none is
    recorded —, dtype, capture level, steps, fixture), its kind (``rollout``, ``recompute``, ...),
    whether it took gradients, its adapter's LoRA mode and, at L2 in a strict-family mode, whether
    it captured the attention's internals (recorded only when it did not); fields the run does not
    record are left out."""
    s = run.manifest.get("settings", {})
    out = {k: s.get(k, "cpu" if k == "device" else None) for k in ("mode", "device", "dtype", "capture",
                                                                    "steps", "fixture", "internals")}
    if out["internals"] is None and _internals_apply(s):  # recorded only when left out
        out["internals"] = True
    out.update(kind=run.manifest.get("kind"), grad=bool((run.manifest.get("train") or {}).get("grad")),
               lora_mode=s.get("lora_mode") if s.get("lora") else None)
    return {k: out[k] for k in SCOPE_FIELDS if out[k] is not None}


def _internals_apply(settings: dict[str, Any]) -> bool:
    """Whether a run of these recorded settings chose whether to capture the attention's internals
    (``RunSettings.internals_apply``: L2 in a strict-family mode)."""
    return settings.get("mode") in STRICT_MODES and captures_internals(settings.get("capture"))


_ABSENT = {"lora_mode": "none (no adapter)", "internals": "none (its mode and level take no internals)"}
"""How ``scope_notes`` names a ``SCOPE_FIELDS`` field a run leaves out (default: not recorded)."""


def scope_notes(profile: Profile, run_a: Any, run_b: Any) -> list[str]:
    """One note per run whose scope (``run_scope``) differs from the one the profile was
    measured on (``applies_to``; a field it does not name is not compared): its bounds are
    evidence for such pairs, not proof for others."""
    notes = []
    for side, run in (("a", run_a), ("b", run_b)):
        want = profile.applies_to.get(side) or {}
        value = run_scope(run)
        off = [f"{k} {_ABSENT.get(k, 'not recorded') if value.get(k) is None else repr(value[k])} "
               f"(profile: {want[k]!r})" for k in SCOPE_FIELDS if k in want and value.get(k) != want[k]]
        if off:
            notes.append(f"tolerance profile {profile.name} was measured on other settings than run "
                         f"{side.upper()}'s: " + ", ".join(off))
    return notes


# -- measures ------------------------------------------------------------------------------------
def _rel(a: float, b: float) -> float:
    d = abs(b - a)
    return 0.0 if d == 0 else (d / abs(a) if a != 0 else math.inf)


def op_measures(ra: dict, rb: dict) -> dict[str, float] | None:
    """``rel_l2``, ``rel_maxabs`` of two op records' summaries; ``None`` when their non-finite
    counts differ (never within)."""
    if ra["nonfinite"] != rb["nonfinite"]:
        return None
    return {"rel_l2": _rel(ra["l2"], rb["l2"]), "rel_maxabs": _rel(ra["maxabs"], rb["maxabs"])}


def step_measures(a: np.ndarray, b: np.ndarray) -> dict[str, float] | None:
    """``rel_l2``, ``max_abs`` of two step quantities' values (fp64); ``None`` when the shapes
    or the places of non-finite elements differ."""
    v = compare_values(a, b)
    if v["max_abs"] is None or v["nonfinite_mismatch"]:
        return None
    return {"rel_l2": v["rel_l2"], "max_abs": v["max_abs"]}


def _beyond(measures: dict[str, float] | None, bounds: dict[str, float] | None) -> str | None:
    """Why a record is beyond ``bounds`` (``None``: within)."""
    if bounds is None:
        return "no bound declared"
    if measures is None:
        return "non-finite elements or shapes differ"
    over = [f"{k} {measures[k]:.3g} > {v:.3g}" for k, v in bounds.items() if measures[k] > v]
    return "; ".join(over) or None


# -- judging a diff --------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Beyond:
    """The first differing record beyond the profile, in run A's program order."""

    kind: str
    where: str
    why: str
    measures: dict[str, float] | None


@dataclass(kw_only=True)
class ToleranceResult:
    """Differing records judged against a profile: ``within``/``beyond`` per record kind
    (``"ops"`` judged on summaries, ``"steps"`` on values), the first beyond, and the worst
    measure seen per kind (over the differing records)."""

    profile: str
    source: str
    verdict: str = "within"  # "within" | "beyond" | "not judged" (blocked)
    within: dict[str, int] = field(default_factory=dict)
    beyond: dict[str, int] = field(default_factory=dict)
    first_beyond: Beyond | None = None
    worst: dict[str, dict[str, float]] = field(default_factory=dict)
    blocked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every differing record is within the profile, and nothing blocks the judgement
        (``blocked``: records in one run only, differing replay inputs, an incomplete run)."""
        return not any(self.beyond.values()) and not self.blocked

    def block(self, reasons: list[str]) -> None:
        """Record why the pair cannot be within the profile whatever its records say."""
        self.blocked += reasons
        if reasons and self.verdict == "within":
            self.verdict = "not judged"

    def words(self) -> str:
        """One line, the verdict itself left to the caller: ``tolerance profile P: ops 12 within,
        0 beyond (summaries); steps 4 within, 0 beyond (values)``, then ``; first beyond: ...``
        and ``; cannot be within: ...`` where they apply."""
        parts = []
        for kind, how in (("ops", "summaries"), ("steps", "values")):
            if kind in self.within:
                w, b = self.within[kind], self.beyond[kind]
                parts.append(f"{kind} {w} within, {b} beyond ({how})")
        head = f"tolerance profile {self.profile}: " + "; ".join(parts)
        if self.first_beyond is not None:
            head += f"; first beyond: {self.first_beyond.where} ({self.first_beyond.why})"
        if self.blocked:
            head += "; cannot be within: " + "; ".join(self.blocked)
        return head


def judge(profile: Profile, run_a: Any, run_b: Any, step_table: Any, op_table: Any | None,
          where: Any) -> ToleranceResult:
    """Judge every differing common record of a diff against ``profile``.

    Args:
        run_a, run_b: the opened runs (``artifact.reader.Run``); run A is the baseline.
        step_table, op_table: ``diff.align.TableDiff`` of the step and op records as
            ``diff_runs`` aligned them (``op_table`` ``None`` at L0); their ``_row`` column
            indexes the runs' full tables.
        where: ``where(kind, ra, rb) -> str``, the record's place in words (``FirstDrift.where``).
    """
    res = ToleranceResult(profile=profile.name, source=profile.source)
    first: tuple[int, Beyond] | None = None
    for kind, key, t in (("step", "steps", step_table), ("op", "ops", op_table)):
        if t is None:
            continue
        res.within[key], res.beyond[key] = 0, 0
        if t.da.size == 0:
            continue
        full_a = run_a.steps_table() if kind == "step" else run_a.ops_table()
        full_b = run_b.steps_table() if kind == "step" else run_b.ops_table()
        rows_a = t.a.column("_row").to_numpy()[t.da]
        rows_b = t.b.column("_row").to_numpy()[t.db]
        recs_a = ac.take(full_a, arrow_array(rows_a)).to_pylist()
        recs_b = ac.take(full_b, arrow_array(rows_b)).to_pylist()
        worst = res.worst.setdefault(key, {})
        for pos, ra, rb in zip(t.pos_a[t.da], recs_a, recs_b):
            name = ra["quantity"] if kind == "step" else ra["op"]
            if kind == "step":
                m = step_measures(values(ra["dtype"], ra["shape"], ra["data"]),
                                  values(rb["dtype"], rb["shape"], rb["data"]))
            else:
                m = op_measures(ra, rb)
            for k, v in (m or {}).items():
                worst[k] = max(worst.get(k, 0.0), v)
            why = _beyond(m, profile.bounds(kind, name))
            if why is None:
                res.within[key] += 1
                continue
            res.beyond[key] += 1
            if first is None or int(pos) < first[0]:
                first = (int(pos), Beyond(kind=kind, where=where(kind, ra, rb), why=why, measures=m))
    res.first_beyond = None if first is None else first[1]
    res.verdict = "within" if res.ok else "beyond"
    return res


def measure(run_a: Any, run_b: Any, step_table: Any, op_table: Any | None, *,
            factor: float = 4.0) -> dict[str, dict[str, dict[str, float]]]:
    """Bounds derived from one pair of runs: per operator / step quantity, ``factor`` × the
    largest measure over its differing records (2 significant digits, rounded up), plus the
    measured maxima themselves under ``"measured"``. Operators and quantities that never differ
    get bound 0 (byte-equal)."""
    out: dict[str, dict[str, dict[str, float]]] = {"ops": {}, "steps": {}}
    for kind, key, t in (("step", "steps", step_table), ("op", "ops", op_table)):
        if t is None:
            continue
        names = t.a.column("quantity" if kind == "step" else "op").to_pylist()
        bound_names = STEP_BOUNDS if kind == "step" else OP_BOUNDS
        for n in dict.fromkeys(names):
            out[key].setdefault(n, {b: 0.0 for b in bound_names})
        if t.da.size:
            full_a = run_a.steps_table() if kind == "step" else run_a.ops_table()
            full_b = run_b.steps_table() if kind == "step" else run_b.ops_table()
            recs_a = ac.take(full_a, arrow_array(t.a.column("_row").to_numpy()[t.da])).to_pylist()
            recs_b = ac.take(full_b, arrow_array(t.b.column("_row").to_numpy()[t.db])).to_pylist()
            for ra, rb in zip(recs_a, recs_b):
                name = ra["quantity"] if kind == "step" else ra["op"]
                m = (step_measures(values(ra["dtype"], ra["shape"], ra["data"]),
                                   values(rb["dtype"], rb["shape"], rb["data"]))
                     if kind == "step" else op_measures(ra, rb))
                if m is None:
                    raise DriftToolError(f"{kind} {name}: non-finite elements or shapes differ; no "
                                         "finite bound can be derived")
                for b, v in m.items():
                    out[key][name][b] = max(out[key][name][b], v)
    bounds = {k: {n: {b: _round_up(factor * v) for b, v in m.items()} for n, m in table.items()}
              for k, table in out.items()}
    return {**bounds, "measured": out}


def _round_up(x: float) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    e = math.floor(math.log10(x)) - 1
    return round(math.ceil(x / 10 ** e) * 10 ** e, -e)  # round(): no float noise (0.41, not 0.41000000000000003)
