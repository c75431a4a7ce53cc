"""``diff_runs``: align two artifacts by identity and find the first drift.

    >>> report = diff_runs(open_run("runs/a"), open_run("runs/b"))
    >>> report.verdict, report.first_drift.where()
    (<Verdict.DRIFT: 'drift'>,
     'rollout step 3 cond block 5 img qk_rmsnorm#0 sample 1 (owning rank 1 in run A, 0 in run B)')

Order of work (design.md, "Diff"):
1. Incomparable? Schema versions, ``fingerprint["arch"]`` (the architecture's shape fields) and
   the capture levels must allow alignment; otherwise the differing fields are named and nothing
   else is compared.
2. Context: the rest of the fingerprint, the replay inputs, the capture level and the operator
   trace are compared and listed first; they do not stop the diff (``drifttool.diff.context``).
3. Step records (every level) and op records (when both runs are L1 or finer) are aligned by
   identity (which holds no rank) and compared by digest (``drifttool.diff.align``).
4. First drift = the differing record first in run A's program order (``drifttool.diff.order``:
   rank-independent, ops and steps in one order), reported with its owning rank in each run,
   unless its step's input ``x_t`` already differs: then the first drift is
   that ``x_t`` record, a step boundary (origin ``between_steps`` when the previous step
   matched; for the phase's first step the record stays, origin ``inputs``). A record is an
   origin only if the inputs it consumed match and no record before it is missing in either
   run (``FirstDrift.origin_kind``). With row digests on both sides (L2) its differing rows are
   named (text position or patch (i, j)), and in a run laid out with SP > 1 the rank that
   computed the first of them (``row_rank_a``/``row_rank_b``, ``drifttool.diff.owners``): the
   writer (TP/SP coordinate 0) holds the gathered tensor, the row's SP shard computed it.
5. Per step: first differing op, whether ``x_t`` already differed (carried in), value drift of
   the step quantities and the SDE-transition KL (``drifttool.diff.steps``).
Verdict: drift if any common record differs; else inconclusive if records are missing or a run
is incomplete ("identical through step k"); else identical. The reason names the common capture
level and what it covers ("identical at L0: step boundaries only; ...").
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from drifttool.artifact import schema as S
from drifttool.artifact.reader import Run
from drifttool.capture.layout import row_id
from drifttool.diff.align import TableDiff, compare_table, drop_replicas
from drifttool.diff.consistency import check_matched
from drifttool.diff.context import context, incomparable, input_differences
from drifttool.diff.order import program_order
from drifttool.diff.owners import heads_note, row_owner
from drifttool.diff.report import (LEVEL_COVERS, DiffReport, FirstDrift, RowDrift, RowRef,
                                   StepDrift, Verdict)
from drifttool.diff.steps import step_drifts
from drifttool.diff.tolerance import Profile, judge, scope_notes
from drifttool.diff.uncaptured import declared, drop_uncaptured
from drifttool.diff.uncaptured import note as uncaptured_note
from drifttool.digestcore import digest_bytes
from drifttool.errors import ArtifactError, DriftToolError

FIRST_ROWS = 8  # differing rows named in the report

_OPS_COLS = list(dict.fromkeys([*S.OPS_KEY, *S.OP_ORDER, "rank", "seq", "sigma", "digest",
                                "rank_disagree"]))
_STEP_COLS = list(dict.fromkeys([*S.STEPS_KEY, *S.STEP_ORDER, "rank", "seq", "sigma",
                                 "sigma_next", "dtype", "shape", "digest"]))


def _first(t: TableDiff) -> tuple[int, int, int] | None:
    """``(pos_a, ia, ib)`` of the differing record first in run A's program order."""
    if t.da.size == 0:
        return None
    k = np.lexsort((t.da, t.pos_a[t.da]))[0]
    return int(t.pos_a[t.da[k]]), int(t.da[k]), int(t.db[k])


