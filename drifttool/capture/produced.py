"""Row tables written by the kernel that produced an output, handed to its capture.

    >>> with producing(True):                  # ops.registry: this call's outputs will be captured
    ...     y = gemm.linear(x, w, digest=wanted())   # the epilogue writes y's row table, offer(y, t)
    >>> table(y2d)                             # gpu_rows.row_table: y2d's table, no second read

A captured output is digested row by row (digest v2's level 1, ``capture.gpu_rows``). Reading a
large output a second time costs about a copy's time; the kernel that writes it can instead
compute the row terms from the values it stores (integer sums equal to the row kernel's) and
``offer`` the table: the strict GEMM's epilogue (``kernels.gemm.linear(..., digest=True)``), the
gate residual and the rotation (``kernels.elementwise``), the head-wise RMSNorm and the modulated
LayerNorm (``kernels.norms``) and the fused attention (``kernels.attention``).
``gpu_rows.row_table`` asks ``table`` first.

The hand-over is keyed by the output's address, shape, strides and dtype and holds only while the
output is alive and unwritten since: the tensor's version counter (shared by its views) must not
have moved, so an in-place write through torch makes the table stale and the row kernel reads the
bytes as before. An entry goes with its tensor (a weak reference), so a later tensor at the same
address is never taken for it.

``producing`` marks the calls whose outputs the registry will capture (``ops.sink.digests_wanted``)
and ``wanted`` reads the mark, so a kernel digests only what is captured.
"""

from __future__ import annotations

import contextvars
import weakref

import torch

ENABLED = True
"""False: no kernel writes tables (``wanted`` is false), so every captured output is read by the
row kernel, as before this hand-over (``benchmarks/bench_gpu_forward.py``'s ``+rows`` configs;
the bytes of every digest are the same either way)."""

_WANTED: contextvars.ContextVar[bool] = contextvars.ContextVar("drifttool_digest_outputs", default=False)
_BATCHED: contextvars.ContextVar[bool] = contextvars.ContextVar("drifttool_rows_batched", default=False)
_TABLES: dict[tuple, tuple[weakref.ref, int, tuple[torch.Tensor, torch.Tensor]]] = {}


def wanted() -> bool:
    """Whether the running operator call's outputs will be captured (``producing``) and the
    hand-over is on (``ENABLED``; never under ``torch.inference_mode``, whose tensors keep no
    version counter) and no batch of row-kernel launches takes the outputs instead (``batched``)."""
    return ENABLED and _WANTED.get() and not _BATCHED.get() and not torch.is_inference_mode_enabled()


def batched(on: bool) -> contextvars.Token:
    """Leave (``on``) every captured output to the row kernel from here on: within a
    ``capture.gpu_row_batch.RowBatch`` (a CUDA graph's capture and its warm-up) a launch reads
    about a block's outputs at once, which costs less than the producers' digesting launches
    (on an H100, a 60-block strict forward at 1024², batch 1, L1: the batched row kernel 16 ms
    of kernel time against 110 ms that digesting added to the GEMMs, norms, rotations, gated
    residuals and attention; docs/benchmarks.md). Returns the token ``done`` takes."""
    return _BATCHED.set(on)


def marked() -> bool:
    """Whether a ``producing(True)`` mark is in force (an enclosing call's, which a nested call
    that is not captured must clear for its own kernels)."""
    return _WANTED.get()


def producing(on: bool) -> contextvars.Token:
    """Mark (``on``) or unmark the calls from here on as captured; returns the token that
    ``done`` takes to restore the mark before (the registry brackets one call with them)."""
    return _WANTED.set(on)


def done(token: contextvars.Token) -> None:
    """Restore the mark ``producing`` (or the setting ``batched``) replaced."""
    token.var.reset(token)


def _identity(x: torch.Tensor) -> tuple:
    return x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device


def offer(out: torch.Tensor, rows_table: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Hand over the row table (``gpu_rows.row_table``'s format, ``R`` rows) a kernel wrote for
    its fresh contiguous output ``out`` from the values it stored, launched on ``out``'s stream
    before any other write of ``out`` (module docstring). The table stands for ``out`` viewed as
    ``[R, numel / R]`` (the flat view a capture digests).

    Raises:
        ValueError: ``out`` is not contiguous, or its elements do not make ``R`` rows."""
    if out.is_inference():  # no version counter to tell a later write: no hand-over
        return
    rows = rows_table[0].shape[1]
    if not out.is_contiguous() or rows == 0 or out.numel() % rows:
        raise ValueError(f"a row table of {rows} rows does not fit a {tuple(out.shape)} "
                         f"{'contiguous' if out.is_contiguous() else 'strided'} output")
    cols = out.numel() // rows
    key = (out.data_ptr(), (rows, cols), (cols, 1), out.dtype, out.device)

    def forget(ref: weakref.ref) -> None:
        hit = _TABLES.get(key)
        if hit is not None and hit[0] is ref:
            del _TABLES[key]

    _TABLES[key] = (weakref.ref(out, forget), out._version, rows_table)


def table(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The table ``offer``ed for ``x``'s bytes, or ``None`` (none, or a stale one)."""
    if x.is_inference():
        return None
    hit = _TABLES.get(_identity(x))
    if hit is None:
        return None
    ref, version, rows_table = hit
    y = ref()
    # alive, unwritten, and still on the storage it was written to (``.data =`` or ``set_`` move it)
    if y is None or y._version != version or x._version != version or y.data_ptr() != x.data_ptr():
        return None
    return rows_table
