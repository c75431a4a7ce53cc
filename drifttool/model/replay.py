"""What a replayed forward files: its operator trace, call counters and capture records, in bulk.

    >>> quiet, log = logging_runtime(rt, "L1")   # in the scope of the forward to record
    >>> model(x, txt, txt_mask, tau, grid, quiet)  # e.g. inside torch.cuda.graph(...)
    >>> records = ReplayRecords(log.calls)
    >>> records.file(rt)                          # after each replay, in the replay's scope

A CUDA graph (``drifttool.model.graphs``) records a forward once and replays its kernels, the
digest kernels of its captured outputs included (``recorder.record_parts``), without running
any Python. What the eager forward filed call by call must still be filed after each replay:

* **the call counters** (``Runtime.site``): advanced once per counter key
  (``Runtime.advance_counters``), each call's ``call`` and ``op_pos`` the key's value before the
  replay plus the call's occurrence within the logged forward;
* **the operator trace**: one ``OperatorTrace.record_calls`` for every logged call, with the
  fields the capture traced;
* **the capture records**: the pending digests of every captured part are read back at once
  (``materialize``, one host synchronisation), and the records' columns are assembled from a
  template made once per graph (op, stream, block, output index, role, batch row, dtype, shape,
  the L2 row map) and the replay's scope (step, sigma, the sample id and CFG branch per batch
  row), then handed to ``Recorder.capture_records`` as one block.

The result is what the eager forward leaves, record for record and counter for counter
(``tests/model/test_replay_filing.py`` compares tables, traces and counters on the CPU;
``tests/gpu/test_cuda_graphs.py`` compares a graph's replay with the eager forward). A recorder
without ``capture_records`` is handed one ``capture_digested`` per captured output instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from drifttool.artifact import schema as S
from drifttool.capture.digest import DigestColumns, ReadBack
from drifttool.capture.recorder import digest_columns, record_parts, row_branch
from drifttool.capture.trace import OperatorTrace
from drifttool.errors import UnsupportedConfigError
from drifttool.runtime import Runtime


@dataclass
class LoggedCall:
    """One traced call of a recorded forward: its site's op, stream and block, the trace entry's
    fields, and its captured outputs ``(index, role, [(part, pending digest)])``."""

    op: str
    stream: str
    block: int
    trace: dict[str, Any]
    captures: list = field(default_factory=list)


class CallLog(OperatorTrace):
    """An operator trace that also logs every call, in program order (``calls``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[LoggedCall] = []

    def record(self, *, site: dict[str, Any], **kw: Any) -> None:
        super().record(site=site, **kw)
        self.calls.append(LoggedCall(site["op"], site["stream"], site["block"], kw))


class _CaptureLog:
    """The recorder of a recorded forward: starts each captured output's digest kernels and
    files their pending digests under the call that produced them."""

    def __init__(self, level: str, log: CallLog) -> None:
        self.level = level
        self._log = log

    def capture(self, site: dict[str, Any], tensor: Any, layout: str, index: int = 0,
                role: str = "output") -> None:
        self.capture_digested(site, record_parts(site, tensor, layout, self.level), index, role)

    def capture_digested(self, site: dict[str, Any], parts: list, index: int = 0, role: str = "output",
                         ranks: list | None = None) -> None:
        """File ``(part, pending digest)`` pairs (``capture``'s, or made elsewhere: a kernel's
        own row tables, ``ops.sink.capture_table``) under the call that produced them."""
        if ranks is not None:
            raise UnsupportedConfigError("recorded forward: rank checks of a sharded capture")
        call = self._log.calls[-1]  # the registry traces a call, then captures its outputs
        if (call.op, call.stream, call.block) != (site["op"], site["stream"], site["block"]):
            raise UnsupportedConfigError(f"recorded forward: output of {site['op']} captured "
                                         f"outside its traced call ({call.op})")
        call.captures.append((index, role, parts))


def logging_runtime(rt: Runtime, level: str | None) -> tuple[Runtime, CallLog]:
    """A runtime that runs a forward as ``rt`` would in its current scope, but logs its calls
    (``CallLog``) and, at capture ``level`` (``"L1"``, ``"L2"``; ``None``: none), starts its
    outputs' digests instead of filing them; ``rt``'s trace, counters and recorder are left
    untouched."""
    log = CallLog()
    quiet = dataclasses.replace(rt, recorder=None if level is None else _CaptureLog(level, log),
                                trace=log, _scope=rt.current_scope(), _calls={})
    return quiet, log


class ReplayRecords:
    """Files, after each replay, what the recorded forward's calls filed (module docstring).

    Args:
        calls: the recorded forward's ``CallLog.calls``, in program order. Their pending digests
            are re-read at each ``file`` (a CUDA graph's replay rewrites the tensors they read).
        level: the capture level they were recorded at (``logging_runtime``): ``"L2"`` keeps the
            row map of each record with a row axis.
    """

    def __init__(self, calls: list[LoggedCall], level: str | None) -> None:
        self.calls = calls
        index: dict[tuple, int] = {}
        counts: list[int] = []
        rel = np.zeros((2, len(calls)), np.int64)  # occurrence within the forward: call, op_pos
        key = np.zeros((2, len(calls)), np.int64)
        for i, c in enumerate(calls):
            for j, k in enumerate(((c.block, c.op, c.stream), (c.block,))):
                at = index.setdefault(k, len(index))
                if at == len(counts):
                    counts.append(0)
                key[j, i], rel[j, i] = at, counts[at]
                counts[at] += 1
        self._keys, self._counts, self._key, self._rel = list(index), counts, key, rel
        self._fields, self._ranks, self._row = [], [], []
        for c in calls:
            kw = dict(c.trace)
            self._ranks.append(kw.pop("rank", None))
            self._fields.append(kw)
        # the records' template: one per captured part, in the order the eager forward files them
        rec_call, cols, self._pending = [], {k: [] for k in _TEMPLATE}, []
        for i, c in enumerate(calls):
            for index_, role, parts in c.captures:
                for b, (part, pending) in enumerate(parts):
                    rows = part.rows if level == "L2" and part.row_axis is not None else None
                    grid = (None, None) if rows is None or rows.img_grid is None else rows.img_grid
                    rec_call.append(i)
                    for k, v in zip(_TEMPLATE, (c.block, c.stream, c.op, index_, role, part.sample,
                                                pending.dtype, pending.shape,
                                                None if rows is None else rows.txt_len, *grid)):
                        cols[k].append(v)
                    self._row.append(b if part.sample >= 0 else -1)  # its batch row
                    self._pending.append(pending)
        self._read = ReadBack(self._pending)
        self._rec_call = np.asarray(rec_call, np.int64)
        self._columns = {k: pa.array(v, S.OPS_SCHEMA.field(k).type) for k, v in cols.items()}
        self._block = [c.block for c in calls]
        self._op = [c.op for c in calls]
        self._stream = [c.stream for c in calls]

    def __len__(self) -> int:
        """How many records each replay files."""
        return len(self._pending)

    def file(self, rt: Runtime) -> None:
        """File one replay's trace calls, counters and records into ``rt``, in its current scope
        (step, sigma, CFG branch, the batch rows' sample ids, …, as the forward's scope would be:
        the recorded forward's scope had the same pattern of samples, ``graphs.sample_pattern``).

        Raises:
            ValueError: as ``Recorder.capture_records`` (a scope the records cannot carry).
        """
        scope = rt.current_scope()
        bases = np.asarray(rt.advance_counters(self._keys, self._counts), np.int64)
        call, pos = bases[self._key] + self._rel
        call_l = call.tolist()
        rank, component = int(scope["rank"]), scope["component"]
        rt.trace.record_calls(
            [(rank if r is None else int(r), component, op, block, stream, n)
             for r, op, block, stream, n in zip(self._ranks, self._op, self._block, self._stream, call_l)],
            self._fields)
        if not self._pending or rt.recorder is None:
            return
        done = self._read()  # this replay's digests, before the next replay rewrites them
        if not callable(getattr(rt.recorder, "capture_records", None)):
            self._file_each(rt, scope, call_l, pos.tolist(), done)
            return
        at = self._rec_call
        samples = scope.get("samples")
        rt.recorder.capture_records(scope, {
            **digest_columns(done), **self._columns,  # dtype and shape: the template's
            **({} if samples is None else {"sample": pa.array(
                [int(samples[r]) if r >= 0 else -1 for r in self._row], S.OPS_SCHEMA.field("sample").type)}),
            "branch": pa.array(_branches(scope["branch"], self._row), pa.utf8()),
            "op_pos": pos[at].astype(np.int32), "call": call[at].astype(np.int32)})

    def _file_each(self, rt: Runtime, scope: dict[str, Any], call: list[int], pos: list[int],
                   done: DigestColumns) -> None:
        """The generic path: one ``capture_digested`` per captured output, with its site."""
        it = iter(done.records())
        for i, c in enumerate(self.calls):
            if not c.captures:
                continue
            site = {**scope, "block": c.block, "op": c.op, "stream": c.stream, "call": call[i],
                    "op_pos": pos[i]}
            samples = scope.get("samples")
            for index, role, parts in c.captures:
                rt.recorder.capture_digested(site, [(p if samples is None or p.sample < 0 else
                                                     dataclasses.replace(p, sample=int(samples[b])), next(it))
                                                    for b, (p, _) in enumerate(parts)], index=index, role=role)


_TEMPLATE = ("block", "stream", "op", "index", "role", "sample", "dtype", "shape", "txt_len", "img_h",
             "img_w")
"""The op record columns a replay repeats (``ReplayRecords``'s template)."""


def _branches(branches: Any, rows: list[int]) -> list[str]:
    """The ``branch`` column: the scope's branch, or under batched CFG each record's batch row's
    (``recorder.row_branch``; ``-1``: a record without a batch axis)."""
    if isinstance(branches, str):
        return [branches] * len(rows)
    names = {r: row_branch(branches, None if r < 0 else r) for r in set(rows)}
    return [names[r] for r in rows]