def _row_drift(ra: dict, rb: dict) -> tuple[RowDrift | None, str]:
    da, db = ra["row_digests"], rb["row_digests"]
    if da is None or db is None:
        return None, ""
    if len(da) != len(db):
        return None, f"row counts differ ({len(da)} vs {len(db)}): rows not compared"
    diff = np.nonzero(np.asarray(da, np.uint64) != np.asarray(db, np.uint64))[0]
    w = ra["img_w"]
    first = [RowRef.of(int(r), row_id(int(r), ra["txt_len"] or 0, w)) for r in diff[:FIRST_ROWS]]
    return RowDrift(n_rows=len(da), n_differ=int(diff.size), first=first), ""


def _row_ranks(rows: RowDrift | None, ra: dict, rb: dict, layout_a: dict | None,
               layout_b: dict | None) -> tuple[int | None, int | None]:
    """The rank that computed the first differing row in each run (SP layouts), else None
    (``drifttool.diff.owners.row_owner``)."""
    if rows is None or not rows.first:
        return None, None
    r = rows.first[0].row
    return row_owner(layout_a, ra, r), row_owner(layout_b, rb, r)


def _part_ranks(ra: dict, rb: dict, layout_a: dict | None,
                layout_b: dict | None) -> tuple[int | None, int | None]:
    """The first rank whose digest partial of the record differs between the runs
    (``rank_digests``), when both runs hold them in the same layout; else ``None``. Each rank's
    partial covers what it computed of the record (its rows, heads or channels), so this names
    the rank whose part differs where the row digests cannot (Ulysses' heads, L1)."""
    da, db = ra.get("rank_digests"), rb.get("rank_digests")
    if da is None or db is None or len(da) != len(db) or not _same_layout(layout_a, layout_b):
        return None, None
    differ = [r for r, (x, y) in enumerate(zip(da, db)) if x != y]
    return (differ[0], differ[0]) if differ else (None, None)


def _same_layout(a: dict | None, b: dict | None) -> bool:
    keys = ("kind", "world_size", "tp", "sp", "cfg_parallel", "sp_attention")
    return all((a or {}).get(k) == (b or {}).get(k) for k in keys)


def _first_drift(kind: str, ra: dict, rb: dict, origin_kind: str, layout_a: dict | None = None,
                 layout_b: dict | None = None) -> tuple[FirstDrift, str]:
    op = kind == "op"
    rows, note = _row_drift(ra, rb) if op else (None, "")
    row_a, row_b = _row_ranks(rows, ra, rb, layout_a, layout_b)
    part_a, part_b = _part_ranks(ra, rb, layout_a, layout_b) if op else (None, None)
    fd = FirstDrift(
        kind=kind, rank_a=ra["rank"], rank_b=rb["rank"], component=ra["component"],
        phase=ra["phase"], step=ra["step"], sigma=ra["sigma"], branch=ra["branch"],
        block=ra["block"] if op else None, op_pos=ra["op_pos"] if op else None, stream=ra["stream"] if op else None,
        op=ra["op"] if op else ra["quantity"], call=ra["call"] if op else None,
        index=ra["index"] if op else None, role=ra["role"] if op else None, sample=ra["sample"],
        dtype=(ra["dtype"], rb["dtype"]), shape=(ra["shape"], rb["shape"]),
        digest=(f"{ra['digest']:016x}", f"{rb['digest']:016x}"),
        nonfinite=(ra["nonfinite"], rb["nonfinite"]), maxabs=(ra["maxabs"], rb["maxabs"]),
        origin=origin_kind not in ("unknown", "unchecked"), origin_kind=origin_kind, rows=rows,
        row_rank_a=row_a, row_rank_b=row_b, part_rank_a=part_a, part_rank_b=part_b,
        disagree_a=ra.get("rank_disagree") or None if op else None,
        disagree_b=rb.get("rank_disagree") or None if op else None,
    )
    return fd, note


def _tp_sp(layout: dict | None) -> bool:
    """Whether a manifest layout runs TP or SP (records written from several ranks' work)."""
    lay = layout or {}
    return lay.get("kind") == "parallel" and int(lay.get("tp", 1)) * int(lay.get("sp", 1)) > 1


