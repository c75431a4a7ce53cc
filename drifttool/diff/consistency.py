"""Matched records whose digests agree must agree on everything derived from the same bytes.

    >>> check_matched(run_a, run_b, "op", table_diff)   # raises ArtifactError on a mismatch

A record's ``digest`` is digest v2 of its dtype, shape and bytes (``drifttool.capture.digest``),
so two records with equal digests hold the same tensor; then ``dtype``, ``shape``,
``nonfinite``, ``maxabs`` (an exact max, unlike the fp64-accumulated ``l2``) and the L2 row
digests, which are functions of those bytes, must be equal too. A pair that differs there while
its digests agree is damage in one run (or a hash collision), never a match: the diff refuses it
instead of counting the pair as identical ("never identical unless every record was
compared"). ``sigma`` and the row map are not functions of the bytes (a sigma-table probe changes
them legitimately) and are not checked here.
"""

from __future__ import annotations

from drifttool.artifact import compute as ac
from drifttool.artifact.reader import Run
from drifttool.artifact.schema import block_words, model_blocks
from drifttool.diff.align import TableDiff
from drifttool.diff.arrays import arrow_array
from drifttool.errors import ArtifactError

DERIVED = ("dtype", "shape", "nonfinite", "maxabs", "row_digests")
"""Columns that equal digests pin (``row_digests`` only where both records have them)."""


def _same(x: object, y: object) -> bool:
    if x is None or y is None:  # row digests: only at L2
        return True
    if isinstance(x, float) and isinstance(y, float) and x != x and y != y:
        return True  # both NaN
    return x == y


def check_matched(run_a: Run, run_b: Run, kind: str, t: TableDiff) -> None:
    """Refuse matched pairs with equal digests that differ in a ``DERIVED`` column.

    Args:
        kind: ``"op"`` or ``"step"``; ``t``'s tables carry ``_row`` (row in the run's full table).

    Raises:
        ArtifactError: naming the first such record and column.
    """
    same = t.a.column("digest").to_numpy()[t.al.ia] == t.b.column("digest").to_numpy()[t.al.ib]
    ia, ib = t.al.ia[same], t.al.ib[same]
    if ia.size == 0:
        return
    full_a = run_a.ops_table() if kind == "op" else run_a.steps_table()
    full_b = run_b.ops_table() if kind == "op" else run_b.steps_table()
    cols = [c for c in DERIVED if c in full_a.column_names]
    ra = t.a.column("_row").to_numpy()[ia]
    rb = t.b.column("_row").to_numpy()[ib]
    sel_a = ac.take(full_a.select(cols), arrow_array(ra))
    sel_b = ac.take(full_b.select(cols), arrow_array(rb))
    for c in cols:
        ca, cb = sel_a.column(c), sel_b.column(c)
        if ca.equals(cb):
            continue
        for k, (x, y) in enumerate(zip(ca.to_pylist(), cb.to_pylist())):
            if not _same(x, y):
                rec = full_a.slice(int(ra[k]), 1).to_pylist()[0]
                where = (f"step {rec['step']} {rec['branch']} "
                         + (f"{block_words(rec['block'], model_blocks(run_a.manifest, rec['component']))} "
                            f"{rec['stream']} {rec['op']}#{rec['call']}"
                            if kind == "op" else rec["quantity"])
                         + f" sample {rec['sample']}")
                raise ArtifactError(
                    f"{kind} record {where}: equal digests but {c} {x!r} != {y!r} "
                    f"({run_a.path} vs {run_b.path}): one of the runs is damaged")
