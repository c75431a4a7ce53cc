"""``diff_runs``: align two artifacts by identity and find the first drift.

    >>> report = diff_runs(open_run("runs/a"), open_run("runs/b"))
    >>> report.verdict, report.first_drift.where()
    (<Verdict.DRIFT: 'drift'>,
     'rollout step 3 cond block 5 img qk_rmsnorm#0 sample 1 (owning rank 1 in run A, 0 in run B)')

Order of work (design.md, "Diff"):
1. Incomparable? Schema versions, ``fingerprint["arch"]`` (the architecture's shape fields) and
   the capture levels must allow alignment; otherwise the differing fields are named and nothing
   else is compared.
2. Semantic pre-check: the program fields (schedule, shift, timestep encoding, CFG, SDE, noise
   provenance, LoRA, weights, attention backend) are compared before any record
   (``drifttool.diff.semantic``); a mismatch is its own verdict (``DiffReport.semantic``, exit 1).
3. Context: the rest of the fingerprint, the replay inputs, the capture level and the operator
   trace are compared and listed first; they do not stop the diff (``drifttool.diff.context``).
4. Step records (every level) and op records (when both runs are L1 or finer) are aligned by
   identity (which holds no rank) and compared by digest (``drifttool.diff.align``).
5. First drift = the differing record first in run A's program order (``drifttool.diff.order``:
   rank-independent, ops and steps in one order), reported with its owning rank in each run,
   unless its step's input ``x_t`` already differs (then that ``x_t`` record), with where it was
   born and, at L2, its first differing rows and the rank that computed them
   (``drifttool.diff.first_drift``).
6. Per step: first differing op, whether ``x_t`` already differed (carried in), value drift of
   the step quantities and the SDE-transition KL (``drifttool.diff.steps``).
Verdict: drift if any common record differs; else inconclusive if records are missing or a run
is incomplete ("identical through step k"); else identical. The reason names the common capture
level and what it covers ("identical at L0: step boundaries only; ...").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from drifttool.artifact import compute as ac
from drifttool.artifact import schema as S
from drifttool.artifact.reader import Run
from drifttool.diff.arrays import arrow_array
from drifttool.diff.align import TableDiff, compare_table, drop_replicas
from drifttool.diff.clip import check_clip_range, clip_drift
from drifttool.diff.consistency import check_matched
from drifttool.diff.context import context, incomparable, input_differences, internal_ops
from drifttool.diff.first_drift import record_where, set_drift
from drifttool.diff.order import program_order
from drifttool.diff.report import LEVEL_COVERS, DiffReport, Verdict
from drifttool.diff.semantic import semantic_check
from drifttool.diff.steps import step_drifts
from drifttool.diff.tolerance import Profile, judge, load_profile, scope_notes
from drifttool.diff.uncaptured import declared, drop_uncaptured
from drifttool.diff.uncaptured import note as uncaptured_note
from drifttool.digestcore import digest_bytes
from drifttool.errors import ArtifactError, DriftToolError

_OPS_COLS = list(dict.fromkeys([*S.OPS_KEY, *S.OP_ORDER, "rank", "seq", "sigma", "digest",
                                "rank_disagree"]))
_STEP_COLS = list(dict.fromkeys([*S.STEPS_KEY, *S.STEP_ORDER, "rank", "seq", "sigma",
                                 "sigma_next", "dtype", "shape", "digest"]))


def recompute_alignment(ma: dict, mb: dict) -> dict[str, str] | None:
    """``{"train": "rollout"}`` when one run is a training recompute (manifest ``kind:
    "recompute"``, ``drifttool.training.recompute``) and the other a rollout: the recompute's phase
    ``train`` records are then aligned with the rollout's phase ``rollout`` records, and its
    gradient records (role ``grad_weight``, which a rollout cannot have) are left out. ``None``
    otherwise (two rollouts, or two training runs, align as they are)."""
    kinds = {ma.get("kind", "rollout"), mb.get("kind", "rollout")}
    return {"train": "rollout"} if kinds == {"rollout", "recompute"} else None


def _prepared(table: pa.Table, phase_map: dict[str, str] | None, drop_grads: bool,
              internals: bool = True) -> pa.Table:
    """``table`` with a ``_row`` column (index into the run's full table), gradient records
    dropped and phases renamed as asked. Without ``internals`` (a common level below L2, or a
    run at L2 that left them out: ``internals_of``) the fused operators' internal records
    (role ``internal``) are left out: the other run has the fused operator's own record
    instead, and both runs hold that."""
    t = table.append_column("_row", arrow_array(np.arange(table.num_rows, dtype=np.int64)))
    if drop_grads and "role" in t.column_names:
        t = ac.filter(t, ac.is_in(t["role"], ["output", "internal"]))
    if not internals and "role" in t.column_names:
        t = ac.filter(t, ac.call("not_equal", t["role"], "internal"))
    for old, new in (phase_map or {}).items():
        col = ac.call("if_else", ac.call("equal", t["phase"], old), pa.scalar(new), t["phase"])
        t = t.set_column(t.column_names.index("phase"), "phase", col)
    return t


def check_step_bytes(run: Run) -> None:
    """Re-digest (digest v2, ``drifttool.digestcore``) every step record's stored bytes against its digest (the diff compares digests;
    this makes sure they still describe the bytes).

    Raises:
        ArtifactError: a record whose bytes do not match its digest (tampered or corrupt),
            naming the file that holds it (``Run.table_file``).
    """
    t = run.steps_table().select(["rank", "step", "sample", "branch", "quantity", "dtype",
                                  "shape", "digest", "data"])
    for r in t.to_pylist():
        try:
            ok = digest_bytes(r["data"], r["dtype"], r["shape"]) == r["digest"]
        except (ValueError, DriftToolError):
            ok = False  # bytes that do not hold the declared dtype and shape
        if not ok:
            raise ArtifactError(
                f"{run.table_file('steps', r['rank'])}: the bytes of step {r['step']} sample "
                f"{r['sample']} {r['branch']} {r['quantity']} do not match their digest "
                "(tampered or corrupt)")


def _compare_tables(run_a: Run, run_b: Run, level: str, phase_map: dict[str, str] | None = None,
                    internals: bool = False) -> tuple[TableDiff, TableDiff | None]:
    """Align and compare the step tables, and the op tables when both runs hold them (their
    internal records when ``internals``: ``internals_of``). Program positions are computed
    over all four tables at once, so they compare across them."""
    da, db = declared(run_a.manifest), declared(run_b.manifest)  # records a run cannot capture
    sa, *ra = drop_replicas(drop_uncaptured(_prepared(
        run_a.steps_table().select([*_STEP_COLS, "data"]), phase_map, False), da, db, ops=False),
        S.STEPS_KEY)
    sb, *rb = drop_replicas(drop_uncaptured(_prepared(
        run_b.steps_table().select([*_STEP_COLS, "data"]), phase_map, False), da, db, ops=False),
        S.STEPS_KEY)
    if level == "L0":
        return _with_replicas(compare_table(sa, sb, S.STEPS_KEY), ra, rb), None
    grads = phase_map is not None
    oa, *qa = drop_replicas(drop_uncaptured(_prepared(
        run_a.ops_table().select(_OPS_COLS), phase_map, grads, internals), da, db, ops=True),
        S.OPS_KEY)
    ob, *qb = drop_replicas(drop_uncaptured(_prepared(
        run_b.ops_table().select(_OPS_COLS), phase_map, grads, internals), da, db, ops=True),
        S.OPS_KEY)
    psa, psb, poa, pob = program_order([sa, sb, oa, ob])
    return (_with_replicas(compare_table(sa, sb, S.STEPS_KEY, (psa, psb)), ra, rb),
            _with_replicas(compare_table(oa, ob, S.OPS_KEY, (poa, pob)), qa, qb))


def left_out_internals(run: Run) -> bool:
    """Whether ``run`` captured L2 without the fused attention's internals (``--no-internals``:
    its manifest's ``settings.internals`` is false)."""
    return (run.manifest.get("settings") or {}).get("internals", True) is False


