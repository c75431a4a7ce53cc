"""Program order of records: the rank-independent position that decides "first" in a diff.

    >>> pos = program_order([steps_a, steps_b, ops_a, ops_b])   # one int64 array per table
    >>> pos[2][i] < pos[0][j]    # op record i of run A comes before step record j of run A

The order is a function of a record's program position only (``schema.OP_ORDER``,
``schema.STEP_ORDER``), never of ``rank`` or ``seq``: the same records written by one process or
by several ranks (samples split across ranks, batched or sequential CFG) get the same order.
Within one (phase, step, component) the operator outputs come first — in the text encoder, the
vision tower's (stream ``img``: the prompt image's preprocessing and the tower, which run before
the language model) before the language model's (stream ``txt``), since both number their blocks
from −1 — (block in execution order:
−1, 0..depth−1, depth, then the sampler ``SAMPLER_BLOCK``; ``op_pos``; output index; CFG branch;
logical sample), then the step records (quantity, sample, branch: ``x_t`` is recorded with the
step's outputs, after the model ran), then the gradients (``grad_input``, ``grad_weight``: the
backward consumes ``logp_t``). Strings order by the schema's lists (``PHASES``, ``COMPONENTS``,
``BRANCHES``, ``ROLES``, ``QUANTITIES``), unknown values after them by name.

Positions are dense ranks over all the tables given together, so they compare across tables
(ops against steps) and across runs (run A against run B). Source: design.md, "Diff";
review 2026-12 §3(b) "A rank-independent order key".
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from drifttool.artifact import compute as ac
from drifttool.artifact import schema as S

_SAMPLER_LAST = np.int64(1) << 40  # SAMPLER_BLOCK after every model block
_WIDTH = 13  # key columns per record (op and step records share the layout)
_ROLE_GROUP = {"output": 0, "internal": 0, "grad_input": 2, "grad_weight": 3}
"""Position of a role among the records of one (phase, step, component): operator outputs and a
fused operator's internals together (by ``op_pos``), step records 1, then the gradients."""
_KNOWN = {"phase": S.PHASES, "component": S.COMPONENTS, "branch": S.BRANCHES, "role": S.ROLES,
          "quantity": S.QUANTITIES, "stream": (), "op": ()}


def _ordinals(tables: Sequence[pa.Table], name: str) -> dict[str, int]:
    """Ordinal of every value of string column ``name`` over ``tables``: the schema's list
    first, in its order, then the other values by name."""
    known = _KNOWN[name]
    values: set[str] = set()
    for t in tables:
        if name in t.column_names:
            values.update(ac.unique(t.column(name)).to_pylist())
    ranked = sorted(values, key=lambda v: (known.index(v) if v in known else len(known), v))
    return {v: i for i, v in enumerate(ranked)}


def _strings(t: pa.Table, name: str, ords: dict[str, dict[str, int]]) -> np.ndarray:
    enc = ac.dictionary_encode(t.column(name).combine_chunks())
    lookup = np.array([ords[name][v] for v in enc.dictionary.to_pylist()], dtype=np.int64)
    return lookup[enc.indices.to_numpy(zero_copy_only=False)]


def _ints(t: pa.Table, name: str) -> np.ndarray:
    return t.column(name).to_numpy().astype(np.int64)


def _is(t: pa.Table, name: str, value: str) -> np.ndarray:
    enc = ac.dictionary_encode(t.column(name).combine_chunks())
    hit = np.array([v == value for v in enc.dictionary.to_pylist()], dtype=bool)
    return hit[enc.indices.to_numpy(zero_copy_only=False)] if len(hit) else np.zeros(t.num_rows, bool)


def _sub_program(t: pa.Table) -> np.ndarray:
    """0 for the text encoder's vision-tower records (component ``text_encoder``, stream ``img``),
    1 for every other record (module docstring)."""
    if "stream" not in t.column_names:
        return np.ones(t.num_rows, np.int64)
    return np.where(_is(t, "component", "text_encoder") & _is(t, "stream", "img"), 0, 1).astype(np.int64)


def _keys(t: pa.Table, ords: dict[str, dict[str, int]]) -> np.ndarray:
    """``[rows, _WIDTH]`` int64 sort key of one table (op records when it has ``op_pos``)."""
    n = t.num_rows
    k = np.zeros((n, _WIDTH), np.int64)
    if n == 0:
        return k
    k[:, 0] = _strings(t, "phase", ords)
    k[:, 1] = _ints(t, "step")
    k[:, 2] = _strings(t, "component", ords)
    if "op_pos" in t.column_names:
        role = ac.dictionary_encode(t.column("role").combine_chunks())
        group = np.array([_ROLE_GROUP.get(v, len(S.ROLES)) for v in role.dictionary.to_pylist()],
                         dtype=np.int64)
        k[:, 3] = group[role.indices.to_numpy(zero_copy_only=False)]
        k[:, 4] = _sub_program(t)
        block = _ints(t, "block")
        k[:, 5] = np.where(block == S.SAMPLER_BLOCK, _SAMPLER_LAST, block)
        k[:, 6] = _ints(t, "op_pos")
        k[:, 7] = _ints(t, "index")
        k[:, 8] = _strings(t, "branch", ords)
        k[:, 9] = _ints(t, "sample")
        k[:, 10] = _strings(t, "stream", ords)
        k[:, 11] = _strings(t, "op", ords)
        k[:, 12] = _ints(t, "call")
    else:
        k[:, 3] = 1
        k[:, 4] = _strings(t, "quantity", ords)
        k[:, 5] = _ints(t, "sample")
        k[:, 6] = _strings(t, "branch", ords)
    return k


def program_order(tables: Sequence[pa.Table]) -> list[np.ndarray]:
    """Program position of every row of every table, comparable across all of them.

    Args:
        tables: op tables (``schema.OP_ORDER`` columns) and step tables (``schema.STEP_ORDER``
            columns), in any mix, e.g. both runs' step and op tables.

    Returns:
        One ``int64`` array per table: the dense rank of each row in program order (equal
        positions for equal keys; smaller comes first).
    """
    names = [n for n in _KNOWN if any(n in t.column_names for t in tables)]
    ords = {n: _ordinals(tables, n) for n in names}
    keys = [_keys(t, ords) for t in tables]
    allk = np.concatenate(keys) if keys else np.zeros((0, _WIDTH), np.int64)
    pos = np.zeros(len(allk), np.int64)
    if len(allk):
        order = np.lexsort(allk.T[::-1])  # column 0 is the primary key
        sk = allk[order]
        new = np.ones(len(sk), np.int64)
        new[0] = 0
        new[1:] = np.any(sk[1:] != sk[:-1], axis=1)
        pos[order] = np.cumsum(new)
    return np.split(pos, np.cumsum([len(k) for k in keys])[:-1])
