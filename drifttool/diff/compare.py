"""``diff_runs``: align two artifacts by identity and find the first drift.

    >>> report = diff_runs(open_run("runs/a"), open_run("runs/b"))
    >>> report.verdict, report.first_drift.where()
    (<Verdict.DRIFT: 'drift'>, 'rollout step 3 cond block 5 img qk_rmsnorm#0 sample 1 (rank 0)')

Order of work (design.md, "Diff"):
1. Incomparable? Schema versions, ``fingerprint["arch"]`` (the architecture's shape fields) and
   the capture levels must allow alignment; otherwise the differing fields are named and nothing
   else is compared.
2. Context: the rest of the fingerprint, the replay inputs, the capture level and the operator
   trace are compared and listed first; they do not stop the diff.
3. Step records (every level) and op records (when both runs are L1 or finer) are aligned by
   identity (``drifttool.diff.align``) and compared by digest.
4. First drift = the differing record with the smallest ``seq`` in run A (ops and steps share one
   counter per rank); it is the origin when no record before it is missing in either run. With
   row digests on both sides (L2) its differing rows are named (text position or patch (i, j)).
5. Per step: first differing op, whether ``x_t`` already differed (carried in), value drift of
   the step quantities and the SDE-transition KL (``drifttool.diff.values``).
Verdict: drift if any common record differs; else inconclusive if records are missing or a run
is incomplete ("identical through step k"); else identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from drifttool.artifact import schema as S
from drifttool.artifact.reader import Run
from drifttool.capture.digest import digest
from drifttool.capture.layout import row_id
from drifttool.diff.align import Alignment, align, encode_keys
from drifttool.diff.report import (
    Counts, DiffReport, FirstDrift, OpRef, QuantityDrift, RowDrift, RowRef, StepDrift,
    TransitionKL, Verdict,
)
from drifttool.diff.values import compare_values, transition_kl, values

FIRST_ROWS = 8  # differing rows named in the report
MAX_LISTED = 20  # context lines per kind (fingerprint, inputs, trace)

_OPS_COLS = [*S.OPS_KEY, "seq", "sigma", "digest"]
_STEP_COLS = [*S.STEPS_KEY, "seq", "sigma", "sigma_next", "dtype", "shape", "digest"]


# -- 1, 2: what can be compared --------------------------------------------------------------------
def _flatten(d: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}"))
    return out


def _short(v: Any) -> str:
    s = "<missing>" if v is _MISSING else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


_MISSING = object()


def dict_differences(a: Any, b: Any, prefix: str) -> list[str]:
    """``"key: a != b"`` for every differing leaf of two nested dicts (dotted keys)."""
    fa, fb = _flatten(a, prefix), _flatten(b, prefix)
    out = []
    for k in sorted(set(fa) | set(fb)):
        va, vb = fa.get(k, _MISSING), fb.get(k, _MISSING)
        if va is _MISSING or vb is _MISSING or va != vb:
            out.append(f"{k}: {_short(va)} != {_short(vb)}")
    return out


def _incomparable(ma: dict, mb: dict) -> list[str]:
    out = []
    if ma["schema_version"] != mb["schema_version"]:
        out.append(f"schema_version: {ma['schema_version']} != {mb['schema_version']}")
    fa, fb = ma.get("fingerprint") or {}, mb.get("fingerprint") or {}
    out += dict_differences(fa.get("arch", {}), fb.get("arch", {}), "fingerprint.arch")
    for side, m in (("A", ma), ("B", mb)):
        if m.get("capture_level") not in S.LEVELS:
            out.append(f"capture_level of run {side}: {m.get('capture_level')!r} is not one of "
                       f"{S.LEVELS}")
    return out


def _context(run_a: Run, run_b: Run) -> list[str]:
    ma, mb = run_a.manifest, run_b.manifest
    fa, fb = ma.get("fingerprint") or {}, mb.get("fingerprint") or {}
    out = dict_differences({k: v for k, v in fa.items() if k != "arch"},
                           {k: v for k, v in fb.items() if k != "arch"}, "fingerprint")
    if ma["capture_level"] != mb["capture_level"]:
        out.append(f"capture_level: {ma['capture_level']} != {mb['capture_level']}")
    ia, ib = run_a.inputs(), run_b.inputs()
    inputs = [f"inputs.{k}: only in run {'A' if k in ia else 'B'}" for k in sorted(set(ia) ^ set(ib))]
    inputs += [f"inputs.{k}: differs (dtype, shape or bytes)" for k in sorted(set(ia) & set(ib))
               if digest(ia[k]) != digest(ib[k])]
    trace = dict_differences(_trace_map(run_a), _trace_map(run_b), "trace")
    return out[:MAX_LISTED] + inputs[:MAX_LISTED] + trace[:MAX_LISTED]


def _trace_map(run: Run) -> dict[str, Any]:
    keep = ("contract", "requested", "actual", "kernel", "fallback")
    return {f"b{r['block']} {r['stream']} {r['op']}#{r['call']}": {k: r[k] for k in keep}
            for r in run.trace_rows()}


# -- 3: align and compare one table --------------------------------------------------------------
@dataclass
class _Table:
    """One table of both runs, aligned; ``da``/``db`` index the differing matched records."""

    a: pa.Table
    b: pa.Table
    al: Alignment
    seq_a: np.ndarray
    seq_b: np.ndarray
    da: np.ndarray
    db: np.ndarray

    def counts(self) -> Counts:
        return Counts(a=self.a.num_rows, b=self.b.num_rows, matched=self.al.ia.size,
                      differ=self.da.size, only_a=self.al.only_a.size, only_b=self.al.only_b.size)


def _compare_table(a: pa.Table, b: pa.Table, key: tuple[str, ...]) -> _Table:
    al = align(a, b, key)
    dig_a = a.column("digest").to_numpy()
    dig_b = b.column("digest").to_numpy()
    ne = dig_a[al.ia] != dig_b[al.ib]
    return _Table(a, b, al, a.column("seq").to_numpy(), b.column("seq").to_numpy(),
                  al.ia[ne], al.ib[ne])


def _first(t: _Table) -> tuple[int, int, int, int] | None:
    """``(seq_a, rank, ia, ib)`` of the differing record first in run A's order."""
    if t.da.size == 0:
        return None
    rank = t.a.column("rank").to_numpy()[t.da]
    k = np.lexsort((rank, t.seq_a[t.da]))[0]
    return int(t.seq_a[t.da[k]]), int(rank[k]), int(t.da[k]), int(t.db[k])