def internals_of(run_a: Run, run_b: Run, level: str) -> tuple[bool, str | None]:
    """How a comparison at ``level`` treats the fused attention's internal records, decided once
    per pair: ``(compared, note)``. They are compared at L2 when both runs hold them (not left
    out, ``left_out_internals``, and present: an attention that exposes none, such as production
    SDPA, leaves none). Otherwise, when one run holds some or left them out, ``note`` says why
    and how many were left aside (two production runs leave nothing aside: None)."""
    if level != "L2":
        return False, None
    runs = (("A", run_a), ("B", run_b))
    count = {s: sum(internal_ops(r).values()) for s, r in runs}
    left = {s: left_out_internals(r) for s, r in runs}
    held = {s: not left[s] and count[s] > 0 for s in count}
    if all(held.values()) or not any(left[s] or count[s] for s in count):
        return all(held.values()), None
    why = [f"run {s} captured L2 without them (--no-internals)" if left[s] else
           f"run {s}'s attention exposes none (production attention)" for s in count if not held[s]]
    kept = [f"run {s}'s {n} internal records left out of the counts and the trace context"
            for s, n in count.items() if n]
    return False, f"the fused attention's internals not compared: {'; '.join(why + kept)}"


def _with_replicas(t: TableDiff, ra: list[int], rb: list[int]) -> TableDiff:
    t.replicas, t.conflicts = (ra[0], rb[0]), (ra[1], rb[1])
    return t


