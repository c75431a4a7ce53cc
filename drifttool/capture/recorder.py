"""Capture recorder: digests of operator outputs and step quantities, buffered per step.

    rec = Recorder(level="L2", writer=ArtifactWriter("runs/a", manifest=...), rank=0)
    rt = Runtime(mode="strict", recorder=rec)
    ... model and sampler run; ops.registry.call -> rec.capture(site, out, "BS.", index=0)
    ... sampler: rec.record_step(phase="rollout", step=i, ..., quantities={"x_t": x[b], ...})
    rec.close(complete=True)

    seq rank component phase   step block op_pos stream op          call sample digest   rows
    0   0    mmdit     rollout 0    -1    0      img    img_in_gemm 0    0      0x3f1c…  4096
    1   0    mmdit     rollout 0    -1    0      img    img_in_gemm 0    1      0x8a02…  4096

Levels (design.md, "Digests"): ``L0`` keeps step records only (operator outputs are ignored),
``L1`` adds one digest record per operator output and logical sample, ``L2`` adds row digests.
Step records are kept at every level, with their raw bytes (they are small: ``[N, C]`` or 0-dim).
Operator outputs are never kept, only their digests and summaries.

Digests and summaries are computed on the tensor's device (``digest_pending``) and kept pending;
a step's pending results are read back in one transfer per device when the step is flushed
(``materialize``), so capture never syncs with the host per operator.

Records are buffered and written as one record batch per step: on ``flush()`` and whenever a
record of a different (phase, step) arrives. ``rank`` is the owning rank (this process), not
part of a record's identity. ``seq`` numbers every record (op and step) in execution order on
this rank, for information only: the diff orders records by the rank-independent program
position (``op_pos`` from ``Runtime.site``, ``schema.OP_ORDER``). Without a writer, flushed
batches stay in memory (``ops_table()``, ``steps_table()``), for tests and in-process checks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from drifttool.artifact import schema as S
from drifttool.artifact.writer import ArtifactWriter
from drifttool.capture import gpu_rows
from drifttool.capture.digest import (DigestColumns, PendingDigest, digest_pending, materialize_columns,
                                      pending_rows, raw_bytes)
from drifttool.capture.layout import canonicalize, flat_parts
from drifttool.capture.shards import rank_columns
from drifttool.digestcore import ROW_CHUNK
from drifttool.errors import UnsupportedConfigError

_OPS_FIELDS = ("seq", "rank", "component", "phase", "step", "sigma", "branch", "block", "op_pos",
               "stream", "op", "call", "index", "role", "sample", "txt_len", "img_h", "img_w")
"""The fields of an op record filed one by one (``_append``), besides its digest's columns."""
_STEPS_FIELDS = ("seq", "rank", "component", "phase", "step", "sigma", "sigma_next", "sample",
                 "branch", "quantity")
_SHARED = ("component", "phase", "step", "sigma")
"""The columns every record of a ``capture_records`` block shares (its ``scope``)."""
_SITE_FIELDS = ("phase", "step", "sigma", "branch", "block", "op", "stream", "call", "op_pos")


def _float(x: Any) -> float:
    return math.nan if x is None else float(x)


def row_branch(branches: Any, row: int | None) -> str:
    """The CFG branch of batch row ``row``: scopes of batched CFG hold one entry per row; a
    record without a batch axis gets the shared branch, or ``"+"``-joined distinct ones."""
    if isinstance(branches, str):
        return branches
    if row is not None:
        return str(branches[row])
    return "+".join(dict.fromkeys(str(b) for b in branches))