def _rank_marks(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of ``table``'s op records whose ranks disagree (``rank_disagree`` not empty)
    and of its operator outputs not checked on every rank (``rank_disagree`` null)."""
    col = table.column("rank_disagree")
    n = pc.fill_null(pc.list_value_length(col), 0).to_numpy()
    outputs = pc.is_in(table.column("role"), pa.array(["output", "internal"])).to_numpy(
        zero_copy_only=False)
    unchecked = col.is_null().to_numpy(zero_copy_only=False) & outputs
    return np.flatnonzero(n > 0), np.flatnonzero(unchecked)


def _first_disagreement(ot: TableDiff) -> tuple[int, int | None, int | None] | None:
    """``(position, row in A, row in B)`` of the op record first in program order on which a
    run's ranks disagree (either run; the other run's row of the same identity, if any)."""
    best = None
    for side, table, pos, mine, other in (("a", ot.a, ot.pos_a, ot.al.ia, ot.al.ib),
                                          ("b", ot.b, ot.pos_b, ot.al.ib, ot.al.ia)):
        rows = _rank_marks(table)[0]
        if rows.size == 0:
            continue
        k = rows[np.lexsort((rows, pos[rows]))[0]]
        if best is None or pos[k] < best[0]:
            hit = np.flatnonzero(mine == k)
            partner = int(other[hit[0]]) if hit.size else None
            best = (int(pos[k]), int(k), partner) if side == "a" else (int(pos[k]), partner, int(k))
    return best


def _unchecked_before(ot: TableDiff | None, pos: int, layouts: tuple[dict | None, dict | None]) -> bool:
    """Whether a TP/SP run holds an operator output before program position ``pos`` that was
    not checked on every rank (no origin may be claimed past it)."""
    if ot is None:
        return False
    for table, p, lay in ((ot.a, ot.pos_a, layouts[0]), (ot.b, ot.pos_b, layouts[1])):
        if _tp_sp(lay):
            rows = _rank_marks(table)[1]
            if rows.size and int(p[rows].min()) < pos:
                return True
    return False


def _unmatched_before(tables: list[TableDiff], pos_a: int, pos_b: int) -> int:
    """How many records present in one run only precede program position ``pos_a`` in A or
    ``pos_b`` in B."""
    return sum(int(np.count_nonzero(t.pos_a[t.al.only_a] < pos_a))
               + int(np.count_nonzero(t.pos_b[t.al.only_b] < pos_b)) for t in tables)


def _step_input(st: TableDiff, phase: str, step: int) -> tuple[int, int] | None:
    """``(ia, ib)`` of the first differing ``x_t`` record of (phase, step) in run A's program
    order (the step's input already differs), or ``None``."""
    rows = st.da
    sel = ((st.a.column("quantity").to_numpy(zero_copy_only=False)[rows] == "x_t")
           & (st.a.column("phase").to_numpy(zero_copy_only=False)[rows] == phase)
           & (st.a.column("step").to_numpy()[rows] == step))
    if not sel.any():
        return None
    k = np.flatnonzero(sel)[np.lexsort((rows[sel], st.pos_a[rows[sel]]))[0]]
    return int(st.da[k]), int(st.db[k])


def _boundary_origin(steps: list[StepDrift], phase: str, step: int) -> tuple[str, StepDrift | None]:
    """Origin kind of a drift that is already in step ``step``'s input ``x_t``: ``"unknown"``
    when an earlier step misses records, ``"between_steps"`` (with that previous step) when the
    phase ran an earlier step, else ``"inputs"``."""
    before = []
    for s in steps:
        if (s.phase, s.step) == (phase, step):
            break
        before.append(s)
    if any(s.missing or not s.identical for s in before):
        return "unknown", None
    prev = [s for s in before if s.phase == phase and s.step >= 0]
    return ("between_steps", prev[-1]) if prev else ("inputs", None)


# -- the diff --------------------------------------------------------------------------------------
def recompute_alignment(ma: dict, mb: dict) -> dict[str, str] | None:
    """``{"train": "rollout"}`` when one run is a training recompute (manifest ``kind:
    "recompute"``, ``drifttool.sampling.train``) and the other a rollout: the recompute's phase
    ``train`` records are then aligned with the rollout's phase ``rollout`` records, and its
    gradient records (role ``grad_weight``, which a rollout cannot have) are left out. ``None``
    otherwise (two rollouts, or two training runs, align as they are)."""
    kinds = {ma.get("kind", "rollout"), mb.get("kind", "rollout")}
    return {"train": "rollout"} if kinds == {"rollout", "recompute"} else None


def _prepared(table: pa.Table, phase_map: dict[str, str] | None, drop_grads: bool,
              level: str = "L2") -> pa.Table:
    """``table`` with a ``_row`` column (index into the run's full table), gradient records
    dropped and phases renamed as asked. Below a common level of L2 the fused operators'
    internal records (role ``internal``, captured at L2 only) are left out: an L1 run has the
    fused operator's own record instead, and both runs hold that."""
    t = table.append_column("_row", pa.array(np.arange(table.num_rows, dtype=np.int64)))
    if drop_grads and "role" in t.column_names:
        t = t.filter(pc.is_in(t["role"], pa.array(["output", "internal"])))
    if level != "L2" and "role" in t.column_names:
        t = t.filter(pc.not_equal(t["role"], "internal"))
    for old, new in (phase_map or {}).items():
        col = pc.if_else(pc.equal(t["phase"], old), pa.scalar(new), t["phase"])
        t = t.set_column(t.column_names.index("phase"), "phase", col)
    return t


def check_step_bytes(run: Run) -> None:
    """Re-digest (digest v2, ``drifttool.digestcore``) every step record's stored bytes against its digest (the diff compares digests;
    this makes sure they still describe the bytes).

    Raises:
        ArtifactError: a record whose bytes do not match its digest (tampered or corrupt).
    """
    t = run.steps_table().select(["step", "sample", "branch", "quantity", "dtype", "shape",
                                  "digest", "data"])
    for r in t.to_pylist():
        try:
            ok = digest_bytes(r["data"], r["dtype"], r["shape"]) == r["digest"]
        except (ValueError, DriftToolError):
            ok = False  # bytes that do not hold the declared dtype and shape
        if not ok:
            raise ArtifactError(
                f"{run.path}/steps.arrow: the bytes of step {r['step']} sample {r['sample']} "
                f"{r['branch']} {r['quantity']} do not match their digest (tampered or corrupt)")


def _compare_tables(run_a: Run, run_b: Run, level: str,
                    phase_map: dict[str, str] | None = None) -> tuple[TableDiff, TableDiff | None]:
    """Align and compare the step tables, and the op tables when both runs hold them. Program
    positions are computed over all four tables at once, so they compare across them."""
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
        run_a.ops_table().select(_OPS_COLS), phase_map, grads, level), da, db, ops=True),
        S.OPS_KEY)
    ob, *qb = drop_replicas(drop_uncaptured(_prepared(
        run_b.ops_table().select(_OPS_COLS), phase_map, grads, level), da, db, ops=True),
        S.OPS_KEY)
    psa, psb, poa, pob = program_order([sa, sb, oa, ob])
    return (_with_replicas(compare_table(sa, sb, S.STEPS_KEY, (psa, psb)), ra, rb),
            _with_replicas(compare_table(oa, ob, S.OPS_KEY, (poa, pob)), qa, qb))