# -- 4: the first drift ----------------------------------------------------------------------------
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


def _first_drift(kind: str, ra: dict, rb: dict, origin: bool) -> tuple[FirstDrift, str]:
    op = kind == "op"
    rows, note = _row_drift(ra, rb) if op else (None, "")
    fd = FirstDrift(
        kind=kind, seq_a=ra["seq"], seq_b=rb["seq"], rank=ra["rank"], phase=ra["phase"],
        step=ra["step"], sigma=ra["sigma"], branch=ra["branch"],
        block=ra["block"] if op else None, stream=ra["stream"] if op else None,
        op=ra["op"] if op else ra["quantity"], call=ra["call"] if op else None,
        index=ra["index"] if op else None, role=ra["role"] if op else None, sample=ra["sample"],
        dtype=(ra["dtype"], rb["dtype"]), shape=(ra["shape"], rb["shape"]),
        digest=(f"{ra['digest']:016x}", f"{rb['digest']:016x}"),
        nonfinite=(ra["nonfinite"], rb["nonfinite"]), maxabs=(ra["maxabs"], rb["maxabs"]),
        origin=origin, rows=rows,
    )
    return fd, note


def _is_origin(tables: list[_Table], seq_a: int, seq_b: int) -> tuple[bool, int]:
    """Whether no unmatched record precedes the first drift in either run; how many do."""
    n = sum(int(np.count_nonzero(t.seq_a[t.al.only_a] < seq_a))
            + int(np.count_nonzero(t.seq_b[t.al.only_b] < seq_b)) for t in tables)
    return n == 0, n


# -- 5: per step -----------------------------------------------------------------------------------
def _by_step(table: pa.Table, rows: np.ndarray | None, seq: np.ndarray) -> dict[tuple[str, int], tuple]:
    """``{(phase, step): (count, row of smallest seq)}`` over ``rows`` of ``table`` (None: all)."""
    sub = table.select(["phase", "step"])
    if rows is None:
        rows = np.arange(table.num_rows)
    else:
        sub = sub.take(pa.array(rows))
    if rows.size == 0:
        return {}
    g, _ = encode_keys(sub, sub.slice(0, 0), ("phase", "step"))
    order = np.lexsort((seq[rows], g))
    _, first, counts = np.unique(g[order], return_index=True, return_counts=True)
    firsts = rows[order][first]
    ph = table.column("phase").take(pa.array(firsts)).to_pylist()
    st = table.column("step").to_numpy()[firsts]
    return {(p, int(s)): (int(c), int(r)) for p, s, c, r in zip(ph, st, counts, firsts)}


@dataclass
class _StepPair:
    """One step record in both runs (``rb``/``ib`` None: only in A; ``ra``/``ia`` None: only B)."""

    q: QuantityDrift
    ra: dict | None
    rb: dict | None
    ia: int | None
    ib: int | None
    st: "_Table"

    def values(self) -> tuple[np.ndarray, np.ndarray]:
        """Both runs' values in fp64, decoded from the stored bytes."""
        def load(meta: dict, col: pa.ChunkedArray, i: int) -> np.ndarray:
            return values(meta["dtype"], meta["shape"], col[i].as_py())

        return (load(self.ra, self.st.a.column("data"), self.ia),
                load(self.rb, self.st.b.column("data"), self.ib))