def _parts(site: dict[str, Any], tensor: torch.Tensor, layout: str, rows: bool):
    """``(part, pending digest)`` per logical sample of an operator output. On a CUDA device
    with a layout that needs no copy (``layout.flat_parts``) the whole output is digested per
    row in one Triton pass (``gpu_rows.row_table``) and every part is cut from that table;
    otherwise each canonical part (``layout.canonicalize``) is digested on its own, and only its
    ``PartId`` is kept (not the tensor: the output is freed when the forward drops it)."""
    flat = flat_parts(site, tensor, layout) if gpu_rows.available(tensor) else None
    if flat is not None and flat[0].shape[0] <= ROW_CHUNK:
        table = gpu_rows.row_table(flat[0])
        return [(p, pending_rows(table, tensor.dtype, p.shape, p.ranges,
                                 keep_rows=rows and p.row_axis is not None)) for p in flat[1]]
    return [(p.without_tensor(), digest_pending(p.tensor, row_axis=p.row_axis,
                                                keep_rows=rows and p.row_axis is not None))
            for p in canonicalize(site, tensor, layout)]


def record_parts(site: dict[str, Any], tensor: torch.Tensor, layout: str, level: str) -> list:
    """``(part, pending digest)`` per logical sample of an operator output at capture ``level``
    (``L1``; ``L2`` keeps the row digests): the device work of ``Recorder.capture``, without
    filing a record. A CUDA graph of a captured forward (``drifttool.model.graphs``) runs it
    inside the graph and files the digests with ``Recorder.capture_digested`` after each replay.

    Raises:
        ValueError: layout and tensor (or site) disagree.
    """
    return _parts(site, tensor.detach(), layout, level == "L2")


def digest_columns(done: DigestColumns) -> dict[str, Any]:
    """The digest columns of op records (``dtype``, ``shape``, ``digest``, ``nonfinite``, ``l2``,
    ``maxabs``, ``row_digests``) of digests read back (``materialize_columns``)."""
    rows = done.rows
    lens = np.array([0 if r is None else len(r) for r in rows], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lens, dtype=np.int32)]).astype(np.int32)
    values = [r for r in rows if r is not None]
    flat = np.concatenate(values) if values else np.empty(0, np.uint64)
    return {"dtype": done.dtype, "shape": done.shape, "digest": done.digest,
            "nonfinite": done.nonfinite, "l2": done.l2, "maxabs": done.maxabs,
            "row_digests": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat),
                                                    mask=pa.array([r is None for r in rows], pa.bool_()))}