def _with_replicas(t: TableDiff, ra: list[int], rb: list[int]) -> TableDiff:
    t.replicas, t.conflicts = (ra[0], rb[0]), (ra[1], rb[1])
    return t


def _differing(n: int) -> str:
    return f"{n} differing record" + ("" if n == 1 else "s")


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


def _notes(run_a: Run, run_b: Run, level: str, tables: list[TableDiff]) -> list[str]:
    notes = []
    if level == "L0":
        notes.append("op records not compared: a run holds only step records (L0)")
    if level != "L2":
        notes.append(f"row digests not compared (common capture level {level})")
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


def _set_drift(report: DiffReport, run_a: Run, run_b: Run, tables: list[TableDiff]) -> bool:
    """Fill the first drift and the drift verdict; ``False`` when no common record differs.

    The first differing record in run A's order is the first drift unless its step's input
    ``x_t`` already differs after a matching step: then the first drift is that ``x_t`` record
    (a step boundary, origin kind ``between_steps``). When ``x_t`` of the phase's first step
    differs, the record stays (it shows which replay input differs) with origin kind
    ``inputs`` (``FirstDrift``). "First" is run A's program order (``drifttool.diff.order``),
    which no rank, layout or CFG batching changes."""
    firsts = [(f, kind) for kind, t in zip(("step", "op"), tables) for f in [_first(t)] if f]
    ranks = _first_disagreement(tables[1]) if len(tables) > 1 else None
    if ranks is not None and (not firsts or ranks[0] <= min(f[0] for f, _ in firsts)):
        return _set_ranks_disagree(report, run_a, run_b, tables, ranks)
    if not firsts:
        return False
    (_, i, j), kind = min(firsts, key=lambda x: x[0][0])
    t = tables[0] if kind == "step" else tables[1]
    phase, step = t.a.column("phase")[i].as_py(), int(t.a.column("step")[i].as_py())
    origin_kind, prev = None, None
    boundary = _step_input(tables[0], phase, step)
    if boundary is not None:
        origin_kind, prev = _boundary_origin(report.steps, phase, step)
        if origin_kind == "inputs":  # keep the record where the differing inputs first show
            boundary = None
        else:
            (i, j), kind, t = boundary, "step", tables[0]
    n_before = _unmatched_before(tables, int(t.pos_a[i]), int(t.pos_b[j]))
    i_pos = i
    i, j = int(t.a.column("_row")[i].as_py()), int(t.b.column("_row")[j].as_py())
    if kind == "op":
        full_a, full_b = run_a.ops_table(), run_b.ops_table()
    else:
        full_a = run_a.steps_table().drop_columns(["data"])
        full_b = run_b.steps_table().drop_columns(["data"])
    ra, rb = full_a.slice(i, 1).to_pylist()[0], full_b.slice(j, 1).to_pylist()[0]
    input_note = None
    if origin_kind is None:
        origin_kind = "unknown" if n_before else "record"
        if origin_kind == "record" and report.input_differences:  # it consumed differing inputs
            origin_kind, input_note = "inputs", report.input_differences[0]
    layouts = (run_a.manifest.get("layout"), run_b.manifest.get("layout"))
    if origin_kind in ("record", "inputs") and _unchecked_before(
            tables[1] if len(tables) > 1 else None, int(t.pos_a[i_pos]), layouts):
        origin_kind = "unchecked"
    report.first_drift, note = _first_drift(kind, ra, rb, origin_kind,
                                            run_a.manifest.get("layout"),
                                            run_b.manifest.get("layout"))
    fd = report.first_drift
    if kind == "op" and fd.part_rank_b is None and not fd.disagree_b:
        report.notes += [n for n in (heads_note(layouts[0], ra, "A"), heads_note(layouts[1], rb, "B"))
                         if n]  # Ulysses heads against another layout: the writer is named
    fd.input_note = input_note
    fd.prev_step, fd.unmatched_before = (None if prev is None else prev.step), n_before
    report.notes += [note] if note else []
    report.verdict = Verdict.DRIFT
    report.reason = (f"first drift at {fd.where()}{'; ' if boundary is None else ': '}"
                     f"{fd.origin_words()}; {_differing(sum(t.da.size for t in tables))}; "
                     f"compared at {report.level}: {report.covers}")
    return True