def _step_pairs(st: _Table) -> dict[tuple[str, int], list[_StepPair]]:
    """Every step record of both runs with its ``QuantityDrift``, grouped by (phase, step)."""
    meta_a = st.a.drop_columns(["data"]).to_pylist()
    meta_b = st.b.drop_columns(["data"]).to_pylist()
    out: dict[tuple[str, int], list[_StepPair]] = {}
    for i, j in sorted(zip(st.al.ia.tolist(), st.al.ib.tolist()), key=lambda p: st.seq_a[p[0]]):
        ra, rb = meta_a[i], meta_b[j]
        q = QuantityDrift(quantity=ra["quantity"], branch=ra["branch"], sample=ra["sample"],
                          identical=ra["digest"] == rb["digest"], max_abs=0.0, rel_l2=0.0)
        pair = _StepPair(q, ra, rb, i, j, st)
        if not q.identical:
            vals = compare_values(*pair.values())
            q.max_abs, q.rel_l2 = vals["max_abs"], vals["rel_l2"]
            q.nonfinite_mismatch, q.note = vals["nonfinite_mismatch"], vals["note"]
            if ra["dtype"] != rb["dtype"]:
                q.note = f"dtype {ra['dtype']} vs {rb['dtype']}; {q.note}".rstrip("; ")
        out.setdefault((ra["phase"], ra["step"]), []).append(pair)
    for side, idx, meta in (("A", st.al.only_a, meta_a), ("B", st.al.only_b, meta_b)):
        for i in idx.tolist():
            r = meta[i]
            q = QuantityDrift(quantity=r["quantity"], branch=r["branch"], sample=r["sample"],
                              identical=None, note=f"only in run {side}")
            ra, rb = (r, None) if side == "A" else (None, r)
            out.setdefault((r["phase"], r["step"]), []).append(_StepPair(q, ra, rb, None, None, st))
    return out


def _kl(pairs: list[_StepPair]) -> list[TransitionKL]:
    """Transition KL per (sample, branch) that has ``mu`` in both runs."""
    both = [p for p in pairs if p.ra is not None and p.rb is not None]
    std = {(p.ra["rank"], p.q.sample, p.q.branch): p for p in both if p.q.quantity == "std_t"}
    out = []
    for p in both:
        if p.q.quantity != "mu":
            continue
        s = std.get((p.ra["rank"], p.q.sample, p.q.branch))
        kl = scale = None
        if s is not None:
            mu_a, mu_b = p.values()
            kl, scale = transition_kl(mu_a, mu_b, std_t=s.values()[0], sigma=p.ra["sigma"],
                                      sigma_next=p.ra["sigma_next"])
        out.append(TransitionKL(sample=p.q.sample, branch=p.q.branch, kl=kl, noise_scale=scale))
    return out


def _steps(st: _Table, ot: _Table | None) -> list[StepDrift]:
    pairs = _step_pairs(st)
    tables = [st, *([ot] if ot else [])]
    first_op = _by_step(ot.a, ot.da, ot.seq_a) if ot else {}
    missing: dict[tuple[str, int], int] = {}
    for t in tables:
        for table, rows, seq in ((t.a, t.al.only_a, t.seq_a), (t.b, t.al.only_b, t.seq_b)):
            for k, (n, _) in _by_step(table, rows, seq).items():
                missing[k] = missing.get(k, 0) + n
    # order: run A's execution order (first seq of the step), then steps only run B has
    order: dict[tuple[str, int], tuple[int, int]] = {}
    sigma_of: dict[tuple[str, int], float] = {}
    for t in tables:
        for side, table, seq in ((0, t.a, t.seq_a), (1, t.b, t.seq_b)):
            for k, (_, r) in _by_step(table, None, seq).items():
                order[k] = min(order.get(k, (2, 0)), (side, int(seq[r])))
                sigma_of.setdefault(k, table.column("sigma")[r].as_py())
    out = []
    for k in sorted(order, key=order.get):
        ps = pairs.get(k, [])
        meta = next((p.ra or p.rb for p in ps), None)
        sigma = meta["sigma"] if meta else sigma_of[k]
        sigma_next = meta["sigma_next"] if meta else float("nan")
        x_t = [p.q.identical for p in ps if p.q.quantity == "x_t" and p.q.identical is not None]
        n_ops, first_row = first_op.get(k, (0, None))
        ref = None
        if first_row is not None:
            r = ot.a.slice(first_row, 1).to_pylist()[0]
            ref = OpRef(seq=r["seq"], branch=r["branch"], block=r["block"], stream=r["stream"],
                        op=r["op"], call=r["call"], sample=r["sample"])
        qs = [p.q for p in ps]
        identical = not n_ops and not missing.get(k) and all(q.identical for q in qs)
        out.append(StepDrift(
            phase=k[0], step=k[1], sigma=sigma, sigma_next=sigma_next, identical=identical,
            carried_in=(not all(x_t)) if x_t else None, first_op=ref, ops_differ=n_ops,
            missing=missing.get(k, 0), quantities=qs, kl=_kl(ps),
        ))
    return out


