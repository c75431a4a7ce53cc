"""Records one run declares it cannot capture, left out of both runs before alignment.

    >>> declared(manifest)          # a captured diffusers pipeline call
    ({'mu', 'std_t', 'logp_t'}, {('flow_sde_step_logp', 1), ...})
    >>> steps = drop_uncaptured(steps, declared(ma), declared(mb), ops=False)
    >>> note(ma, mb)
    "run B does not capture step mu, std_t, logp_t and op outputs flow_sde_step_logp#1, ...
     (the diffusers pipeline's Euler step ... computes x_next only ...): not compared in either run"

A run's manifest key ``uncaptured`` (``manifest_schema._UNCAPTURED``) names step quantities and op outputs
(op, index) that drifttool's rollout writes but that the run's implementation does not compute
(the diffusers pipeline's Euler step has no mu, std_t or logp). Without the declaration their
records would be "only in run A", and an otherwise identical pair inconclusive. Torch-free.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from drifttool.artifact import compute as ac

Declared = tuple[set[str], set[tuple[str, int]]]


def declared(manifest: dict[str, Any]) -> Declared:
    """(step quantities, (op, index) pairs) the manifest declares uncaptured (empty sets without
    the key)."""
    u = manifest.get("uncaptured") or {}
    return set(u.get("steps", [])), {(o["op"], int(o["index"])) for o in u.get("ops", [])}


def drop_uncaptured(table: pa.Table, a: Declared, b: Declared, *, ops: bool) -> pa.Table:
    """``table`` (step records, or op records with ``ops``) without the records either run
    declares uncaptured."""
    if ops:
        pairs = a[1] | b[1]
        if not pairs or not table.num_rows:
            return table
        keep = ac.call("invert", ac.is_in(ac.call(
            "binary_join_element_wise", table["op"], ac.cast(table["index"], pa.utf8()), "#"),
            sorted(f"{op}#{i}" for op, i in pairs)))
        return ac.filter(table, keep)
    names = a[0] | b[0]
    if not names or not table.num_rows:
        return table
    return ac.filter(table, ac.call("invert", ac.is_in(table["quantity"], sorted(names))))


def note(ma: dict[str, Any], mb: dict[str, Any]) -> list[str]:
    """One line per run that declares uncaptured records."""
    out = []
    for side, m in (("A", ma), ("B", mb)):
        steps, ops = declared(m)
        if not steps and not ops:
            continue
        what = [f"step {', '.join(sorted(steps))}"] if steps else []
        what += [f"op outputs {', '.join(f'{op}#{i}' for op, i in sorted(ops))}"] if ops else []
        out.append(f"run {side} does not capture {' and '.join(what)} "
                   f"({m['uncaptured'].get('reason', 'declared in its manifest')}): not compared "
                   "in either run")
    return out
