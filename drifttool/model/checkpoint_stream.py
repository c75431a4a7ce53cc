"""Checkpoint tensors streamed onto a device in chunks, their host bytes hashed on the way.

    >>> located = locate_tensors(weight_files(folder))          # drifttool.model.checkpoint_files
    >>> with StreamingDigest() as digest:                       # drifttool.model.weights
    ...     for name, t in stream_tensors(sorted(located.items()), device="cuda",
    ...                                   dtype=torch.bfloat16, digest=digest): ...
    ...     digest.digest()
    'xxh3_128:…'

Each tensor is read from its file with plain reads into memory drifttool owns (no memory map, so
the file's pages never count in the process's resident memory), ``CHUNK_BYTES`` at a time:

- onto the CPU, straight into the new tensor (or, when the dtype changes, into one reused
  buffer and cast from there into the tensor);
- onto a GPU, into one of ``STAGES`` reused pinned host buffers (cast there when the dtype
  changes) by ``READERS`` threads reading the next chunks ahead, each buffer copied to the
  device on a side stream in order; a buffer is refilled only once its copy and its hashing are
  done.

The host bytes each tensor is filled from — the stored bytes, or their cast on the host, as a
blocking ``Tensor.to(device, dtype)`` casts — are the bytes handed to the digest, and a GPU copy
of them is byte for byte, so the digest is that of the loaded weights by construction; it hashes
on its own thread while the next chunk is read. Host memory holds the tensors yielded (on the
CPU), the stages and one cast buffer, never a whole shard.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from drifttool.errors import CheckpointError
from drifttool.model.checkpoint_files import StoredTensor, locate_tensors
from drifttool.model.weights import PinnedStage, StreamingDigest, host_bytes

CHUNK_BYTES = 64 * 2**20
"""The most bytes read (and, for a GPU, copied) at a time: the largest full-size tensor is 216 MiB
in FP32, so large tensors arrive in a few chunks and the read of one overlaps the copy of the
previous one."""

STAGES = 8
"""Pinned host buffers for a GPU: up to ``STAGES − 1`` chunks being read ahead, the rest being
copied and hashed."""

READERS = 4
"""Threads reading chunks ahead for a GPU (``os.preadv`` releases the GIL). One thread copies
from the page cache at 2–3 GB/s; the H200 machine's host feeds the GPU at about twice that with
four (``benchmarks/bench_load.py``)."""


class _Files:
    """The checkpoint's files, each opened once (unbuffered) and read at given offsets
    (``os.preadv``: no shared file position, so several threads may read at once)."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._open: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._open.get(path)
            if fd is None:
                fd = self._open[path] = self._stack.enter_context(open(path, "rb", buffering=0)).fileno()
            return fd

    def read_into(self, where: StoredTensor, byte_offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` with the bytes of ``where`` from
        ``byte_offset`` on (the read releases the GIL).

        Raises:
            CheckpointError: the file ends early (it changed since its header was read).
        """
        fd = self._fd(where.file)
        view = memoryview(host_bytes(out))
        at = where.offset + byte_offset
        while len(view):
            n = os.preadv(fd, [view], at)
            if not n:
                raise CheckpointError(f"{where.file}: ends before the bytes its header lists "
                                      "(was it changed while loading?)")
            view, at = view[n:], at + n


def _chunks(numel: int, itemsize: int) -> Iterator[tuple[int, int]]:
    """Element ranges ``[e0, e1)`` of at most ``CHUNK_BYTES // itemsize`` elements."""
    step = max(1, CHUNK_BYTES // itemsize)
    for e0 in range(0, numel, step):
        yield e0, min(numel, e0 + step)


def stream_tensors(entries: Iterable[tuple[str, StoredTensor]], *, device: torch.device | str = "cpu",
                   dtype: torch.dtype | None = None, digest: StreamingDigest | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each entry in order, the tensor new and contiguous on
    ``device`` in ``dtype`` (None: the stored dtype), its values those of ``Tensor.to(dtype)``
    on the host. With ``digest``, each tensor's name, dtype, shape and bytes go to it in the same
    order (``StreamingDigest.begin``/``update``: the names must then come sorted).

    On a GPU the copies run on a side stream; the current stream waits for each tensor's copy
    before the tensor is yielded (so any later use on it is ordered after the copy), and every
    copy has finished when the iterator ends or is closed.

    Raises:
        CheckpointError: a file shorter than its header says.
    """
    device = torch.device(device)
    with ExitStack() as stack:
        files = _Files(stack)
        if device.type == "cuda":
            yield from _to_gpu(entries, files, device, dtype, digest)
        else:
            for name, t in _to_host(entries, files, dtype, digest):
                yield name, t if device.type == "cpu" else t.to(device)


def read_tensors(files: Iterable[Path], *, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the safetensors ``files`` in name order, streamed as ``stream_tensors``
    streams them (no digest): for loaders that map the names themselves (the VAE, the text
    encoder).

    Raises:
        CheckpointError: an unreadable, corrupt or short file; a tensor stored in two files.
    """
    yield from stream_tensors(sorted(locate_tensors(files).items()), device=device, dtype=dtype)


def _to_host(entries, files: _Files, dtype, digest) -> Iterator[tuple[str, torch.Tensor]]:
    """Onto the CPU: read into each tensor's own memory (or cast into it from one buffer)."""
    scratch: torch.Tensor | None = None
    for name, where in entries:
        out_dtype = dtype or where.dtype
        t = torch.empty(where.shape, dtype=out_dtype)
        flat = t.reshape(-1)
        if out_dtype == where.dtype:
            files.read_into(where, 0, flat)
        else:
            size = where.dtype.itemsize
            for e0, e1 in _chunks(flat.numel(), max(size, out_dtype.itemsize)):
                if scratch is None:
                    scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
                src = scratch[:(e1 - e0) * size].view(where.dtype)
                files.read_into(where, e0 * size, src)
                flat[e0:e1].copy_(src)
        if digest is not None:
            digest.begin(name, out_dtype, where.shape)
            digest.update(host_bytes(t))  # ``t`` is not written again: no need to wait
        yield name, t


def read_ahead(entries: list[tuple[str, StoredTensor, torch.dtype]], files: _Files,
               buffers: list[torch.Tensor], reuse: Callable[[int], None], readers: int = READERS
               ) -> Iterator[tuple[int, int, int, int, torch.Tensor]]:
    """Every chunk of every entry ``(name, where, out_dtype)`` in order, read (and cast to
    ``out_dtype``) ahead by ``readers`` threads into the CPU ``buffers`` (uint8, ≥ ``CHUNK_BYTES``
    each), used in turn: yields ``(entry index, e0, e1, buffer index, host)`` with ``host`` the
    elements ``[e0, e1)`` of that entry, ready. At most ``len(buffers) − 1`` chunks are read
    ahead; ``reuse(k)`` is called before buffer ``k`` is refilled and must return once what the
    caller started on its last chunk (a copy, the hashing) is done.

    Raises:
        CheckpointError: a file shorter than its header says.
    """
    jobs = ((i, e0, e1) for i, (_, where, od) in enumerate(entries)
            for e0, e1 in _chunks(math.prod(where.shape), max(where.dtype.itemsize, od.itemsize)))
    scratch: dict[int, torch.Tensor] = {}
    pending: deque = deque()
    turn = 0

    def fill(k: int, where: StoredTensor, e0: int, host: torch.Tensor) -> None:
        if host.dtype == where.dtype:
            files.read_into(where, e0 * where.dtype.itemsize, host)
            return
        src = scratch[k][:host.numel() * where.dtype.itemsize].view(where.dtype)
        files.read_into(where, e0 * where.dtype.itemsize, src)
        host.copy_(src)

    def submit(pool: ThreadPoolExecutor) -> None:
        nonlocal turn
        job = next(jobs, None)
        if job is None:
            return
        k = turn % len(buffers)
        turn += 1
        reuse(k)
        i, e0, e1 = job
        _, where, od = entries[i]
        host = buffers[k][:(e1 - e0) * od.itemsize].view(od)
        if od != where.dtype and k not in scratch:
            scratch[k] = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        pending.append((i, e0, e1, k, host, pool.submit(fill, k, where, e0, host)))

    with ThreadPoolExecutor(readers, thread_name_prefix="checkpoint-read") as pool:
        try:
            for _ in range(len(buffers) - 1):
                submit(pool)
            while pending:
                i, e0, e1, k, host, done = pending.popleft()
                done.result()
                yield i, e0, e1, k, host
                submit(pool)
        finally:
            for *_, done in pending:
                done.cancel()


def _to_gpu(entries, files: _Files, device: torch.device, dtype, digest) -> Iterator[tuple[str, torch.Tensor]]:
    """Onto a GPU: read (and cast) ahead into pinned stages, copy each to the device on a side
    stream in order."""
    side = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    stages = [PinnedStage(CHUNK_BYTES) for _ in range(STAGES)]
    plan = [(name, where, dtype or where.dtype) for name, where in entries]
    chunks = read_ahead(plan, files, [s.buffer for s in stages], lambda k: stages[k].wait())
    try:
        for i, (name, where, od) in enumerate(plan):
            t = torch.empty(where.shape, dtype=od, device=device)
            flat = t.reshape(-1)
            if digest is not None:
                digest.begin(name, od, where.shape)
            for _ in _chunks(flat.numel(), max(where.dtype.itemsize, od.itemsize)):
                j, e0, e1, k, host = next(chunks)
                assert j == i
                if digest is not None:
                    stages[k].hashed = digest.update(host_bytes(host))
                with torch.cuda.stream(side):
                    flat[e0:e1].copy_(host, non_blocking=True)
                    stages[k].copied.record(side)
            t.record_stream(side)  # the allocator keeps ``t`` until the side copies are done
            current.wait_stream(side)
            yield name, t
    finally:
        chunks.close()
        side.synchronize()
        for stage in stages:
            stage.wait()