def _layout_text(run: Run) -> str:
    """``"sample_parallel over 2 ranks"``, ``"parallel over 4 ranks (tp 2 × sp 2 agrs × cfg 1)"``,
    ``"single process"``: the manifest's layout, briefly."""
    lay = run.manifest.get("layout") or {}
    world = int(lay.get("world_size", 1))
    kind = lay.get("kind", "single")
    if world == 1 and kind == "single":
        return "single process"
    text = f"{kind} over {world} rank" + ("s" if world > 1 else "")
    if kind == "parallel":
        sp = int(lay.get("sp", 1))
        how = f" {lay.get('sp_attention', 'agrs')}" if sp > 1 else ""
        text += f" (tp {lay.get('tp', 1)} × sp {sp}{how} × cfg {lay.get('cfg_parallel', 1)})"
    return text


def _notes(run_a: Run, run_b: Run, level: str, tables: list[TableDiff],
           internals_note: str | None) -> list[str]:
    notes = []
    if level == "L0":
        notes.append("op records not compared: a run holds only step records (L0)")
    if level != "L2":
        notes.append(f"row digests not compared (common capture level {level})")
    elif internals_note:
        notes.append(internals_note)
    notes += uncaptured_note(run_a.manifest, run_b.manifest)
    la, lb = _layout_text(run_a), _layout_text(run_b)
    if la != lb:  # information: rank is not identity, so layouts align
        notes.append(f"execution layouts differ (records align by identity): A {la}, B {lb}")
    for side, run in (("A", run_a), ("B", run_b)):
        notes += [f"run {side}: {p}" for p in run.problems]
        if not run.complete:
            notes.append(f"run {side} is incomplete (manifest complete=false)")
    for side, k in (("A", 0), ("B", 1)):
        dropped = sum(t.replicas[k] for t in tables)
        if dropped:
            notes.append(f"run {side}: {dropped} record{'s' if dropped > 1 else ''} replicated on "
                         "several ranks with equal digests, compared once (the lowest rank's)")
        bad = sum(t.conflicts[k] for t in tables)
        if bad:
            notes.append(f"run {side}: {bad} records computed on several ranks disagree between "
                         "the ranks (all kept: they pair by occurrence)")
    dups = sum(t.al.duplicates for t in tables)
    if dups:
        notes.append(f"{dups} records repeat an identity; paired by occurrence order")
    return notes


