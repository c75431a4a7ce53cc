"""Many captured outputs' row tables in one Triton launch: a CUDA graph's capture digests its
outputs a batch at a time instead of one launch each.

    >>> with RowBatch(defer=False) as warm:    # eager, a launch each: the batch's kernels
    ...     model(...)                         # compiled, its address tables measured
    >>> batch = RowBatch(arena=torch.empty(warm.words, dtype=torch.int64, device="cuda"))
    >>> with torch.cuda.graph(g), batch:       # row_table defers each output's launch: a batch
    ...     out = model(...)                   # at a time in the graph, the rest at the end
    >>> batch.fill()                           # their address tables, in the arena

A captured forward at L1 digests about 1,865 outputs (60 blocks, batch 1), each with a row-kernel
launch of its own: many short launches, each ramping up and draining the GPU's SMs, which read the
outputs' bytes at a third to a half of what one long launch reads (docs/benchmarks.md, "The
diffusers adapter replayed from CUDA graphs"). Within ``RowBatch``, ``gpu_rows.row_table`` hands
out each output's (empty) row table at once and keeps the output; once the outputs kept on a
stream reach ``BATCH["bytes"]`` or ``BATCH["entries"]`` (about a block's), and at the end, one
``gpu_rows_kernels._rows_many_kernel`` launch per word type writes all their tables, reading
each output at its address from a table of addresses and sizes. Its programs run the row kernel's
per-row arithmetic with the same settings (``gpu_rows.TILE``: tile, splits, Σx² width, rows per
program by the output's rows), so every table is the one ``row_table`` would write, bit for bit
(``tests/gpu/test_digest_cuda.py``; in Triton's interpreter ``tests/capture/test_gpu_row_batch.py``).

What it keeps safe:

* **an output changed in place** after it was recorded and before its batch's launch would be
  digested with its new bytes: each output's version counter is read at the launch, and a
  change raises ``UnsupportedConfigError`` (a graph's capture is then refused and the forward
  runs eagerly, with a launch per output: ``model.graphs``). Tensors without a version counter
  (made under ``torch.inference_mode``) are not deferred: they are digested at once.
* **streams**: outputs are batched per CUDA stream and launched on their own stream (the text
  lane's on the text lane, ``model.lanes``); at the end the current stream waits for the others,
  so a graph's capture ends joined. A text-lane launch may come after the block's end, where the
  lanes no longer keep what the main lane made alive: such an output is marked as used on the
  text lane (``record_stream``), so the allocator hands its memory back only after the launch.
* **the launches' tables**: a launch reads its address table (``words`` int64 per output: its
  entry and its row tiles) from device memory. Outside a capture each is written before its
  launch. In a capture they are cut from ``arena``, allocated before the capture (outside the
  graph's memory pool) and written by ``fill()`` once it has ended: memory the capture allocated
  could be memory that tensors freed earlier in the forward used, which every replay writes again
  before the launch reads it (a table written there once read addresses of nothing at the next
  replay). The words a forward needs do not depend on how its outputs are batched, so the eager
  forward before the capture measures the arena under ``RowBatch(defer=False)`` (``words``), which
  digests each output at once as without a batch and, at its end, compiles the batch's kernel for
  every kind of launch it will make (a capture must compile nothing); a capture that needs more
  raises ``UnsupportedConfigError``. ``keep`` holds the tables for as long as the graph replays.

Within a batch the kernels that could digest their own outputs where they write them (the strict
GEMMs', norms', rotation's, gated residual's and attention's digesting launches,
``capture.produced``) leave them to it (``produced.batched``): one launch over a block's outputs
costs less than digesting in each producer (docs/benchmarks.md). Only row kernel 2
(``gpu_rows.TILE["kernel"]``) is batched; with kernel 1 every output is digested at once, as
without a batch, and the producers digest theirs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from drifttool.capture import gpu_rows, produced
from drifttool.errors import UnsupportedConfigError

LANE = False
"""True: deferred launches run on a stream of their own (``RowBatch.lane``), beside the forward's
next block, where the GEMMs keep the tensor cores busy and may leave memory bandwidth to the row
kernel. A batch's outputs are then kept until the launch of the next batch from their stream,
whose stream then waits for the first launch before their memory can be reused, and each is
checked again for a change in place. Off by default: on an H100 it gained 1–4 % at 1024² and
nothing at 1664×928, and cost the diffusers adapter 1–2 % (docs/benchmarks.md, "The pinned
read-back and the digest lane"; ``benchmarks/bench_gpu_forward.py``'s ``+lane``)."""

BATCH = {"bytes": 1 << 28, "entries": 64}
"""When a stream's kept outputs are launched: at ``bytes`` bytes (an image-stream block at 1024²,
batch 1, is about 450 MB) or ``entries`` outputs, whichever comes first; the rest at the end."""

@dataclass
class _Entry:
    x: torch.Tensor  # kept until its launch
    version: int
    table: tuple[torch.Tensor, torch.Tensor]


def _refuse_changed(entries: list[_Entry], before: str) -> None:
    """Refuse a batch whose outputs were changed in place since they were added (their digest
    would be of other bytes).

    Raises:
        UnsupportedConfigError: naming the first such output's dtype and shape, and ``before``.
    """
    changed = [e for e in entries if e.x._version != e.version]
    if changed:
        x = changed[0].x
        raise UnsupportedConfigError(
            f"a captured output ({x.dtype} {tuple(x.shape)}) was changed in place before its {before}")


class RowBatch:
    """Deferred row-table launches (module docstring); a context manager, not reentrant.

    Attributes:
        keep: the launches' address tables (int64 CUDA tensors; in a capture the arena): a
            graph that recorded the launches reads them at every replay, so hold them with it.
        launches: launches made; ``tensors``: outputs digested through them; ``words``: the
            address-table words of the outputs taken (an arena's size for the same forward).

    Args:
        arena: int64 CUDA memory allocated before a graph's capture, where the capture's address
            tables go (module docstring); without it a capture's launch raises
            ``UnsupportedConfigError``.
        defer: False: launch each output's kernel at once (``row_table`` as without a batch),
            measuring ``words`` and compiling the batch's kernels at the end (a warm-up).
    """

    def __init__(self, arena: torch.Tensor | None = None, *, defer: bool = True) -> None:
        self.defers = defer
        self._kinds: set[tuple[int, int, int, bool]] = set()
        self._device: torch.device | None = None
        self.keep: list[torch.Tensor] = [] if arena is None else [arena]
        self.words = 0
        self._arena, self._used = arena, 0
        self._fills: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._home: torch.cuda.Stream | None = None
        self._producers: Any = None
        self.launches = 0
        self.tensors = 0
        self._pending: dict[tuple[int, int], tuple[Any, list[_Entry]]] = {}
        self.lane: torch.cuda.Stream | None = None  # where deferred launches run (LANE)
        self._inflight: dict[tuple[int, int], tuple[Any, Any, list[_Entry]]] = {}
        self._bytes: dict[tuple[int, int], int] = {}

    def __enter__(self) -> "RowBatch":
        self._home = torch.cuda.current_stream() if torch.cuda.is_available() else None
        before = gpu_rows.defer_to(self)
        if before is not None:
            gpu_rows.defer_to(before)
            raise RuntimeError("a RowBatch is already active on this thread")
        self._producers = produced.batched(int(gpu_rows.TILE.get("kernel", 2)) == 2)
        if LANE and self.defers and self._home is not None:
            self.lane = torch.cuda.Stream(self._home.device)
        return self

    def __exit__(self, kind, value, tb) -> None:
        gpu_rows.defer_to(None)
        produced.done(self._producers)
        if kind is not None:  # a failed forward (a refused capture): launch nothing more
            self._pending.clear()
            self._bytes.clear()
            if self.lane is not None:
                torch.cuda.current_stream(self.lane.device).wait_stream(self.lane)
            self._inflight.clear()
            return
        for key in list(self._pending):
            stream = self._pending[key][0]
            self._flush(key)
            if stream is not None and stream != torch.cuda.current_stream(stream.device):
                torch.cuda.current_stream(stream.device).wait_stream(stream)  # the end joins it
        if self.lane is not None:  # the end joins the lane: its outputs may go at once
            torch.cuda.current_stream(self.lane.device).wait_stream(self.lane)
            for key in list(self._inflight):
                self._release(key, wait=False)
        for kind_ in sorted(self._kinds):  # a warm-up: each kind of launch once, on a few zeros
            wbytes, floating, bm, aligned = kind_
            dtype = (torch.bfloat16, torch.float16, torch.float32)[floating]
            x = torch.zeros(bm, 8, dtype=dtype, device=self._device)
            self._launch([_Entry(x, x._version, gpu_rows.empty_table(bm, self._splits(), x.device))],
                         wbytes, floating, bm, aligned)
        self._kinds.clear()

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether ``x``'s table can be deferred: a CUDA tensor (a CPU one under Triton's
        interpreter) with a version counter, row kernel 2."""
        if not (x.is_cuda or gpu_rows.INTERPRETED) or int(gpu_rows.TILE.get("kernel", 2)) != 2:
            return False
        try:
            x._version
        except RuntimeError:  # an inference tensor
            return False
        return True

    def count(self, x: torch.Tensor) -> None:
        """Measure ``x``'s address-table words (``words``) and, without ``defer``, the kind of
        launch it would take (compiled at the end)."""
        if x.shape[0]:
            kind = _group(x)
            self.words += 8 + 2 * -(-x.shape[0] // kind[2])
            if not self.defers:
                self._kinds.add(kind)
                self._device = x.device

    def add(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``'s row table (``gpu_rows.row_table``'s format and shapes), written by a later
        launch of this batch; ``x`` (2-D, checked by ``row_table``) is kept until then."""
        stream = torch.cuda.current_stream(x.device) if x.is_cuda else None
        key = (-1, 0) if stream is None else (x.device.index, stream.stream_id)
        if stream is not None and stream != self._home:
            x.record_stream(stream)  # made on the main lane, read on the text lane after its end
        table = gpu_rows.empty_table(x.shape[0], self._splits(), x.device)
        self.count(x)
        self._pending.setdefault(key, (stream, []))[1].append(_Entry(x, x._version, table))
        self._bytes[key] = self._bytes.get(key, 0) + x.shape[0] * x.shape[1] * x.element_size()
        if self._bytes[key] >= BATCH["bytes"] or len(self._pending[key][1]) >= BATCH["entries"]:
            self._flush(key)
        return table

    @staticmethod
    def _splits() -> int:
        return max(1, int(gpu_rows.TILE["split"]))

    def fill(self) -> None:
        """Write the address tables of the launches recorded in a capture into the arena (call
        once the capture has ended, before the first replay)."""
        if self._fills:  # the tables lie end to end at the arena's start: one asynchronous copy
            host = torch.cat([h for _, h in self._fills])
            self._arena[:host.numel()].copy_(_pinned(host), non_blocking=True)
        self._fills.clear()

    def _cut(self, n: int) -> torch.Tensor:
        """``n`` words of the arena (``n`` even: every table starts 16-byte aligned)."""
        if self._arena is None or self._used + n > self._arena.numel():
            have = 0 if self._arena is None else self._arena.numel()
            raise UnsupportedConfigError(
                f"a CUDA graph's batched digest launches need more than the {have} address-table "
                "words measured by the eager forward before it")
        self._used += n
        return self._arena[self._used - n:self._used]

    def _flush(self, key: tuple[int, int]) -> None:
        stream, entries = self._pending.pop(key)
        self._bytes.pop(key, None)
        _refuse_changed(entries, "digest's batched launch")
        groups: dict[tuple, list[_Entry]] = {}
        for e in entries:
            if e.x.shape[0]:
                groups.setdefault(_group(e.x), []).append(e)
        if self.lane is None or stream is None:
            with (contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)):
                for (wbytes, floating, bm, aligned), group in groups.items():
                    self._launch(group, wbytes, floating, bm, aligned)
            return
        self.lane.wait_stream(stream)  # the lane sees this batch's outputs
        with torch.cuda.stream(self.lane):
            for (wbytes, floating, bm, aligned), group in groups.items():
                self._launch(group, wbytes, floating, bm, aligned)
            done = torch.cuda.Event()
            done.record(self.lane)
        self._release(key)  # the batch before, launched a batch ago on the lane
        self._inflight[key] = (stream, done, entries)

    def _release(self, key: tuple[int, int], *, wait: bool = True) -> None:
        """Let the outputs of ``key``'s batch in flight on the lane go: none was changed in place,
        and (``wait``) their stream waits for its launch, since a later allocation there may take
        their memory. At the end the current stream has joined the lane instead: a wait on a text
        lane after the end would leave a graph's capture unjoined."""
        if key not in self._inflight:
            return
        stream, done, entries = self._inflight.pop(key)
        _refuse_changed(entries, "digest's batched launch had run")
        if wait:
            stream.wait_event(done)

    def _launch(self, group: list[_Entry], wbytes: int, floating: int, bm: int, aligned: bool) -> None:
        tile = gpu_rows.TILE
        bc = int(tile["bc"])
        if wbytes == 4:
            bc = max(16, bc // 2)
        v = min(int(tile.get("v", 8)), bc)
        splits = self._splits()
        dev = group[0].x.device
        ent = np.zeros((len(group), 8), np.int64)
        items = []
        for i, e in enumerate(group):
            r, c = e.x.shape
            ent[i] = (e.x.data_ptr(), e.table[0].data_ptr(), e.table[1].data_ptr(), r, c,
                      (e.x.stride(0) if r > 1 else c) * wbytes, *gpu_rows.shift_constants(c, wbytes))
            items.append(np.stack([np.full(-(-r // bm), i), np.arange(-(-r // bm))], 1))
        it = np.concatenate(items).astype(np.int64)
        host = torch.from_numpy(np.concatenate([ent.reshape(-1), it.reshape(-1)]))
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            plan = self._cut(host.numel())
            self._fills.append((plan, host))
        else:
            plan = _pinned(host).to(dev, non_blocking=True) if dev.type == "cuda" else host
            self.keep.append(plan)
        keys = gpu_rows.byte_key_table(dev, max(int(e.x.shape[1]) for e in group), wbytes)
        gpu_rows.kernels._rows_many_kernel[(len(it), splits)](
            plan, plan[ent.size:], keys, keys.shape[1], WBYTES=wbytes, FLOAT=floating, BM=bm,
            BC=bc, FOLD_EVERY=max(1, gpu_rows.FOLD_BYTES // (bc * wbytes)), V=v,
            ASM=not gpu_rows.INTERPRETED, REGS=int(tile.get("regs", 1)), ALIGNED=aligned,
            num_warps=int(tile["warps"]), num_stages=int(tile["stages"]))
        self.launches += 1
        self.tensors += len(group)


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """``host`` in pinned memory where CUDA is: a copy from pageable memory would block the host
    (one synchronisation per launch's table)."""
    return host.pin_memory() if torch.cuda.is_available() else host


def _group(x: torch.Tensor) -> tuple[int, int, int, bool]:
    """What one launch's outputs share: word bytes, float type, rows per program (as
    ``gpu_rows.launch`` picks them for ``x``'s rows) and 16-byte alignment of address and row
    stride."""
    r, c = x.shape
    wbytes = x.element_size()
    bm = min(int(gpu_rows.TILE["bm"]), max(16, 1 << max(0, r - 1).bit_length()))
    stride = (x.stride(0) if r > 1 else c) * wbytes
    return wbytes, gpu_rows.float_code(x.dtype), bm, x.data_ptr() % 16 == 0 and stride % 16 == 0
