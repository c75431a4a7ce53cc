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
  changes), copied to the device on a side stream while the next chunk is read; a buffer is
  refilled only once its copy and its hashing are done.

The host bytes each tensor is filled from — the stored bytes, or their cast on the host, as a
blocking ``Tensor.to(device, dtype)`` casts — are the bytes handed to the digest, and a GPU copy
of them is byte for byte, so the digest is that of the loaded weights by construction; it hashes
on its own thread while the next chunk is read. Host memory holds the tensors yielded (on the
CPU), the stages and one cast buffer, never a whole shard.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Iterable, Iterator

import torch

from drifttool.errors import CheckpointError
from drifttool.model.checkpoint_files import StoredTensor, locate_tensors
from drifttool.model.weights import PinnedStage, StreamingDigest, host_bytes

CHUNK_BYTES = 64 * 2**20
"""The most bytes read (and, for a GPU, copied) at a time: the largest full-size tensor is 216 MiB
in FP32, so large tensors arrive in a few chunks and the read of one overlaps the copy of the
previous one."""

STAGES = 3
"""Pinned host buffers for a GPU: one being read, one being copied, one being hashed."""


class _Files:
    """The checkpoint's files, each opened once (unbuffered) and read at given offsets."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._open: dict[Path, object] = {}

    def read_into(self, where: StoredTensor, byte_offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` with the bytes of ``where`` from
        ``byte_offset`` on (``readinto`` releases the GIL while it reads).

        Raises:
            CheckpointError: the file ends early (it changed since its header was read).
        """
        fh = self._open.get(where.file)
        if fh is None:
            fh = self._open[where.file] = self._stack.enter_context(open(where.file, "rb", buffering=0))
        view = memoryview(host_bytes(out))
        fh.seek(where.offset + byte_offset)
        while len(view):
            n = fh.readinto(view)
            if not n:
                raise CheckpointError(f"{where.file}: ends before the bytes its header lists "
                                      "(was it changed while loading?)")
            view = view[n:]


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


def _to_gpu(entries, files: _Files, device: torch.device, dtype, digest) -> Iterator[tuple[str, torch.Tensor]]:
    """Onto a GPU: read (and cast) into pinned stages, copy each to the device on a side stream."""
    side = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    stages = [PinnedStage(CHUNK_BYTES) for _ in range(STAGES)]
    scratch: torch.Tensor | None = None
    turn = 0
    try:
        for name, where in entries:
            out_dtype = dtype or where.dtype
            t = torch.empty(where.shape, dtype=out_dtype, device=device)
            flat = t.reshape(-1)
            if digest is not None:
                digest.begin(name, out_dtype, where.shape)
            size = where.dtype.itemsize
            for e0, e1 in _chunks(flat.numel(), max(size, out_dtype.itemsize)):
                stage = stages[turn % STAGES]
                turn += 1
                stage.wait()
                host = stage.buffer[:(e1 - e0) * out_dtype.itemsize].view(out_dtype)
                if out_dtype == where.dtype:
                    files.read_into(where, e0 * size, host)
                else:
                    if scratch is None:
                        scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
                    src = scratch[:(e1 - e0) * size].view(where.dtype)
                    files.read_into(where, e0 * size, src)
                    host.copy_(src)
                if digest is not None:
                    stage.hashed = digest.update(host_bytes(host))
                with torch.cuda.stream(side):
                    flat[e0:e1].copy_(host, non_blocking=True)
                    stage.copied.record(side)
            t.record_stream(side)  # the allocator keeps ``t`` until the side copies are done
            current.wait_stream(side)
            yield name, t
    finally:
        side.synchronize()
        for stage in stages:
            stage.wait()