class Recorder:
    """Capture sink handed to ``Runtime(recorder=...)``.

    Args:
        level: ``"L0"``, ``"L1"`` or ``"L2"`` (see module docstring).
        writer: where flushed batches go; ``None`` keeps them in memory. The level is written to
            the manifest as ``capture_level``.
        rank: this process's rank; names ``ops.rank<rank>.arrow`` and fills the ``rank`` column
            (the owning rank) of op records (``site["rank"]`` is not consulted).

    Raises:
        UnsupportedConfigError: unknown level.
    """

    def __init__(self, level: str = "L1", writer: ArtifactWriter | None = None, rank: int = 0):
        if level not in S.LEVELS:
            raise UnsupportedConfigError(f"unknown capture level {level!r} (one of {S.LEVELS})")
        self.level = level
        self.writer = writer
        self.rank = int(rank)
        self.closed = False
        self._seq = 0
        self._grad_pos: dict[tuple, int] = {}
        self._current: tuple[str, int] | None = None
        self._ops: list[tuple] = []
        self._blocks: list[tuple[int, dict[str, Any]]] = []  # (len(_ops) before it, columns)
        self._steps: list[tuple] = []
        self._kept_ops: list[pa.RecordBatch] = []
        self._kept_steps: list[pa.RecordBatch] = []
        if writer is not None:
            writer.update_manifest(capture_level=level)

    # -- capture -------------------------------------------------------------------------------
    def _enter_step(self, phase: str, step: int) -> None:
        if self.closed:
            raise RuntimeError("recorder is closed")
        if self._current != (phase, step):
            self.flush()
            self._current = (phase, step)

    def capture(self, site: dict[str, Any], tensor: torch.Tensor, layout: str,
                index: int = 0, role: str = "output") -> None:
        """Digest one operator output: one record per logical sample (L1), plus row digests (L2).

        Args:
            site: ``Runtime.site(op, stream)``: phase, step, sigma, branch, block, samples,
                txt_lens, img_grid, op, stream, call, op_pos (program position), component
                (``"mmdit"`` when absent).
            tensor: the output, any dtype/device (digested on its device, read back at flush).
            layout: axis tags, see ``drifttool.capture.layout``.
            index: output index of a tuple-returning operator.
            role: ``output`` (an operator output), ``grad_input`` or ``grad_weight``.

        Raises:
            ValueError: layout and tensor (or site) disagree, or the site lacks an identity field
                (e.g. ``op_pos``: sites come from ``Runtime.site``).
        """
        if self.level == "L0":
            return
        self._check_site(site)
        self._append(site, record_parts(site, tensor, layout, self.level), index, role)

    def capture_digested(self, site: dict[str, Any], parts: list[tuple[Any, PendingDigest]],
                         index: int = 0, role: str = "output", ranks: list | None = None) -> None:
        """Record an operator output digested elsewhere: ``(part, pending digest)`` per logical
        sample (or its ``TensorDigest``, already read back), a part with ``sample``, ``row_axis`` and ``rows`` as ``layout.Part`` (a sharded
        output's digest combined from its ranks' partials, ``capture.shards``). ``ranks``: per
        part, ``capture.shards.RankCheck`` (every rank's partial and which ranks must agree;
        the ``rank_digests`` and ``rank_disagree`` columns), or ``None``. Arguments and errors
        as ``capture``."""
        if self.level != "L0":
            self._check_site(site)
            self._append(site, parts, index, role, ranks)

    def capture_records(self, scope: dict[str, Any], columns: dict[str, Any]) -> None:
        """File many op records at once, their columns built by the caller (a replayed forward's,
        ``drifttool.model.replay``). They keep their place among the records filed one by one
        (``seq``, flush order).

        Args:
            scope: what every record shares: ``component`` (default ``"mmdit"``), ``phase``,
                ``step``, ``sigma`` (``Runtime.current_scope``).
            columns: every other column of ``schema.OPS_SCHEMA`` but ``seq``, ``rank`` and the
                rank columns, one value per record (lists, numpy or Arrow arrays; the digest
                columns from ``digest_columns``).

        Raises:
            ValueError: a column is missing, unknown or of another length, or the component is
                not one of ``schema.COMPONENTS``.
        """
        if self.level == "L0":
            return
        want = set(S.OPS_SCHEMA.names) - {"seq", "rank", *S.RANK_COLUMNS, *_SHARED}
        if set(columns) != want:
            raise ValueError(f"op record columns differ: missing {sorted(want - set(columns))}, "
                             f"unknown {sorted(set(columns) - want)}")
        n = len(columns["op"])
        if any(len(v) != n for v in columns.values()):
            raise ValueError("op record columns of different lengths")
        component = scope.get("component", S.DEFAULT_COMPONENT)
        if component not in S.COMPONENTS:
            raise ValueError(f"unknown component {component!r} (one of {S.COMPONENTS})")
        if n == 0:
            return
        self._enter_step(scope["phase"], int(scope["step"]))
        self._blocks.append((len(self._ops), {
            **columns, "seq": np.arange(self._seq, self._seq + n, dtype=np.int64),
            "rank": np.full(n, self.rank, np.int32), "component": pa.array([component] * n, pa.utf8()),
            "phase": pa.array([scope["phase"]] * n, pa.utf8()), "step": np.full(n, int(scope["step"]), np.int32),
            "sigma": np.full(n, _float(scope["sigma"])), "rank_digests": pa.nulls(n, pa.list_(pa.uint64())),
            "rank_disagree": pa.nulls(n, pa.list_(pa.int32()))}))
        self._seq += n

    @staticmethod
    def _check_site(site: dict[str, Any]) -> None:
        missing = [k for k in _SITE_FIELDS if k not in site]
        if missing:
            raise ValueError(f"capture site lacks identity field(s) {missing} (sites come from "
                             "Runtime.site)")
        component = site.get("component", S.DEFAULT_COMPONENT)
        if component not in S.COMPONENTS:
            raise ValueError(f"unknown component {component!r} (one of {S.COMPONENTS})")

    def _append(self, site: dict[str, Any], parts: list, index: int, role: str,
                ranks: list | None = None) -> None:
        component = site.get("component", S.DEFAULT_COMPONENT)
        self._enter_step(site["phase"], int(site["step"]))
        rows = self.level == "L2"
        branches = site["branch"]
        for b, (part, d) in enumerate(parts):
            # batched CFG: the scope holds one branch per batch row (docs/architecture.md)
            branch = row_branch(branches, b if part.sample >= 0 else None)
            rm = part.rows if rows and part.row_axis is not None else None
            grid = rm.img_grid if rm is not None else None
            self._ops.append(((
                self._seq, self.rank, component, site["phase"], int(site["step"]),
                _float(site["sigma"]), branch, int(site["block"]), int(site["op_pos"]),
                site["stream"], site["op"], int(site["call"]), int(index), role, part.sample),
                d, (None if rm is None else rm.txt_len,
                None if grid is None else grid[0], None if grid is None else grid[1],
            ), None if ranks is None else ranks[b]))
            self._seq += 1

    def capture_grad(self, *, phase: str, step: int, block: int, stream: str, op: str,
                     tensor: torch.Tensor, sigma: float = math.nan, rank: int = 0,
                     component: str = S.DEFAULT_COMPONENT) -> None:
        """Digest one parameter gradient as an op record with role ``grad_weight`` (branch
        ``none``, sample −1, call 0; ``op`` names the parameter, e.g. ``attn.to_q.lora_A``), so
        two training runs diff at the gradient level. ``op_pos`` is the ordinal of the gradient
        among those captured for (phase, step, block). Ignored at L0 like every op record."""
        if self.level == "L0":
            return
        scope = (component, phase, int(step), int(block))
        pos = self._grad_pos.get(scope, 0)
        self._grad_pos[scope] = pos + 1
        site = {"phase": phase, "step": int(step), "sigma": sigma, "branch": "none",
                "block": int(block), "samples": None, "txt_lens": None, "img_grid": None,
                "rank": int(rank), "component": component, "op": op, "stream": stream,
                "call": 0, "op_pos": pos}
        self.capture(site, tensor.detach(), "." * tensor.dim(), role="grad_weight")

    def record_step(self, *, phase: str, step: int, sigma: float, sigma_next: float, sample: int,
                    branch: str, rank: int = 0, quantities: dict[str, torch.Tensor],
                    component: str = S.DEFAULT_COMPONENT) -> None:
        """Keep one sample's step quantities (every level): digest, summary and raw bytes.

        Args:
            rank: the owning rank (the rank that computed the sample; not part of the identity).
            quantities: canonical tensors (``[N, C]`` or 0-dim), e.g. ``x_t``, ``v_t``,
                ``x_next``, ``mu``, ``std_t``, ``logp_t`` (docs/architecture.md, "Step records").

        Raises:
            TypeError: a quantity is not a tensor.
        """
        self._enter_step(phase, int(step))
        for name, t in quantities.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"step quantity {name!r} is {type(t).__name__}, not a Tensor")
            t = t.detach()
            # bytes now on the host; a device tensor is copied on its device, read at flush
            data = raw_bytes(t).tobytes() if t.device.type == "cpu" else \
                t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).clone()
            d = digest_pending(t)
            self._steps.append(((
                self._seq, int(rank), component, phase, int(step), _float(sigma),
                _float(sigma_next), int(sample), branch, name), d, data))
            self._seq += 1

    # -- output --------------------------------------------------------------------------------
    def _ops_batch(self, done: DigestColumns) -> pa.RecordBatch:
        """The step's op records, in ``seq`` order: those filed one by one (``done``: their
        digests read back) and the blocks of ``capture_records`` at their places."""
        batches, at = [], 0
        for until, cols in [*self._blocks, (len(self._ops), None)]:
            if until > at:
                batches.append(self._tuple_batch(self._ops[at:until], done[at:until]))
                at = until
            if cols is not None:
                batches.append(pa.RecordBatch.from_pydict({k: cols[k] for k in S.OPS_SCHEMA.names},
                                                          schema=S.OPS_SCHEMA))
        if len(batches) == 1:
            return batches[0]
        return pa.Table.from_batches(batches, schema=S.OPS_SCHEMA).combine_chunks().to_batches()[0]

    @staticmethod
    def _tuple_batch(ops: list[tuple], done: DigestColumns) -> pa.RecordBatch:
        heads = [(*head, *tail) for head, _, tail, _ in ops]
        cols = {**dict(zip(_OPS_FIELDS, map(list, zip(*heads)))), **digest_columns(done)}
        cols["rank_digests"], cols["rank_disagree"] = rank_columns([r for *_, r in ops])
        return pa.RecordBatch.from_pydict({k: cols[k] for k in S.OPS_SCHEMA.names},
                                          schema=S.OPS_SCHEMA)

    def _stage_step_bytes(self) -> list[tuple[list[int], torch.Tensor, Any]]:
        """Start copying the step records' device bytes to the host, one copy per device:
        ``(record indices, host buffer, event or None)``. On CUDA the copy goes into pinned
        memory without blocking, on the stream the digests are read back on next, so that
        read-back (``materialize``) also finishes it: the step bytes cost no host sync of
        their own."""
        by_dev: dict[torch.device, list[int]] = {}
        for i, (_, _, x) in enumerate(self._steps):
            if not isinstance(x, bytes):
                by_dev.setdefault(x.device, []).append(i)
        staged = []
        for dev, idx in by_dev.items():
            flat = torch.cat([self._steps[i][2] for i in idx])
            if dev.type == "cuda":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(dev))
                staged.append((idx, host, event))
            else:
                staged.append((idx, flat.cpu(), None))
        return staged

    def _steps_batch(self, done: DigestColumns, staged: list) -> pa.RecordBatch:
        data = [x for _, _, x in self._steps]
        for idx, host, event in staged:  # device bytes: one copy per device, staged before
            if event is not None and not event.query():
                event.synchronize()  # only when no read-back on that stream finished it
            flat = host.numpy()
            at = 0
            for i in idx:
                n = data[i].numel()
                data[i], at = flat[at:at + n].tobytes(), at + n
        cols = {**dict(zip(_STEPS_FIELDS, map(list, zip(*(head for head, _, _ in self._steps))))),
                **{k: v for k, v in digest_columns(done).items() if k != "row_digests"}, "data": data}
        return pa.RecordBatch.from_pydict({k: cols[k] for k in S.STEPS_SCHEMA.names},
                                          schema=S.STEPS_SCHEMA)

    def flush(self) -> None:
        """Write the buffered records as one batch per file (nothing if the buffer is empty)."""
        pending: list[PendingDigest] = [p for _, p, _, _ in self._ops] + [p for _, p, _ in self._steps]
        staged = self._stage_step_bytes()
        done = materialize_columns(pending)  # the step's one read-back per device
        # each buffer is emptied before its batch is written: an exception raised between the
        # write and the emptying (the host-memory watchdog's, Ctrl-C) left the records buffered,
        # and close() wrote them a second time
        if self._ops or self._blocks:
            batch = self._ops_batch(done[:len(self._ops)])
            self._ops.clear()
            self._blocks.clear()
            if self.writer is not None:
                self.writer.write_ops(batch, rank=self.rank)
            else:
                self._kept_ops.append(batch)
        if self._steps:
            batch = self._steps_batch(done[len(pending) - len(self._steps):], staged)
            self._steps.clear()
            if self.writer is not None:
                self.writer.write_steps(batch)
            else:
                self._kept_steps.append(batch)

    def close(self, complete: bool) -> None:
        """Flush, then close the writer with ``complete`` (a second call does nothing)."""
        if self.closed:
            return
        self.flush()
        self.closed = True
        if self.writer is not None:
            self.writer.close(complete=complete)

    def ops_table(self) -> pa.Table:
        """Flushed op records kept in memory (writer ``None``)."""
        return pa.Table.from_batches(self._kept_ops, schema=S.OPS_SCHEMA)

    def steps_table(self) -> pa.Table:
        """Flushed step records kept in memory (writer ``None``)."""
        return pa.Table.from_batches(self._kept_steps, schema=S.STEPS_SCHEMA)

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)
