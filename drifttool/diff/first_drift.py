"""The first drift of two aligned runs: the differing record first in program order, where it
was born, and which rank computed it.

    >>> set_drift(report, run_a, run_b, [step_table, op_table])   # fills report.first_drift
    True
    >>> report.first_drift.where(), report.first_drift.origin_kind
    ('rollout step 3 cond block 5 img qk_rmsnorm#0 sample 1 (owning rank 0)', 'record')

"First" is run A's program order (``drifttool.diff.order``), which no rank, layout or CFG
batching changes. The first differing record is the first drift unless its step's input ``x_t``
already differs: then it is that ``x_t`` record, a step boundary (origin ``between_steps`` when
the previous step matched; for the phase's first step the record stays, origin ``inputs``). An
op record on which a run's ranks disagree, earlier in program order, comes first (origin
``ranks``). A record is an origin only if the inputs it consumed match and no record before it
is missing in either run (``FirstDrift.origin_kind``); an early stage of a chain or edit run
consumes its prompts and condition images, not the replay inputs it makes
(``drifttool.diff.stages``). With row digests on both sides (L2) its
differing rows are named (text position or patch (i, j)); in a run laid out with SP > 1 the rank
that computed the first of them (``drifttool.diff.owners``), and with per-rank digest partials
in the same layout the first rank whose part differs.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from drifttool.artifact import compute as ac
from drifttool.artifact.reader import Run
from drifttool.artifact.schema import model_blocks
from drifttool.capture.layout import row_id
from drifttool.diff.align import TableDiff
from drifttool.diff.location import FirstDrift, RowDrift, RowRef
from drifttool.diff.owners import heads_note, row_owner
from drifttool.diff.report import DiffReport, StepDrift, Verdict
from drifttool.diff.stages import is_early_stage, stage_sources

FIRST_ROWS = 8  # differing rows named in the report


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
    first = [RowRef.of(int(r), row_id(int(r), ra["txt_len"] or 0, w, ra["img_h"])) for r in diff[:FIRST_ROWS]]
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
                 layout_b: dict | None = None, *, blocks: int | None = None) -> tuple[FirstDrift, str]:
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
        blocks=blocks if op else None,
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
    lens = ac.call("list_value_length", col)
    n = ac.call("coalesce", lens, pa.scalar(0, lens.type)).to_numpy()
    outputs = ac.is_in(table.column("role"), ["output", "internal"]).to_numpy(zero_copy_only=False)
    unchecked = ac.is_null(col).to_numpy(zero_copy_only=False) & outputs
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


def _consumed(report: DiffReport, run_a: Run, run_b: Run, ra: dict) -> list[str]:
    """The differing inputs a first-drift record ``ra`` consumed: for a record of an early stage
    (the text encoder, an edit run's VAE encode) what the stage reads — prompts, condition images
    (``drifttool.diff.stages.stage_sources``), never the replay inputs, which those stages make;
    for any other record, or where a run records no such sources, every differing replay input."""
    sources = stage_sources(run_a.manifest, run_b.manifest)
    if sources is not None and is_early_stage(ra["component"], int(ra["step"])):
        return sources
    return report.input_differences


def _differing(n: int) -> str:
    return f"{n} differing record" + ("" if n == 1 else "s")


def set_drift(report: DiffReport, run_a: Run, run_b: Run, tables: list[TableDiff]) -> bool:
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
        consumed = _consumed(report, run_a, run_b, ra)
        if origin_kind == "record" and consumed:  # it consumed differing inputs
            origin_kind, input_note = "inputs", "; ".join(consumed)
    layouts = (run_a.manifest.get("layout"), run_b.manifest.get("layout"))
    if origin_kind in ("record", "inputs") and _unchecked_before(
            tables[1] if len(tables) > 1 else None, int(t.pos_a[i_pos]), layouts):
        origin_kind = "unchecked"
    report.first_drift, note = _first_drift(kind, ra, rb, origin_kind,
                                            run_a.manifest.get("layout"),
                                            run_b.manifest.get("layout"),
                                            blocks=model_blocks(run_a.manifest, ra["component"]))
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
    report.first_drift, note = _first_drift("op", ra or rb, rb or ra, origin_kind, *layouts,
                                            blocks=model_blocks(run_a.manifest, (ra or rb)["component"]))
    fd = report.first_drift
    fd.unmatched_before = n_before
    report.notes += [note] if note else []
    report.verdict = Verdict.DRIFT
    where = fd.where()
    report.reason = (f"ranks disagree at {where}; {fd.origin_words()}; "
                     f"{_differing(sum(t.da.size for t in tables))} between the runs; "
                     f"compared at {report.level}: {report.covers}")
    return True


def record_where(kind: str, ra: dict, rb: dict, manifest: dict | None = None) -> str:
    """A record's place in words (``FirstDrift.where``), for the tolerance verdict; ``manifest``
    (run A's) names the blocks of its component (``schema.model_blocks``)."""
    return _first_drift(kind, ra, rb, "unknown", blocks=model_blocks(manifest, ra.get("component")))[0].where()
