"""Per-step drift: first differing op, carried-in input, value drift and transition KL per step.

    >>> steps = step_drifts(st, ot)      # st, ot: drifttool.diff.align.compare_table results
    >>> [(s.step, s.carried_in, str(s.first_op), s.worst("v_t").max_abs) for s in steps]
    [(0, False, 'None', 0.0), (1, False, 'cond b1 joint joint_attn#0 s1', 0.001), (2, True, ...)]

A step's ``x_t`` differing means the drift was carried in from an earlier step; the step's first
differing op (run A's program order, ``drifttool.diff.order``) is where the step itself first shows it. Quantities are compared from
the bytes stored in ``steps.arrow`` (``drifttool.diff.values``). Source: design.md, "Diff".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from drifttool.artifact import compute as ac
from drifttool.diff.align import TableDiff, encode_keys
from drifttool.diff.arrays import arrow_array
from drifttool.diff.report import OpRef, QuantityDrift, StepDrift, TransitionKL
from drifttool.diff.values import compare_values, transition_kl, values


def by_step(table: pa.Table, rows: np.ndarray | None,
            pos: np.ndarray) -> dict[tuple[str, int], tuple[int, int]]:
    """``{(phase, step): (count, row first in program order)}`` over ``rows`` of ``table``
    (None: all); ``pos`` is the program position of every row of ``table``."""
    sub = table.select(["phase", "step"])
    if rows is None:
        rows = np.arange(table.num_rows)
    else:
        sub = ac.take(sub, arrow_array(rows))
    if rows.size == 0:
        return {}
    g, _ = encode_keys(sub, sub.slice(0, 0), ("phase", "step"))
    order = np.lexsort((rows, pos[rows], g))
    _, first, counts = np.unique(g[order], return_index=True, return_counts=True)
    firsts = rows[order][first]
    ph = ac.take(table.column("phase"), arrow_array(firsts)).to_pylist()
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
    st: TableDiff

    def values(self) -> tuple[np.ndarray, np.ndarray]:
        """Both runs' values in fp64, decoded from the stored bytes."""
        def load(meta: dict, col: pa.ChunkedArray, i: int) -> np.ndarray:
            return values(meta["dtype"], meta["shape"], col[i].as_py())

        return (load(self.ra, self.st.a.column("data"), self.ia),
                load(self.rb, self.st.b.column("data"), self.ib))


def _step_pairs(st: TableDiff) -> dict[tuple[str, int], list[_StepPair]]:
    """Every step record of both runs with its ``QuantityDrift``, grouped by (phase, step)."""
    meta_a = st.a.drop_columns(["data"]).to_pylist()
    meta_b = st.b.drop_columns(["data"]).to_pylist()
    out: dict[tuple[str, int], list[_StepPair]] = {}
    for i, j in sorted(zip(st.al.ia.tolist(), st.al.ib.tolist()), key=lambda p: (st.pos_a[p[0]], p[0])):
        ra, rb = meta_a[i], meta_b[j]
        q = QuantityDrift(quantity=ra["quantity"], branch=ra["branch"], sample=ra["sample"],
                          identical=ra["digest"] == rb["digest"], max_abs=0.0, rel_l2=0.0)
        pair = _StepPair(q, ra, rb, i, j, st)
        if not q.identical:
            vals = compare_values(*pair.values())
            q.max_abs, q.rel_l2 = vals["max_abs"], vals["rel_l2"]
            q.nonfinite_mismatch, q.note = vals["nonfinite_mismatch"], vals["note"]
            if ra["dtype"] != rb["dtype"]:
                q.note = f"dtype {ra['dtype']} (A) vs {rb['dtype']} (B); {q.note}".rstrip("; ")
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
    std = {(p.ra["component"], p.q.sample, p.q.branch): p for p in both
           if p.q.quantity == "std_t"}
    out = []
    for p in both:
        if p.q.quantity != "mu":
            continue
        s = std.get((p.ra["component"], p.q.sample, p.q.branch))
        kl = scale = None
        if s is not None:
            mu_a, mu_b = p.values()
            kl, scale = transition_kl(mu_a, mu_b, std_t=s.values()[0], sigma=p.ra["sigma"],
                                      sigma_next=p.ra["sigma_next"])
        out.append(TransitionKL(sample=p.q.sample, branch=p.q.branch, kl=kl, noise_scale=scale))
    return out


def step_drifts(st: TableDiff, ot: TableDiff | None) -> list[StepDrift]:
    """One ``StepDrift`` per (phase, step) of either run, in program order (the first record of
    the step in either run: positions compare across runs, ``drifttool.diff.order``).

    Args:
        st: the compared step tables (with ``data``, ``dtype``, ``shape``, ``sigma_next``).
        ot: the compared op tables, or ``None`` when ops were not compared (L0).
    """
    pairs = _step_pairs(st)
    tables = [st, *([ot] if ot else [])]
    first_op = by_step(ot.a, ot.da, ot.pos_a) if ot else {}
    missing: dict[tuple[str, int], int] = {}
    for t in tables:
        for table, rows, pos in ((t.a, t.al.only_a, t.pos_a), (t.b, t.al.only_b, t.pos_b)):
            for k, (n, _) in by_step(table, rows, pos).items():
                missing[k] = missing.get(k, 0) + n
    # order: the program position of the step's first record in either run (comparable)
    order: dict[tuple[str, int], int] = {}
    sigma_of: dict[tuple[str, int], float] = {}
    for t in tables:
        for table, pos in ((t.a, t.pos_a), (t.b, t.pos_b)):
            for k, (_, r) in by_step(table, None, pos).items():
                order[k] = min(order.get(k, int(pos[r])), int(pos[r]))
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
            ref = OpRef(rank=r["rank"], op_pos=r["op_pos"], branch=r["branch"],
                        block=r["block"], stream=r["stream"], op=r["op"], call=r["call"],
                        sample=r["sample"], component=r["component"])
        qs = [p.q for p in ps]
        identical = not n_ops and not missing.get(k) and all(q.identical for q in qs)
        out.append(StepDrift(
            phase=k[0], step=k[1], sigma=sigma, sigma_next=sigma_next, identical=identical,
            carried_in=(not all(x_t)) if x_t else None, first_op=ref, ops_differ=n_ops,
            missing=missing.get(k, 0), quantities=qs, kl=_kl(ps),
        ))
    return out