def _samples_only_in_one_run(tables: list[TableDiff]) -> tuple[list, list, list] | None:
    """When the runs hold different logical samples (a batch of 3 against sample 2 alone) and
    every unmatched record belongs to a sample that the other run does not hold, return
    (common, only in A, only in B) sample ids; otherwise None (records are really missing)."""
    st = tables[0]
    sa = set(st.a.column("sample").to_pylist())
    sb = set(st.b.column("sample").to_pylist())
    common = sa & sb
    if sa == sb or not common:
        return None
    for t in tables:
        lone_a = set(ac.take(t.a.column("sample"), arrow_array(t.al.only_a)).to_pylist())
        lone_b = set(ac.take(t.b.column("sample"), arrow_array(t.al.only_b)).to_pylist())
        if (lone_a | lone_b) & common:
            return None
    return sorted(common), sorted(sa - sb), sorted(sb - sa)


def _set_no_drift(report: DiffReport, run_a: Run, run_b: Run, tables: list[TableDiff]) -> None:
    """Identical, or inconclusive when records are missing or a run is incomplete."""
    sa, sb = (sorted(set(t.column("sample").to_pylist())) for t in (tables[0].a, tables[0].b))
    if sa and sb and not set(sa) & set(sb):
        report.verdict = Verdict.INCONCLUSIVE
        report.reason = (f"the sample sets are disjoint (samples {sa} vs {sb}): the runs share no "
                         "logical sample to compare")
        return
    matched = sum(t.al.ia.size for t in tables)
    only_a = sum(t.al.only_a.size for t in tables)
    only_b = sum(t.al.only_b.size for t in tables)
    why = [f"run {s} is incomplete" for s, r in (("A", run_a), ("B", run_b)) if not r.complete]
    extra = _samples_only_in_one_run(tables)
    if (only_a or only_b) and extra is None:
        why.append(f"{only_a} records only in run A, {only_b} only in run B")
    if report.input_differences:
        why.append(f"replay inputs differ ({report.input_differences[0]}"
                   f"{f' and {len(report.input_differences) - 1} more' if len(report.input_differences) > 1 else ''})")
    level = f"{report.level}: {report.covers}"
    if not why:
        report.verdict = Verdict.IDENTICAL
        report.reason = f"identical at {level}; all {matched} records are bitwise identical"
        if extra is not None:
            common, in_a, in_b = extra
            report.reason = (f"identical at {level}; all {matched} records of the common samples "
                             f"{common} are bitwise identical")
            report.notes.insert(0, f"samples only in run A: {in_a or 'none'}; only in run B: "
                                   f"{in_b or 'none'} (not compared)")
        return
    through = ("identical through {} step {}".format(*report.identical_through)
               if report.identical_through else "no step fully matched")
    report.verdict = Verdict.INCONCLUSIVE
    report.reason = (f"no drift at {level} in {matched} common records, but {', '.join(why)}; "
                     f"{through}")