def _set_ranks_disagree(report: DiffReport, run_a: Run, run_b: Run, tables: list[TableDiff],
                        found: tuple[int, int | None, int | None]) -> bool:
    """The first drift is an op record on which a run's ranks disagree (``_first_disagreement``),
    first in program order: a finding of that run alone (also against itself)."""
    pos, ia, ib = found
    ot = tables[1]
    rows_a = None if ia is None else int(ot.a.column("_row")[ia].as_py())
    rows_b = None if ib is None else int(ot.b.column("_row")[ib].as_py())
    ra = None if rows_a is None else run_a.ops_table().slice(rows_a, 1).to_pylist()[0]
    rb = None if rows_b is None else run_b.ops_table().slice(rows_b, 1).to_pylist()[0]
    n_before = _unmatched_before(tables, pos, pos)
    layouts = (run_a.manifest.get("layout"), run_b.manifest.get("layout"))
    origin_kind = "unknown" if n_before else (
        "unchecked" if _unchecked_before(ot, pos, layouts) else "ranks")
    report.first_drift, note = _first_drift("op", ra or rb, rb or ra, origin_kind, *layouts)
    fd = report.first_drift
    fd.unmatched_before = n_before
    report.notes += [note] if note else []
    report.verdict = Verdict.DRIFT
    where = fd.where()
    report.reason = (f"ranks disagree at {where}; {fd.origin_words()}; "
                     f"{_differing(sum(t.da.size for t in tables))} between the runs; "
                     f"compared at {report.level}: {report.covers}")
    return True


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
        lone_a = set(t.a.column("sample").take(t.al.only_a).to_pylist())
        lone_b = set(t.b.column("sample").take(t.al.only_b).to_pylist())
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
              tolerance: Profile | None = None) -> DiffReport:
    """Compare two opened artifacts (``drifttool.artifact.open_run``); see the module docstring.

    With ``align_recompute`` a rollout and its training recompute are aligned phase ``rollout``
    ↔ ``train`` (``recompute_alignment``); a note says so. With a ``tolerance`` profile
    (``drifttool.diff.tolerance``) every differing common record is also judged within or beyond
    it (``DiffReport.tolerance``); the bitwise verdict is unchanged.

    Returns:
        ``DiffReport`` with verdict identical / drift / incomparable / inconclusive.

    Raises:
        ArtifactError: a file is unreadable, or cut short in a run marked complete.
    """
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
    report.context = context(run_a, run_b, report.input_differences)
    report.level = level = min(run_a.capture_level, run_b.capture_level, key=S.LEVELS.index)
    report.covers = LEVEL_COVERS[level]
    phase_map = recompute_alignment(run_a.manifest, run_b.manifest) if align_recompute else None
    st, ot = _compare_tables(run_a, run_b, level, phase_map)
    tables = [st] if ot is None else [st, ot]
    for kind, t in zip(("step", "op"), tables):
        check_matched(run_a, run_b, kind, t)
    report.counts = {"steps": st.counts(), **({"ops": ot.counts()} if ot else {})}
    report.notes = _notes(run_a, run_b, level, tables)
    if phase_map is not None:
        side = "B" if run_b.manifest.get("kind") == "recompute" else "A"
        report.notes.insert(0, f"run {side} is a training recompute: its phase 'train' records are "
                               "aligned with phase 'rollout'; its gradient records are not compared")
    report.steps = step_drifts(st, ot)
    for s in report.steps:
        if not s.identical:
            break
        if s.step >= 0:  # step -1 holds records made before the first step (sigma table)
            report.identical_through = (s.phase, s.step)
    if not _set_drift(report, run_a, run_b, tables):
        _set_no_drift(report, run_a, run_b, tables)
    if tolerance is not None:
        report.tolerance = judge(tolerance, run_a, run_b, st, ot, _where)
        only = sum(c.only_a + c.only_b for c in report.counts.values())
        report.tolerance.block(
            ([f"{only} records are in one run only"] if only else [])
            + (["the replay inputs differ"] if report.input_differences else [])
            + [f"run {s} is incomplete" for s, r in (("A", run_a), ("B", run_b)) if not r.complete])
        report.notes += scope_notes(tolerance, run_a, run_b)
    return report


def _where(kind: str, ra: dict, rb: dict) -> str:
    """A record's place in words (``FirstDrift.where``), for the tolerance verdict."""
    return _first_drift(kind, ra, rb, "unknown")[0].where()


def aligned_tables(run_a: Run, run_b: Run) -> tuple[TableDiff, TableDiff | None]:
    """The step and op tables of two runs aligned as ``diff_runs`` aligns them (common capture
    level, recompute phases mapped), for tools that judge the differing pairs
    (``drifttool.diff.tolerance.measure``)."""
    level = min(run_a.capture_level, run_b.capture_level, key=S.LEVELS.index)
    return _compare_tables(run_a, run_b, level, recompute_alignment(run_a.manifest, run_b.manifest))
