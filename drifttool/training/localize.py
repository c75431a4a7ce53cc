"""Escalate only where it drifts: re-execute the first drifting step of two runs at L2.

    >>> report, loc = localize("runs/a", "runs/b")          # two L0 runs
    >>> loc.status, loc.step, loc.first_drift.where()
    ('localized', 1, 'rollout step 1 cond before block 0 timestep_embed_mlp#0 sample 0 (owning rank 0)')
    >>> loc.seconds, loc.estimate_l2_pair_seconds          # this, and an L2 pair of runs (estimate)
    (1.9, 7.4)

A run at L0 keeps only step records (x_t, v_t, x_next, mu, std_t, logp_t with their bytes) and its
replay inputs. ``localize``:

1. diffs the two runs (``diff_runs``) and picks the step to re-execute from the step records
   (``pick_step``): the first step of phase ``rollout`` that is not identical and whose input
   ``x_t`` is bitwise equal in both runs (every sample). When the first differing step already
   has a differing ``x_t`` (the latent changed between steps, outside every recorded operator, or
   — at step 0 — the runs start from different x_0), that is said, and a later step whose
   ``x_t`` matches again is taken if there is one; otherwise nothing can be localized. A pair
   of chain or edit runs whose drift starts before the transformer (in the text encoder or the
   VAE encode: ``early_stage_drift``) is not re-executed: status ``before_transformer`` names
   that stage (a transformer step would only consume the drift); nor is one whose first drift is
   in the VAE decode after the last step (``after_transformer``, ``late_stage_drift``), nor a
   pair captured at L2 whose records already name the first drift (``already_localized``,
   ``stored_level_names``).
2. re-executes that one step of both runs from their replay inputs, with the model, settings and
   variants each manifest names and the stored ``x_t`` bytes as input, at capture level L2
   (fused attention unfused into its qk / softmax / av internals), into two artifacts
   (``drifttool.training.step_replay``; in ``out_dir`` or a temporary directory removed after);
3. diffs the two re-executed artifacts and reports their first drift: operator, block, CFG
   branch, stream, sample and the differing rows (text position or patch) — what the diff of
   the same pair captured at L2 from the start names, since strict re-execution reproduces the
   step's bytes (``LocalizeResult.reproduced`` checks it against the stored step records).

Time. ``seconds`` is the wall time of the localization (the first diff when ``localize`` made it,
reading the runs, model loads, the two steps, the diff of the re-executed pair);
``estimate_l2_pair_seconds`` is an estimate, not a measurement, of what capturing both runs at L2
from the start would have cost: per run, the model load plus the re-executed step's time (at L2)
times the run's number of steps.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.location import FirstDrift
from drifttool.diff.report import DiffReport, StepDrift, Verdict
from drifttool.diff.stages import input_key, is_early_stage, made_by_both
from drifttool.artifact.schema import COMPONENTS, DEFAULT_COMPONENT, MANIFEST
from drifttool.errors import ArtifactError, DriftToolError
from drifttool.fixture import locate
from drifttool.jsondata import plain
from drifttool.training.options import RerunOptions
from drifttool.training.step_replay import (StepReplay, Variants, check_variants, replay_step,
                                            step_model)
from drifttool.training.stored import StoredRollout, load_rollout

LEVEL = "L2"
"""The capture level a step is re-executed at (fused operators unfused, row digests)."""

STATUSES = ("localized", "already_localized", "unconfirmed", "no_drift_in_reexecution",
            "before_transformer", "after_transformer", "nothing_to_localize")
"""``LocalizeResult.status``: localized (the re-executed step drifts and reproduces both runs'
stored step bytes); already_localized (both runs were captured at L2 with the attention's
internals, so their own records name the first drift's operator and rows, as a re-executed step
would: nothing is re-executed); unconfirmed (it drifts, but does not reproduce a run's stored bytes);
no_drift_in_reexecution (the re-executed steps do not differ); before_transformer (a chain or
edit run's drift starts in a stage before the transformer — the text encoder, the VAE encode —
which no re-executed transformer step shows: ``early_stage_drift``); after_transformer (every
transformer and sampler record matches and the drift starts in the VAE decode:
``late_stage_drift``); nothing_to_localize
(identical runs, no drift, or a drift that no re-executed step can show)."""

REEXECUTED = ("localized", "unconfirmed", "no_drift_in_reexecution")
"""The statuses of a result whose step was re-executed (``LocalizeResult.reexecuted``)."""

_STAGE_NAMES = {"text_encoder": "the text encoder", "vae": "the VAE encode"}
_LATE_NAMES = {"vae": "the VAE decode"}

_MODEL_KEYS = ("fixture", "checkpoint", "variant", "dtype", "lora")
"""Settings that decide the model: two runs equal in all of them share one loaded model."""


@dataclass(kw_only=True)
class StepChoice:
    """The step ``pick_step`` chose, or why there is none.

    Attributes:
        step: the step to re-execute, or None.
        why: in words, why that step (or why none).
        boundary: a drift already in a step's input x_t before ``step`` (or instead of one), in
            words; None when the first differing step has a matching x_t.
    """

    step: int | None
    why: str
    boundary: str | None = None


@dataclass(kw_only=True)
class LocalizeResult:
    """What ``localize`` found (module docstring).

    Attributes:
        status: one of ``STATUSES``; ``reason`` says it in one line.
        step: the step re-executed; for ``already_localized`` (nothing re-executed) the step of
            the stored first drift, which both runs' own records localize; None otherwise.
        why_step, boundary: ``StepChoice.why`` / ``StepChoice.boundary``.
        level: the re-execution's capture level (L2).
        first_drift: the first drift of the re-executed pair (None without one).
        diff: the full ``DiffReport`` of the re-executed pair.
        artifacts: the two re-executed artifacts (A, B), or None when they were temporary.
        reproduced: per run (``"A"``, ``"B"``), whether the re-executed step's records equal
            the stored ones; ``mismatches``: the ones that do not.
        shared_model: both runs re-executed with one loaded model (equal model settings).
        seconds: wall time of ``localize`` (the first diff unless given, model loads, steps, the
            diff of the re-executed pair).
        load_seconds, step_seconds: per run; a shared model's load counts for both runs.
        num_steps: per run, its number of steps.
        estimate_l2_pair_seconds: estimate (not measured) of an L2 capture of both whole runs:
            sum over the runs of load_seconds + step_seconds × num_steps.
    """

    status: str
    reason: str
    step: int | None = None
    why_step: str = ""
    boundary: str | None = None
    level: str = LEVEL
    first_drift: FirstDrift | None = None
    diff: DiffReport | None = None
    artifacts: list[str] | None = None
    reproduced: dict[str, bool] = field(default_factory=dict)
    mismatches: dict[str, list[str]] = field(default_factory=dict)
    shared_model: bool = False
    seconds: float = 0.0
    load_seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: dict[str, float] = field(default_factory=dict)
    num_steps: dict[str, int] = field(default_factory=dict)
    estimate_l2_pair_seconds: float | None = None
    estimate_basis: str = ("estimate, not measured: per run, model load + re-executed step time at "
                           f"{LEVEL} x number of steps")

    @property
    def reexecuted(self) -> bool:
        """Whether a step of both runs was re-executed (``REEXECUTED``)."""
        return self.status in REEXECUTED

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (the nested diff as ``DiffReport.to_dict``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "diff"}
        out["first_drift"] = None if self.first_drift is None else dataclasses.asdict(self.first_drift)
        out["diff"] = None if self.diff is None else self.diff.to_dict()
        return plain(out)


def _x_t_words(s: StepDrift) -> str:
    if s.step == 0:
        return ("x_t of step 0 differs: the runs start from different x_0 (replay inputs), before "
                "any operator ran")
    return (f"x_t of step {s.step} differs while the records before it match: the latent changed "
            "between steps, outside every recorded operator")


def pick_step(report: DiffReport) -> StepChoice:
    """The step of phase ``rollout`` to re-execute (module docstring, 1.), from a diff of two
    runs at any capture level."""
    if report.verdict is not Verdict.DRIFT:
        words = {Verdict.IDENTICAL: "the runs are identical", Verdict.INCOMPARABLE:
                 "the runs cannot be aligned", Verdict.INCONCLUSIVE: "no common record differs"}
        return StepChoice(step=None, why=f"{words[report.verdict]}: nothing to localize")
    steps = [s for s in report.steps if s.phase == "rollout" and s.step >= 0 and not s.identical]
    boundary = None
    for s in steps:
        if s.carried_in is None:
            return StepChoice(step=None, boundary=boundary,
                              why=f"step {s.step} differs but has no x_t record in one run: its "
                                  "input is unknown, nothing to localize")
        if not s.carried_in:
            why = (f"step {s.step} is the first step whose x_t matches in both runs and whose "
                   "records differ")
            if boundary is None:
                why = f"step {s.step} is the first differing step; its x_t matches in both runs"
            return StepChoice(step=s.step, why=why, boundary=boundary)
        if boundary is None:
            boundary = _x_t_words(s)
    if boundary is not None:
        return StepChoice(step=None, boundary=boundary,
                          why=f"{boundary}; no later step has a matching x_t: nothing to localize")
    return StepChoice(step=None, why="no step of phase rollout differs (the drift is in records "
                                     "no step re-executes): nothing to localize")


def early_stage_drift(report: DiffReport, ma: dict, mb: dict) -> str | None:
    """Why the drift of a chain or edit run pair starts before the transformer, or None: its first
    drift is a record of an early stage (step −1, not the transformer's: an L1/L2 pair), or the
    replay inputs that both runs' early stages made differ (``inputs.txt`` of two prompt runs: an
    L0 pair holds no record of the text encoder). Re-executing a transformer step from those
    inputs would name a transformer operator that only consumed the drift."""
    fd = report.first_drift
    if report.verdict is not Verdict.DRIFT:
        return None
    if fd is not None and is_early_stage(fd.component, fd.step):
        return (f"the drift starts in {_STAGE_NAMES.get(fd.component, fd.component)} (component "
                f"{fd.component}), before the transformer: first drift at {fd.where()}, as the "
                "diff names it; localize re-executes transformer steps only")
    made = made_by_both(ma, mb)
    differ = [(made[input_key(d)], input_key(d)) for d in report.input_differences
              if input_key(d) in made and ": differs" in d]
    if not differ:
        return None
    comp = next(c for c in COMPONENTS if c in {c for c, _ in differ})  # the earliest stage
    keys = [f"inputs.{k}" for k, c in made.items() if (c, k) in differ and c == comp]  # txt first
    outputs = f"its output {keys[0]} differs" if len(keys) == 1 else \
        f"its outputs {', '.join(keys)} differ"
    return (f"the drift starts in {_STAGE_NAMES.get(comp, comp)} (component {comp}), before the "
            f"transformer: {outputs}; localize re-executes transformer steps only, so it names no "
            f"operator: diff an L1 or L2 pair of the runs to name the {comp} operator")


def late_stage_drift(report: DiffReport) -> str | None:
    """Why the drift of a chain or edit run pair starts after the transformer, or None: its first
    drift is a record of a stage after the trajectory (the VAE decode: a component other than the
    transformer at a step ≥ 0), so every transformer and sampler record before it matches and no
    re-executed transformer step can show it."""
    fd = report.first_drift
    if report.verdict is not Verdict.DRIFT or fd is None or fd.component == DEFAULT_COMPONENT \
            or is_early_stage(fd.component, fd.step):
        return None
    return (f"the drift starts in {_LATE_NAMES.get(fd.component, fd.component)} (component "
            f"{fd.component}), after the transformer: first drift at {fd.where()}, as the diff names "
            "it, every earlier record matching; localize re-executes transformer steps only")


def stored_level_names(first: FirstDrift | None, ma: dict, mb: dict) -> str | None:
    """Why re-executing tells nothing more, or None: both runs were captured at ``LEVEL`` with
    the fused attention's internals (not ``--no-internals``) and their first drift is an operator
    record of a step born there (``origin_kind`` ``record`` or ``ranks``: the inputs it consumed
    match), so
    their own records name it with its rows, as a re-executed step's would."""
    if first is None or first.kind != "op" or first.step < 0 or first.origin_kind not in ("record", "ranks"):
        return None  # (inputs that differ, a latent changed between steps: pick_step says so)
    if any(m.get("capture_level") != LEVEL or m.get("settings", {}).get("internals") is False
           for m in (ma, mb)):
        return None
    return (f"both runs were captured at {LEVEL}: their own records name the first drift, "
            f"{first.where()}; no step re-executed")


def _same_model(a: StoredRollout, b: StoredRollout) -> bool:
    ma, mb = a.manifest, b.manifest
    return (all(a.settings.get(k) == b.settings.get(k) for k in _MODEL_KEYS)
            and not ma.get("model_source") and not mb.get("model_source")
            and ma["fingerprint"].get("weights") == mb["fingerprint"].get("weights"))


def _finish(result: LocalizeResult, t0: float) -> LocalizeResult:
    result.seconds = time.perf_counter() - t0
    return result


def localize(
    run_a: str | Path,
    run_b: str | Path,
    *,
    out_dir: str | Path | None = None,
    report: DiffReport | None = None,
    options: RerunOptions = RerunOptions(),
    variants_a: Variants | None = None,
    variants_b: Variants | None = None,
    model_a=None,
    model_b=None,
) -> tuple[DiffReport, LocalizeResult]:
    """Diff two rollouts and localize their first drift by re-executing one step of each at L2
    (module docstring).

    Args:
        out_dir: where the re-executed artifacts go (``out_dir/a``, ``out_dir/b``; both must not
            exist yet); None: a temporary directory, removed afterwards.
        report: the diff of the two runs if already made (``diff_runs``), else it is made here.
        options: model overrides (fixture, checkpoint, LoRA) for both runs, as ``replay`` takes
            them; mode and capture are not taken from it.
        variants_a, variants_b: the operator variants each run used (``RunSpec.variants``),
            fresh instances; required when the manifest lists variants.
        model_a, model_b: ready models (e.g. another implementation); still fingerprint-checked.

    Returns:
        ``(report, result)``: the diff of the two runs and the ``LocalizeResult``.

    Raises:
        DriftToolError (ArtifactError, CheckpointError, FixtureError): a run that cannot be
            re-executed: not a rollout, no replay inputs, the step's x_t missing (incomplete
            run), a model that cannot be found or does not match the fingerprint, variants the
            manifest names but that were not passed; ``out_dir/a`` or ``/b`` already existing;
            ``out_dir`` itself an artifact (ArtifactError).
    """
    t0 = time.perf_counter()
    run_a, run_b = Path(run_a), Path(run_b)
    for path in (run_a, run_b):  # before the diff: a verdict on a pair localize cannot re-run misleads
        kind = open_run(path).manifest.get("kind", "rollout")
        if kind != "rollout":
            raise ArtifactError(f"{path}: kind {kind!r} is not a rollout artifact (--localize "
                                "re-executes a rollout's step)")
    if options.fixture is not None:
        locate(options.fixture)  # a bad name is refused even when no step needs re-executing
    if report is None:
        report = diff_runs(open_run(run_a), open_run(run_b))
    early = early_stage_drift(report, open_run(run_a).manifest, open_run(run_b).manifest)
    if early is not None:
        return report, _finish(LocalizeResult(status="before_transformer", reason=early), t0)
    late = late_stage_drift(report)
    if late is not None:
        return report, _finish(LocalizeResult(status="after_transformer", reason=late), t0)
    first = report.first_drift
    if first is not None and first.step < 0:  # the sigma table: no step made it
        why = (f"the first drift, {first.op}#{first.call}, is made before the first step (the sigma "
               "table): the runs' schedules differ, and no step re-executes it")
        return report, _finish(LocalizeResult(status="nothing_to_localize", reason=why, why_step=why), t0)
    stored_l2 = stored_level_names(first, open_run(run_a).manifest, open_run(run_b).manifest)
    if stored_l2 is not None:
        return report, _finish(LocalizeResult(
            status="already_localized", reason=stored_l2, first_drift=first, step=first.step,
            why_step=f"the step of the first drift, which both runs' own {LEVEL} records name; "
                     "nothing re-executed"), t0)
    choice = pick_step(report)
    if choice.step is None:
        return report, _finish(LocalizeResult(status="nothing_to_localize", reason=choice.why,
                                              why_step=choice.why, boundary=choice.boundary), t0)
    k = choice.step
    given = {"A": (model_a, variants_a), "B": (model_b, variants_b)}
    stored = {}
    for side, path in (("A", run_a), ("B", run_b)):  # variants first: they change the sigma table
        variants = check_variants(path, open_run(path).manifest, given[side][1])
        stored[side] = load_rollout(path, need_latents=False, variants=variants)
    if out_dir is not None:
        tmp, base = None, Path(out_dir)
        if (base / MANIFEST).is_file():
            raise ArtifactError(f"--localize-dir {base} is a drifttool artifact; give a directory of "
                                "its own (the re-executed steps go to DIR/a and DIR/b)")
        taken = [str(base / n) for n in ("a", "b") if (base / n).exists()]
        if taken:
            raise DriftToolError(f"{taken[0]} exists: the re-executed artifacts go to DIR/a and "
                                 "DIR/b of a --localize-dir that does not hold them yet")
        base.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="drifttool-localize-")
        base = Path(tmp.name)
    result = LocalizeResult(status="", reason="", step=k, why_step=choice.why,
                            boundary=choice.boundary)
    try:
        models: dict[str, Any] = {}
        replays: dict[str, StepReplay] = {}
        for side in ("A", "B"):
            st, (model, variants) = stored[side], given[side]
            t1 = time.perf_counter()
            if model is None and side == "B" and given["A"][0] is None \
                    and _same_model(stored["A"], st):
                model, result.shared_model = models["A"], True
            models[side] = step_model(st, options, model)
            result.load_seconds[side] = (result.load_seconds["A"] if result.shared_model
                                         else time.perf_counter() - t1)
            replays[side] = replay_step(st, k, base / side.lower(), model=models[side],
                                        level=LEVEL, variants=variants)
            result.step_seconds[side] = replays[side].seconds
            result.num_steps[side] = st.sampler.num_steps
            result.reproduced[side] = replays[side].reproduced
            result.mismatches[side] = replays[side].mismatches
        sub = diff_runs(open_run(base / "a"), open_run(base / "b"))
    finally:
        if tmp is not None:
            tmp.cleanup()
    sub.notes = [n for n in sub.notes if not n.endswith("is incomplete (manifest complete=false)")]
    sub.notes.insert(0, f"re-executed artifacts: step {k} of each run at {LEVEL} (replays of one "
                        "step, marked incomplete)")
    result.diff, result.first_drift = sub, sub.first_drift
    result.artifacts = None if tmp is not None else [str(base / "a"), str(base / "b")]
    result.estimate_l2_pair_seconds = sum(result.load_seconds[s] + result.step_seconds[s]
                                          * result.num_steps[s] for s in ("A", "B"))
    not_reproduced = [s for s in ("A", "B") if not result.reproduced[s]]
    if sub.first_drift is None:
        result.status = "no_drift_in_reexecution"
        result.reason = (f"the re-executed step {k} does not differ at {LEVEL} ({sub.verdict.value})"
                         + (f"; it did not reproduce run {' and '.join(not_reproduced)}'s stored "
                            "step records" if not_reproduced else ""))
    elif not_reproduced:
        result.status = "unconfirmed"
        modes = {stored[s].settings.get("mode", "strict") for s in not_reproduced}
        hint = ("a production run's fused operators run unfused at L2, with other rounding"
                if modes - {"strict", "audit"} else
                "a strict step should reproduce them: a variant that is not a fresh instance, or "
                "one whose state spans steps?")
        result.reason = (f"first drift of the re-executed step {k} at {sub.first_drift.where()}, but "
                         f"the re-execution did not reproduce run {' and '.join(not_reproduced)}'s "
                         f"stored step records ({result.mismatches[not_reproduced[0]][0]}, ...): "
                         f"{hint}")
    else:
        result.status = "localized"
        rows = sub.first_drift.rows
        row_words = "" if rows is None else (
            f"; rows {rows.n_differ} of {rows.n_rows} differ, first "
            + ", ".join(map(str, rows.first[:3])))
        result.reason = (f"first drift at {sub.first_drift.where()}{row_words}; "
                         f"{sub.first_drift.origin_words()}")
    return report, _finish(result, t0)