def diff_runs(run_a: Run, run_b: Run, *, align_recompute: bool = True,
              tolerance: Profile | str | Path | None = None, clip_range: float | None = None) -> DiffReport:
    """Compare two opened artifacts (``drifttool.artifact.open_run``); see the module docstring.

    With ``align_recompute`` a rollout and its training recompute are aligned phase ``rollout``
    ↔ ``train`` (``recompute_alignment``); a note says so. With a ``tolerance`` profile
    (``drifttool.diff.tolerance``: a ``Profile``, or a shipped profile's name or a profile file
    for ``load_profile``) every differing common record is also judged within or beyond it
    (``DiffReport.tolerance``); the bitwise verdict is unchanged. With a ``clip_range`` ε
    the log-prob drift per step and branch is judged against it (``DiffReport.clip``,
    ``drifttool.diff.clip``); the verdict and exit code are unchanged.

    Returns:
        ``DiffReport`` with verdict identical / drift / incomparable / inconclusive.

    Raises:
        ArtifactError: a file is unreadable, or cut short in a run marked complete.
        DriftToolError: a tolerance profile that cannot be loaded (``load_profile``), or
            ``tolerance`` of another type.
    """
    if clip_range is not None:
        clip_range = check_clip_range(clip_range)
    if isinstance(tolerance, (str, Path)):
        tolerance = load_profile(tolerance)
    elif tolerance is not None and not isinstance(tolerance, Profile):
        raise DriftToolError(f"tolerance: a Profile, a profile name or a profile file, got "
                             f"{type(tolerance).__name__}")
    report = DiffReport(verdict=Verdict.INCOMPARABLE, reason="", run_a=str(run_a.path),
                        run_b=str(run_b.path))
    report.incomparable = incomparable(run_a.manifest, run_b.manifest)
    if report.incomparable:
        report.reason = "cannot align: " + "; ".join(report.incomparable[:3])
        return report
    run_a.check()  # every file is read and checked, also those the common level leaves out
    run_b.check()
    check_step_bytes(run_a)
    check_step_bytes(run_b)
    report.input_differences = input_differences(run_a, run_b)
    report.semantic = semantic_check(run_a, run_b, report.input_differences)
    report.level = level = min(run_a.capture_level, run_b.capture_level, key=S.LEVELS.index)
    report.covers = LEVEL_COVERS[level]
    internals, internals_note = internals_of(run_a, run_b, level)
    report.context = context(run_a, run_b, report.input_differences,
                             internals_aside=internals_note is not None)
    if internals_note:
        report.covers += ", without the fused attention's internals"
    phase_map = recompute_alignment(run_a.manifest, run_b.manifest) if align_recompute else None
    st, ot = _compare_tables(run_a, run_b, level, phase_map, internals)
    tables = [st] if ot is None else [st, ot]
    for kind, t in zip(("step", "op"), tables):
        check_matched(run_a, run_b, kind, t)
    report.counts = {"steps": st.counts(), **({"ops": ot.counts()} if ot else {})}
    report.notes = _notes(run_a, run_b, level, tables, internals_note)
    if run_a.path.resolve() == run_b.path.resolve():  # a mistyped pair would pass unnoticed
        report.notes.insert(0, "run A and run B are the same directory: the run is compared with "
                               "itself (only its own checks, such as its ranks' agreement, can fail)")
    if phase_map is not None:
        side = "B" if run_b.manifest.get("kind") == "recompute" else "A"
        report.notes.insert(0, f"run {side} is a training recompute: its phase 'train' records are "
                               "aligned with phase 'rollout'; its gradient records are not compared")
    report.steps = step_drifts(st, ot)
    for s in report.steps:  # a record after the last block is said so (schema.model_blocks)
        if s.first_op is not None:
            s.first_op.blocks = S.model_blocks(run_a.manifest, s.first_op.component)
    for s in report.steps:
        if not s.identical:
            break
        if s.step >= 0:  # step -1 holds records made before the first step (sigma table)
            report.identical_through = (s.phase, s.step)
    if not set_drift(report, run_a, run_b, tables):
        _set_no_drift(report, run_a, run_b, tables)
    if clip_range is not None:
        report.clip = clip_drift(st, clip_range)
    if tolerance is not None:
        report.tolerance = judge(tolerance, run_a, run_b, st, ot,
                                 lambda kind, ra, rb: record_where(kind, ra, rb, run_a.manifest))
        only = sum(c.only_a + c.only_b for c in report.counts.values())
        report.tolerance.block(
            ([f"{only} records are in one run only"] if only else [])
            + (["the replay inputs differ"] if report.input_differences else [])
            + [f"run {s} is incomplete" for s, r in (("A", run_a), ("B", run_b)) if not r.complete])
        report.notes += scope_notes(tolerance, run_a, run_b)
    return report


def aligned_tables(run_a: Run, run_b: Run) -> tuple[TableDiff, TableDiff | None]:
    """The step and op tables of two runs aligned as ``diff_runs`` aligns them (common capture
    level, recompute phases mapped), for tools that judge the differing pairs
    (``drifttool.diff.tolerance.measure``)."""
    level = min(run_a.capture_level, run_b.capture_level, key=S.LEVELS.index)
    return _compare_tables(run_a, run_b, level, recompute_alignment(run_a.manifest, run_b.manifest),
                           internals_of(run_a, run_b, level)[0])
