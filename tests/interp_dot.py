"""A row-invariant ``tl.dot`` for Triton's interpreter, installed by ``tests/conftest.py``.

The interpreter computes ``tl.dot`` with ``np.matmul``, that is with the BLAS numpy was built
with (OpenBLAS, dispatched per CPU). Its microkernels handle a tile's rows in groups, with other
code (and another order of the K products) for the rows past the last full group, so on some CPUs
(AVX2's Haswell kernels, seen here) a row's bytes depend on where it sits in the tile — a property
of the BLAS, not of the kernel under test, and one the GPU's MMA does not have. The kernels'
invariance tests need the interpreter to model the GPU's property: here every output element is
the sum of its own K products (each rounded to the accumulator's dtype) in ascending k, then the
accumulator is added, as ``np.matmul(a, b) + d`` computes it, in plain elementwise numpy (IEEE,
the same bytes on every CPU). Integer and 8-bit float dots keep Triton's own implementation.
"""

from __future__ import annotations

import numpy as np


def install() -> None:
    """Replace the interpreter's ``create_dot`` (idempotent)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_row_invariant", False):
        return
    triton_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = d.data.dtype
        if not (np.issubdtype(out, np.floating) and a.dtype.primitive_bitwidth > 8
                and b.dtype.primitive_bitwidth > 8):
            return triton_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        x, y = a.data.astype(out), b.data.astype(out)  # [..., M, K], [..., K, N]
        acc = x[..., :, 0:1] * y[..., 0:1, :]
        for k in range(1, x.shape[-1]):
            acc = acc + x[..., :, k:k + 1] * y[..., k:k + 1, :]
        return interpreter.TensorHandle(acc + d.data, d.dtype.scalar)

    create_dot._row_invariant = True
    builder.create_dot = create_dot