# -- the diff --------------------------------------------------------------------------------------
def diff_runs(run_a: Run, run_b: Run) -> DiffReport:
    """Compare two opened artifacts (``drifttool.artifact.open_run``).

    Returns:
        ``DiffReport`` with verdict identical / drift / incomparable / inconclusive.

    Raises:
        ArtifactError: a file is unreadable, or cut short in a run marked complete.
    """
    report = DiffReport(verdict=Verdict.IDENTICAL, reason="", run_a=str(run_a.path),
                        run_b=str(run_b.path))
    report.incomparable = _incomparable(run_a.manifest, run_b.manifest)
    if report.incomparable:
        report.verdict = Verdict.INCOMPARABLE
        report.reason = "cannot align: " + "; ".join(report.incomparable[:3])
        return report
    report.context = _context(run_a, run_b)
    level = min(run_a.capture_level, run_b.capture_level, key=S.LEVELS.index)
    report.level = level

    st = _compare_table(run_a.steps_table().select([*_STEP_COLS, "data"]),
                        run_b.steps_table().select([*_STEP_COLS, "data"]), S.STEPS_KEY)
    tables = [st]
    ot = None
    if level != "L0":
        ot = _compare_table(run_a.ops_table().select(_OPS_COLS),
                            run_b.ops_table().select(_OPS_COLS), S.OPS_KEY)
        tables.append(ot)
        report.counts["ops"] = ot.counts()
    else:
        report.notes.append("op records not compared: a run holds only step records (L0)")
    report.counts["steps"] = st.counts()
    if level != "L2":
        report.notes.append(f"row digests not compared (common capture level {level})")
    for side, run in (("A", run_a), ("B", run_b)):
        report.notes += [f"run {side}: {p}" for p in run.problems]
        if not run.complete:
            report.notes.append(f"run {side} is incomplete (manifest complete=false)")
    dups = sum(t.al.duplicates for t in tables)
    if dups:
        report.notes.append(f"{dups} records repeat an identity; paired by occurrence order")

    report.steps = _steps(st, ot)
    report.identical_through = None
    for s in report.steps:
        if not s.identical:
            break
        report.identical_through = (s.phase, s.step)

    firsts = [(f, kind, t) for kind, t in (("step", st), ("op", ot)) if t is not None
              for f in [_first(t)] if f is not None]
    if firsts:
        (seq, _, i, j), kind, t = min(firsts, key=lambda x: (x[0][0], x[0][1]))
        full_a = run_a.ops_table() if kind == "op" else run_a.steps_table().drop_columns(["data"])
        full_b = run_b.ops_table() if kind == "op" else run_b.steps_table().drop_columns(["data"])
        ra, rb = full_a.slice(i, 1).to_pylist()[0], full_b.slice(j, 1).to_pylist()[0]
        origin, n_before = _is_origin(tables, ra["seq"], rb["seq"])
        report.first_drift, note = _first_drift(kind, ra, rb, origin)
        if note:
            report.notes.append(note)
        report.verdict = Verdict.DRIFT
        n_differ = sum(t.da.size for t in tables)
        report.reason = (f"first drift at {report.first_drift.where()}; "
                         + ("origin (every earlier record matches)" if origin else
                            f"{n_before} unmatched records precede it: origin may be earlier")
                         + f"; {n_differ} differing records")
        return report

    matched = sum(t.al.ia.size for t in tables)
    missing = sum(t.al.only_a.size + t.al.only_b.size for t in tables)
    if missing or not (run_a.complete and run_b.complete):
        report.verdict = Verdict.INCONCLUSIVE
        why = [f"run {s} is incomplete" for s, r in (("A", run_a), ("B", run_b)) if not r.complete]
        if missing:
            why.append(f"{sum(t.al.only_a.size for t in tables)} records only in run A, "
                       f"{sum(t.al.only_b.size for t in tables)} only in run B")
        through = ("identical through {} step {}".format(*report.identical_through)
                   if report.identical_through else "no step fully matched")
        report.reason = f"no drift in {matched} common records, but {', '.join(why)}; {through}"
        return report
    report.reason = f"all {matched} records are bitwise identical"
    return report
