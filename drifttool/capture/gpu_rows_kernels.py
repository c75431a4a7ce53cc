"""The Triton kernels behind ``gpu_rows.row_table``: digest v2's row sums and the row summary of a
float tensor in one read (docs/digest.md, "On a GPU: one Triton pass per captured output").

Two kernels compute the same row digests (exact integer sums mod ``p = 2**61 − 1``, so any order
of addition gives the same bits); ``gpu_rows.TILE["kernel"]`` picks one:

- ``_rows_kernel`` (kernel 2, the default): one load of the bytes of a ``[BM, BC]`` tile
  (``uint8`` view, ``BC · W`` byte columns). The shifted bytes ``s = u − 128`` go to one int8
  tensor-core product with the **signed 8-bit limbs** of the byte keys (8 limbs of ``B``, 8 of
  ``B'``: 16 key columns, stored limb-major so the product reads them K-major from shared
  memory); the values are the same bytes reassembled in registers. The summary keeps Σx² in
  fp64 per ``V`` columns (summed within a thread, no shuffles in the loop), max and min
  elementwise in the tensor's own type (bf16 pairs through ``max.bf16x2``), and counts NaN/±inf
  only for rows whose Σx² is not finite (a second read of those programs' columns; a finite fp64
  Σx² of finite squares rules them out, as the CPU's ``summary._stats_np`` does).
- ``_rows_kernel_v1`` (kernel 1, the first version): the bytes and the typed values through two
  loads, unsigned 7-bit limbs (9 per key, 32 key columns), elementwise summary accumulators.

Exactness of kernel 2: a limb ``d`` is in ``[−128, 127]`` and ``s`` in ``[−128, 127]``, so each
product is at most ``2**14`` in magnitude and ``2**16`` byte columns add below ``2**30`` in
int32; the kernel folds its int32 accumulator into int64 mod p after each ``FOLD_EVERY`` tiles
(``FOLD_EVERY · BC · W <= 2**16``). A limb sum ``x`` of column ``l`` stands for ``x · 2**(8l)``:
``_fold_into`` adds ``p`` (making it non-negative), reduces mod p and rotates by ``8l`` bits.

After a replay ``digest_rows.RowTables`` finishes the tables: ``_gather_kernel`` combines their
column splits and gathers the records' rows in one launch (``gpu_rows.gather_rows``), and
``_level2_kernel`` sums level 2 per record (``gpu_rows.level2_products``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _modp(x):
    """``x mod p`` for ``0 <= x < 2**63``."""
    P = 2305843009213693951
    y = (x & P) + (x >> 61)
    return tl.where(y >= P, y - P, y)


@triton.jit
def _family(lo, hi, sel):
    """``Σ_l x_l mod p`` over the selected limb columns (``x = lo + 2**30 hi``)."""
    l_sum = _modp(tl.sum(tl.where(sel, lo, 0), axis=1))  # < 9 · 2**30 before the fold
    h_sum = _modp(tl.sum(tl.where(sel, hi, 0), axis=1))  # < 9 · 2**31 before the fold
    h_rot = ((h_sum & ((1 << 31) - 1)) << 30) | (h_sum >> 31)  # · 2**30 mod p
    return _modp(l_sum + h_rot)


@triton.jit
def _fold_into(acc_t, acc_t2, acc32, LIMBS: tl.constexpr, NCOL: tl.constexpr,
               LIMB_BITS: tl.constexpr):
    """Add the int32 limb sums (any sign, |x| < 2**31; column ``f · LIMBS + l`` is limb ``l`` of
    family ``f``, weight ``2**(LIMB_BITS · l)``) into T, T' (int64 in [0, p))."""
    P = 2305843009213693951
    col = tl.arange(0, NCOL)
    sh = (LIMB_BITS * (col % LIMBS)).to(tl.int64)
    x = _modp(acc32.to(tl.int64) + P)  # x + p is in (p − 2**31, p + 2**31): non-negative
    mask = (tl.full([NCOL], 1, tl.int64) << (61 - sh)) - 1
    x = ((x & mask[None, :]) << sh[None, :]) | (x >> (61 - sh[None, :]))  # · 2**sh mod p
    lo = x & ((1 << 30) - 1)
    hi = x >> 30
    fam = col // LIMBS
    t = _modp(acc_t + _family(lo, hi, (fam == 0)[None, :]))
    t2 = _modp(acc_t2 + _family(lo, hi, (fam == 1)[None, :]))
    return t, t2


# -- kernel 2 -------------------------------------------------------------------------------------
@triton.jit
def _values(u, BM: tl.constexpr, BC: tl.constexpr, WBYTES: tl.constexpr, FLOAT: tl.constexpr):
    """``uint8 [BM, BC · W]`` bytes (little endian) → ``[BM, BC]`` values: bf16 (``FLOAT`` 0),
    fp16 (1) or fp32 (2)."""
    if WBYTES == 2:
        lo, hi = tl.split(tl.reshape(u, [BM, BC, 2]))
        w = lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)
        if FLOAT == 0:
            x = w.to(tl.bfloat16, bitcast=True)
        else:
            x = w.to(tl.float16, bitcast=True)
    else:
        e, o = tl.split(tl.reshape(u, [BM, BC, 2, 2]))
        lo, hi = tl.split(e.to(tl.uint16) | (o.to(tl.uint16) << 8))
        x = (lo.to(tl.uint32) | (hi.to(tl.uint32) << 16)).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _max(a, b, ASM: tl.constexpr):
    """Elementwise max that ignores NaN, in ``a``'s type (bf16 pairs: ``max.bf16x2``)."""
    if ASM and a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.maximum(a, b).to(a.dtype)


@triton.jit
def _min(a, b, ASM: tl.constexpr):
    """Elementwise min that ignores NaN, in ``a``'s type (bf16 pairs: ``min.bf16x2``)."""
    if ASM and a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("min.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.minimum(a, b).to(a.dtype)


@triton.jit
def _tile(base, kbase, offs, koffs, col0, C, acc32, sq, mx, mn, BM: tl.constexpr,
          BC: tl.constexpr, WBYTES: tl.constexpr, FLOAT: tl.constexpr, MASKED: tl.constexpr,
          V: tl.constexpr, ASM: tl.constexpr, REGS: tl.constexpr):
    """One ``[BM, BC]`` tile at element column ``col0``: the int8 product and the summary.
    ``MASKED``: the row's last tile, columns ``>= C`` load as byte 128 (``s = 0``, no term) and
    stay out of the summary. ``REGS`` (with ``ASM``): the product's operand goes from the
    registers that hold the tile for the summary through a swizzled shared buffer; otherwise the
    compiler reads the pipelined tile a second time in the product's layout, from a buffer that
    two layouts share and so is not swizzled (the reads of 8 rows 256 bytes apart fall in the
    same banks). The xor is written as opaque (not pure) inline assembly so that the compiler
    keeps it, and the conversion, where it stands."""
    if MASKED:
        bmask = (col0 * WBYTES + tl.arange(0, BC * WBYTES)) < C * WBYTES
        # loaded with other=0, then 128 selected: Triton 3.6 compiled a masked uint8 load with
        # other=128 wrongly on an H200 where the row stride is a multiple of 16 bytes (the load
        # vectorised), giving wrong T, T' (docs/benchmarks.md, "Row kernel 2")
        u = tl.load(base + offs, mask=bmask[None, :], other=0)
        u = tl.where(bmask[None, :], u, tl.full([1, BC * WBYTES], 128, tl.uint8))
    else:
        u = tl.load(base + offs)
    k = tl.load(kbase + koffs)  # [NCOL, BC · W]: K-major for the product
    if REGS and ASM:  # an opaque xor: the product takes its operand from these registers
        s = tl.inline_asm_elementwise("xor.b32 $0, $1, 0x80808080;", "=r,r", [u], dtype=tl.int8,
                                      is_pure=False, pack=4)
    else:
        s = (u ^ 0x80).to(tl.int8, bitcast=True)
    acc32 = tl.dot(s, tl.trans(k), acc32, out_dtype=tl.int32)
    x = _values(u, BM, BC, WBYTES, FLOAT)
    xd = x.to(tl.float64)
    if MASKED:
        ok = ((col0 + tl.arange(0, BC)) < C)[None, :]
        xd = tl.where(ok, xd, 0.0)
        xmx = tl.where(ok, x, tl.full([1, BC], float("-inf"), tl.float32).to(x.dtype))
        xmn = tl.where(ok, x, tl.full([1, BC], float("inf"), tl.float32).to(x.dtype))
    else:
        xmx = x
        xmn = x
    if V == 0:
        sq += tl.sum(xd * xd, axis=1)
    else:
        sq += tl.sum(tl.reshape(xd * xd, [BM, BC // V, V]), axis=2)
    mx = _max(mx, xmx, ASM)
    mn = _min(mn, xmn, ASM)
    return acc32, sq, mx, mn


@triton.jit
def _count_bad(XB, offs, C, first, end, BM: tl.constexpr, BC: tl.constexpr,
               WBYTES: tl.constexpr, FLOAT: tl.constexpr):
    """NaN/±inf per row over tiles ``[first, end)`` (a second read, for rows that have some)."""
    bad = tl.zeros([BM], tl.int32)
    for it in range(first, end):
        bcols = it * (BC * WBYTES) + tl.arange(0, BC * WBYTES)
        u = tl.load(XB + it * (BC * WBYTES) + offs, mask=(bcols < C * WBYTES)[None, :], other=0)
        x = _values(u, BM, BC, WBYTES, FLOAT).to(tl.float32)
        bad += tl.sum((~(tl.abs(x) <= 3.4028234663852886e38)).to(tl.int32), axis=1)
    return bad


@triton.jit
def _rows_kernel(XB, KT, ROWS, STATS, R, C, stride_rb, ktab, shift_t, shift_t2, TILES_PER_SPLIT,
                 WBYTES: tl.constexpr, FLOAT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
                 FOLD_EVERY: tl.constexpr, V: tl.constexpr, ASM: tl.constexpr,
                 REGS: tl.constexpr):
    """Rows ``[pid·BM, (pid+1)·BM)`` of column split ``program_id(1)`` of one tensor
    (``_rows_tile``)."""
    _rows_tile(XB, KT, ROWS, STATS, R, C, stride_rb, ktab, shift_t, shift_t2, TILES_PER_SPLIT,
               tl.program_id(0), tl.program_id(1), WBYTES, FLOAT, BM, BC, FOLD_EVERY, V, ASM, REGS)


@triton.jit
def _rows_many_kernel(ENT, ITEMS, KT, ktab, WBYTES: tl.constexpr, FLOAT: tl.constexpr,
                      BM: tl.constexpr, BC: tl.constexpr, FOLD_EVERY: tl.constexpr,
                      V: tl.constexpr, ASM: tl.constexpr, REGS: tl.constexpr,
                      ALIGNED: tl.constexpr):
    """``_rows_kernel`` of many tensors in one launch (``gpu_rows.RowBatch``): program
    ``(i, split)`` is row tile ``ITEMS[i, 1]`` of column split ``split`` of tensor ``ITEMS[i, 0]``,
    whose entry in ``ENT`` (``int64 [n, 8]``) holds the address of its ``uint8`` view, of its
    row table's rows and stats (``gpu_rows.empty_table``), ``R``, ``C``, the row stride in
    bytes and the two ``u − 128`` corrections. Every tensor has ``WBYTES``-byte words of type
    ``FLOAT``; ``ALIGNED``: every address and row stride a multiple of 16 bytes (as a tensor
    argument's would be specialised). The same per-row arithmetic as ``_rows_kernel`` with the
    same constants, so the same table bit for bit."""
    i = tl.program_id(0)
    split = tl.program_id(1)
    e = tl.load(ITEMS + 2 * i)
    pid = tl.load(ITEMS + 2 * i + 1)
    XB = tl.load(ENT + 8 * e).to(tl.pointer_type(tl.uint8))
    ROWS = tl.load(ENT + 8 * e + 1).to(tl.pointer_type(tl.int64))
    STATS = tl.load(ENT + 8 * e + 2).to(tl.pointer_type(tl.float64))
    R = tl.load(ENT + 8 * e + 3)
    C = tl.load(ENT + 8 * e + 4)
    stride_rb = tl.load(ENT + 8 * e + 5)
    if ALIGNED:
        XB = tl.multiple_of(XB, 16)
        stride_rb = tl.multiple_of(stride_rb, 16)
    tiles_per_split = tl.cdiv(tl.cdiv(C, BC), tl.num_programs(1))
    _rows_tile(XB, KT, ROWS, STATS, R, C, stride_rb, ktab, tl.load(ENT + 8 * e + 6),
               tl.load(ENT + 8 * e + 7), tiles_per_split, pid, split, WBYTES, FLOAT, BM, BC,
               FOLD_EVERY, V, ASM, REGS)


@triton.jit
def _rows_tile(XB, KT, ROWS, STATS, R, C, stride_rb, ktab, shift_t, shift_t2, TILES_PER_SPLIT,
               pid, split, WBYTES: tl.constexpr, FLOAT: tl.constexpr, BM: tl.constexpr,
               BC: tl.constexpr, FOLD_EVERY: tl.constexpr, V: tl.constexpr, ASM: tl.constexpr,
               REGS: tl.constexpr):
    """Rows ``[pid·BM, (pid+1)·BM)`` of column split ``split`` (column tiles ``[split ·
    TILES_PER_SPLIT, (split + 1) · TILES_PER_SPLIT)``) of ``XB`` (the ``uint8`` view, row stride
    ``stride_rb`` bytes), keys ``KT`` (int8 ``[16, ktab]``: signed 8-bit limbs of ``E[k]`` for
    ``B`` then ``B'``, at byte column ``k``). Split ``k`` writes its partial sums at
    ``ROWS[k]``/``STATS[k]``; the ``u − 128`` correction is added by split 0 only. Rows past ``R``
    read row ``R − 1`` and are not written."""
    rows = pid * BM + tl.arange(0, BM)
    rmask = rows < R
    BB: tl.constexpr = BC * WBYTES
    NCOL: tl.constexpr = 16
    offs = tl.minimum(rows, R - 1).to(tl.int64)[:, None] * stride_rb + tl.arange(0, BB)[None, :]
    koffs = tl.arange(0, NCOL)[:, None] * ktab + tl.arange(0, BB)[None, :]
    if FLOAT == 2:
        XT: tl.constexpr = tl.float32
    elif FLOAT == 1:
        XT: tl.constexpr = tl.float16
    else:
        XT: tl.constexpr = tl.bfloat16
    acc_t = tl.zeros([BM], tl.int64)
    acc_t2 = tl.zeros([BM], tl.int64)
    acc32 = tl.zeros([BM, NCOL], tl.int32)
    if V == 0:
        sq = tl.zeros([BM], tl.float64)
    else:
        sq = tl.zeros([BM, BC // V], tl.float64)
    mx = tl.full([BM, BC], float("-inf"), tl.float32).to(XT)  # (no bf16 constants in Triton's
    mn = tl.full([BM, BC], float("inf"), tl.float32).to(XT)  # interpreter)
    first = split * TILES_PER_SPLIT
    end = tl.minimum(first + TILES_PER_SPLIT, tl.cdiv(C, BC))
    full = tl.minimum(end, C // BC)  # tiles without columns past the row's end
    for chunk in range(first, full, FOLD_EVERY):
        for it in range(chunk, tl.minimum(chunk + FOLD_EVERY, full)):
            acc32, sq, mx, mn = _tile(XB + it * BB, KT + it * BB, offs, koffs, it * BC, C, acc32,
                                      sq, mx, mn, BM, BC, WBYTES, FLOAT, False, V, ASM, REGS)
        acc_t, acc_t2 = _fold_into(acc_t, acc_t2, acc32, 8, NCOL, 8)
        acc32 = tl.zeros([BM, NCOL], tl.int32)
    if (full < end) & (first <= full):  # the row's last tile, partly past its end
        acc32, sq, mx, mn = _tile(XB + full * BB, KT + full * BB, offs, koffs, full * BC, C, acc32,
                                  sq, mx, mn, BM, BC, WBYTES, FLOAT, True, V, ASM, REGS)
        acc_t, acc_t2 = _fold_into(acc_t, acc_t2, acc32, 8, NCOL, 8)
    if split == 0:
        acc_t = _modp(acc_t + shift_t)
        acc_t2 = _modp(acc_t2 + shift_t2)
    if V != 0:
        sq = tl.sum(sq, axis=1)
    bad = tl.zeros([BM], tl.int32)
    if tl.sum((~(tl.abs(sq) <= 1.7976931348623157e308) & rmask).to(tl.int32)) > 0:
        bad = _count_bad(XB, offs, C, first, end, BM, BC, WBYTES, FLOAT)
    out = split.to(tl.int64) * R + rows.to(tl.int64)
    tl.store(ROWS + out * 2, acc_t, mask=rmask)
    tl.store(ROWS + out * 2 + 1, acc_t2, mask=rmask)
    tl.store(STATS + out * 4, sq, mask=rmask)
    tl.store(STATS + out * 4 + 1, tl.max(mx.to(tl.float32), axis=1).to(tl.float64), mask=rmask)
    tl.store(STATS + out * 4 + 2, tl.min(mn.to(tl.float32), axis=1).to(tl.float64), mask=rmask)
    tl.store(STATS + out * 4 + 3, bad.to(tl.float64), mask=rmask)


# -- a producing kernel's tile ----------------------------------------------------------------------
@triton.jit
def _word_bytes(w, BM: tl.constexpr, BC: tl.constexpr, WBYTES: tl.constexpr):
    """``[BM, BC]`` words (uint16 or uint32) → ``uint8 [BM, BC · W]``, their bytes in memory
    order (little endian): the ``uint8`` view a row kernel reads."""
    b0 = (w & 0xFF).to(tl.uint8)
    b1 = ((w >> 8) & 0xFF).to(tl.uint8)
    if WBYTES == 2:
        u = tl.reshape(tl.join(b0, b1), [BM, BC * 2])
    else:
        b2 = ((w >> 16) & 0xFF).to(tl.uint8)
        b3 = ((w >> 24) & 0xFF).to(tl.uint8)
        # join appends its axis last: [.., j, i] holds pair i's element j, so pairs (b0, b2), (b1, b3)
        u = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [BM, BC * 4])
    return u


@triton.jit
def _tile_digest(y, col0, ok, KT, ktab, BM: tl.constexpr, BC: tl.constexpr, WBYTES: tl.constexpr,
                 SIGNED_COL0: tl.constexpr = False):
    """Digest v2's row terms of one tile of a tensor being written: ``y`` ``[BM, BC]`` the values
    as stored (bf16, fp16 or fp32: ``WBYTES`` 2 or 4) at element columns ``col0 + [0, BC)`` of
    their rows, of which those where ``ok`` (``[1, BC]`` bool) holds belong to the row (the others,
    past its end or padding: no term, not in the summary); ``KT`` kernel 2's key table (int8
    ``[16, ktab]``, ``gpu_rows._key_table``). ``SIGNED_COL0``: ``col0`` may be negative (the
    columns before 0 are outside ``ok``); their keys are not read.

    Returns per row: ``T``, ``T'`` of these columns (int64 in ``[0, p)``, without the ``u − 128``
    correction, which the row's first tile adds once for the whole row), Σx² (fp64), max and
    min ignoring NaN (fp32, exact) and the count of NaN/±inf (int32): kernel 2's arithmetic on
    the same bytes (one int8 product with the signed limbs), so integer sums equal to the row
    kernel's whatever the tiling. A caller with several tiles of the same rows may carry their
    limb sums instead and fold them once (``_tile_limbs``, ``_tile_summary``)."""
    acc32 = _tile_limbs(y, col0, ok, KT, ktab, tl.zeros([BM, 16], tl.int32), BM, BC, WBYTES, SIGNED_COL0)
    zero = tl.zeros([BM], tl.int64)
    t, t2 = _fold_into(zero, zero, acc32, 8, 16, 8)
    sq, mx, mn, bad = _tile_summary(y, ok)
    return t, t2, sq, mx, mn, bad


@triton.jit
def _tile_limbs(y, col0, ok, KT, ktab, acc32, BM: tl.constexpr, BC: tl.constexpr, WBYTES: tl.constexpr,
                SIGNED_COL0: tl.constexpr = False):
    """``acc32`` (int32 ``[BM, 16]``) plus the int8 product of a tile's shifted bytes and key limbs
    (``_tile_digest``'s arguments): its limb sums before their fold into T, T' (``_fold_into``).
    Each product is at most ``2**14`` in magnitude, so up to ``2**16`` byte columns add below
    ``2**30`` before a fold must run."""
    if WBYTES == 2:
        w = tl.where(ok, y.to(tl.uint16, bitcast=True), tl.full([1, BC], 0x8080, tl.uint16))
    else:
        w = tl.where(ok, y.to(tl.uint32, bitcast=True), tl.full([1, BC], 0x80808080, tl.uint32))
    s = (_word_bytes(w, BM, BC, WBYTES) ^ 0x80).to(tl.int8, bitcast=True)  # byte 128 (past C): 0
    BB: tl.constexpr = BC * WBYTES
    kcol = col0 * WBYTES + tl.arange(0, BB)
    if SIGNED_COL0:
        k = tl.load(KT + tl.arange(0, 16)[:, None] * ktab + kcol[None, :], mask=(kcol >= 0)[None, :], other=0)
    else:
        k = tl.load(KT + tl.arange(0, 16)[:, None] * ktab + kcol[None, :])
    return tl.dot(s, tl.trans(k), acc32, out_dtype=tl.int32)  # |term| <= 2**14


@triton.jit
def _tile_summary(y, ok):
    """The row summary's terms of a tile (``_tile_digest``'s arguments): Σx² (fp64), max and min
    ignoring NaN (fp32, exact) and the count of NaN/±inf (int32), over the columns where ``ok``
    holds."""
    x = y.to(tl.float32)
    xd = tl.where(ok, x.to(tl.float64), 0.0)
    real = ok & (x == x)
    mx = tl.max(tl.where(real, x, float("-inf")), axis=1)
    mn = tl.min(tl.where(real, x, float("inf")), axis=1)
    bad = tl.sum((ok & ~(tl.abs(x) <= 3.4028234663852886e38)).to(tl.int32), axis=1)
    return tl.sum(xd * xd, axis=1), mx, mn, bad


@triton.jit
def _tile_terms(y, col0, ok, KT, ktab, acc32, terms, BM: tl.constexpr, BC: tl.constexpr, WBYTES: tl.constexpr,
                SIGNED_COL0: tl.constexpr = False):
    """``_tile_digest`` of a tile added to a running sum over tiles of the same rows, without its
    fold: the limb sums go to ``acc32`` (``_tile_limbs``), the summary to ``terms``'s
    (``_tile_digest``'s tuple; its T, T' untouched). Returns both; ``_fold_terms`` folds the
    limbs into ``terms`` once at most ``2**16`` byte columns have been added (the same T, T': integer
    sums mod p; the summary added tile after tile as ``_add_terms`` adds it)."""
    acc32 = _tile_limbs(y, col0, ok, KT, ktab, acc32, BM, BC, WBYTES, SIGNED_COL0)
    sq, mx, mn, bad = _tile_summary(y, ok)
    return acc32, (terms[0], terms[1], terms[2] + sq, tl.maximum(terms[3], mx), tl.minimum(terms[4], mn),
                   terms[5] + bad)


@triton.jit
def _fold_terms(terms, acc32):
    """``terms`` (``_tile_digest``'s tuple) with the limb sums ``acc32`` (int32 ``[BM, 16]``)
    folded into its T, T'."""
    t, t2 = _fold_into(terms[0], terms[1], acc32, 8, 16, 8)
    return t, t2, terms[2], terms[3], terms[4], terms[5]


@triton.jit
def _add_terms(a, b):
    """Two sub-tiles' row terms of one row (``_tile_digest``'s tuple) added: T, T' mod p, Σx²,
    the max, the min and the count."""
    return (_modp(a[0] + b[0]), _modp(a[1] + b[1]), a[2] + b[2], tl.maximum(a[3], b[3]),
            tl.minimum(a[4], b[4]), a[5] + b[5])


@triton.jit
def _no_terms(BM: tl.constexpr):
    """The row terms of no column (``_tile_digest``'s tuple for ``BM`` rows): the start of a sum
    over tiles with ``_add_terms``."""
    sq, mx, mn, bad = _no_summary(BM)
    return tl.zeros([BM], tl.int64), tl.zeros([BM], tl.int64), sq, mx, mn, bad


@triton.jit
def _no_summary(BM: tl.constexpr):
    """The summary terms of no column (``_tile_summary``'s tuple for ``BM`` rows)."""
    return (tl.zeros([BM], tl.float64), tl.full([BM], float("-inf"), tl.float32),
            tl.full([BM], float("inf"), tl.float32), tl.zeros([BM], tl.int32))


@triton.jit
def _store_tile_digest(ROWS, STATS, rm, M, split, shift_t, shift_t2, terms):
    """Write one tile's row terms (``_tile_digest``'s tuple) as column split ``split`` of a row
    table (``ROWS`` int64 ``[S, M, 2]``, ``STATS`` float64 ``[S, M, 4]``: ``gpu_rows.row_table``'s
    format); split 0 adds the row's ``u − 128`` correction (``shift_t``, ``shift_t2``). Rows
    ``>= M`` are not written."""
    _store_rows_digest(ROWS, STATS, rm, rm < M, M, split, shift_t, shift_t2, terms)


@triton.jit
def _store_rows_digest(ROWS, STATS, rm, mask, M, split, shift_t, shift_t2, terms):
    """``_store_tile_digest`` of the rows ``rm`` where ``mask`` holds (the table has ``M`` rows)."""
    t, t2, sq, mx, mn, bad = terms
    if split == 0:
        t = _modp(t + shift_t)
        t2 = _modp(t2 + shift_t2)
    out = rm.to(tl.int64) + split * M  # split · M < 2**31: at most 2**16 rows of a table, a few splits
    tl.store(ROWS + out * 2, t, mask=mask)
    tl.store(ROWS + out * 2 + 1, t2, mask=mask)
    tl.store(STATS + out * 4, sq, mask=mask)
    tl.store(STATS + out * 4 + 1, mx.to(tl.float64), mask=mask)
    tl.store(STATS + out * 4 + 2, mn.to(tl.float64), mask=mask)
    tl.store(STATS + out * 4 + 3, bad.to(tl.float64), mask=mask)


# -- kernel 1 -------------------------------------------------------------------------------------
@triton.jit
def _rows_kernel_v1(X, XB, KEYS, ROWS, STATS, R, C, stride_r, stride_rb, shift_t, shift_t2,
                    TILES_PER_SPLIT, WBYTES: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
                    FOLD_EVERY: tl.constexpr, LIMBS: tl.constexpr, NCOL: tl.constexpr):
    """Kernel 1: the bytes through ``XB`` (one int8 product per tile over ``BC · WBYTES`` byte
    columns, 7-bit limbs ``KEYS [N · W, 32]`` in memory order), the values through the typed
    view ``X`` (the summary, elementwise accumulators); folds every ``FOLD_EVERY`` tiles."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid * BM + tl.arange(0, BM)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    kcol = tl.arange(0, NCOL)
    acc_t = tl.zeros([BM], tl.int64)
    acc_t2 = tl.zeros([BM], tl.int64)
    acc32 = tl.zeros([BM, NCOL], tl.int32)
    sq = tl.zeros([BM, BC], tl.float64)
    mx = tl.full([BM, BC], float("-inf"), tl.float32)
    mn = tl.full([BM, BC], float("inf"), tl.float32)
    bad = tl.zeros([BM, BC], tl.int32)
    nb = C * WBYTES
    first = split * TILES_PER_SPLIT
    for it in range(first, tl.minimum(first + TILES_PER_SPLIT, tl.cdiv(C, BC))):
        bcols = it * (BC * WBYTES) + tl.arange(0, BC * WBYTES)
        bmask = bcols < nb
        u = tl.load(XB + r64[:, None] * stride_rb + bcols[None, :],
                    mask=rmask[:, None] & bmask[None, :], other=128)
        s = (u ^ 0x80).to(tl.int8)  # u − 128 (the low byte of u xor 0x80, as int8)
        k = tl.load(KEYS + bcols[:, None] * NCOL + kcol[None, :], mask=bmask[:, None], other=0)
        acc32 = tl.dot(s, k, acc32, out_dtype=tl.int32)
        cols = it * BC + tl.arange(0, BC)
        m = rmask[:, None] & (cols < C)[None, :]
        x = tl.load(X + r64[:, None] * stride_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
        xd = x.to(tl.float64)
        sq += xd * xd  # masked elements load as 0.0: no term, and finite
        mx = tl.maximum(mx, tl.where(m, x, float("-inf")))
        mn = tl.minimum(mn, tl.where(m, x, float("inf")))
        bad += ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
        if (it + 1) % FOLD_EVERY == 0:
            acc_t, acc_t2 = _fold_into(acc_t, acc_t2, acc32, LIMBS, NCOL, 7)
            acc32 = tl.zeros([BM, NCOL], tl.int32)
    acc_t, acc_t2 = _fold_into(acc_t, acc_t2, acc32, LIMBS, NCOL, 7)
    if split == 0:
        acc_t = _modp(acc_t + shift_t)
        acc_t2 = _modp(acc_t2 + shift_t2)
    out = split.to(tl.int64) * R + r64
    tl.store(ROWS + out * 2, acc_t, mask=rmask)
    tl.store(ROWS + out * 2 + 1, acc_t2, mask=rmask)
    tl.store(STATS + out * 4, tl.sum(sq, axis=1), mask=rmask)
    tl.store(STATS + out * 4 + 1, tl.max(mx, axis=1).to(tl.float64), mask=rmask)
    tl.store(STATS + out * 4 + 2, tl.min(mn, axis=1).to(tl.float64), mask=rmask)
    tl.store(STATS + out * 4 + 3, tl.sum(bad, axis=1).to(tl.float64), mask=rmask)


@triton.jit
def _gather_kernel(tab_ptr, item_ptr, t_out, s_out, BLOCK: tl.constexpr):
    """Up to ``BLOCK`` rows of one row table, its column splits combined (program ``i``: item
    ``i`` of ``gpu_rows.gather_rows``'s plan). ``item_ptr``: ``int64 [n, 4]``, (table, first
    row, first output row, rows <= BLOCK); ``tab_ptr``: ``int64 [tables, 4]``, (address of the
    rows ``int64 [S, R, 2]``, address of the stats ``float64 [S, R, 4]``, ``R``, ``S``), both
    contiguous. Writes ``t_out`` ``int64 [total, 2]``: T, T' summed mod p; ``s_out`` ``float64
    [total, 4]``: Σx² and the count added split after split (``((s0 + s1) + s2) + …``), max and
    min as torch's NaN-propagating ``max``/``min`` taken split after split (a NaN stays; ties
    keep the earlier split's value)."""
    i = tl.program_id(0)
    tab = tl.load(item_ptr + 4 * i)
    src = tl.load(item_ptr + 4 * i + 1)
    dst = tl.load(item_ptr + 4 * i + 2)
    n = tl.load(item_ptr + 4 * i + 3)
    rows_ptr = tl.load(tab_ptr + 4 * tab).to(tl.pointer_type(tl.int64))
    stats_ptr = tl.load(tab_ptr + 4 * tab + 1).to(tl.pointer_type(tl.float64))
    r = tl.load(tab_ptr + 4 * tab + 2)  # the split stride, in rows
    splits = tl.load(tab_ptr + 4 * tab + 3)
    k = tl.arange(0, BLOCK)
    c2 = tl.arange(0, 2)[None, :]
    c4 = tl.arange(0, 4)[None, :]
    m2 = (k < n)[:, None] & (c2 < 2)  # [BLOCK, 2]
    m4 = (k < n)[:, None] & (c4 < 4)  # [BLOCK, 4]
    row = (src + k)[:, None]  # [BLOCK, 1] int64: the row in split 0
    t = tl.load(rows_ptr + row * 2 + c2, mask=m2, other=0)  # [BLOCK, 2], each < p
    st = tl.load(stats_ptr + row * 4 + c4, mask=m4, other=0.0)  # [BLOCK, 4]
    for s in range(1, splits):
        # reduced after each split (a sum below 2**62): exact for any S
        t = _modp(t + tl.load(rows_ptr + (row + s * r) * 2 + c2, mask=m2, other=0))
        x = tl.load(stats_ptr + (row + s * r) * 4 + c4, mask=m4, other=0.0)
        keep_mx = (st >= x) | (st != st)
        keep_mn = (st <= x) | (st != st)
        st = tl.where(c4 == 1, tl.where(keep_mx, st, x),
                      tl.where(c4 == 2, tl.where(keep_mn, st, x), st + x))
    out = (dst + k)[:, None]
    tl.store(t_out + out * 2 + c2, t, mask=m2)
    tl.store(s_out + out * 4 + c4, st, mask=m4)


@triton.jit
def _level2_kernel(t_ptr, keys_ptr, start_ptr, len_ptr, out_ptr, nkeys, nrec, BLOCK: tl.constexpr):
    """Level 2's limb products of one record (program ``r``), summed over its rows: ``out[3i + j,
    r] = Σ_k Σ_h A_h,i[k] · limb_j(T_h[start + k])`` for ``k < len`` (``digest_rows.RowTables``).
    ``t_ptr``: ``int64 [total, 2]`` (T, T' of the records' rows, in record order); ``keys_ptr``:
    ``int64 [2, 3, nkeys]`` row-key limbs. Each product is below ``2**43`` and a record has at most
    ``2**16`` rows, so the int64 sums are exact (below ``2**59``) in any order."""
    r = tl.program_id(0)
    start = tl.load(start_ptr + r)
    n = tl.load(len_ptr + r)
    offs0 = tl.arange(0, BLOCK)
    lim = tl.arange(0, 4)  # limb index i (of the keys) or j (of T): 3 used, padded to 4
    shift = (21 * lim)[:, None]
    acc = tl.zeros([4, 4, BLOCK], tl.int64)  # [i, j, k]
    for k in range(0, n, BLOCK):
        offs = k + offs0
        m = offs < n
        row = (start + offs).to(tl.int64)
        t0 = tl.load(t_ptr + 2 * row, mask=m, other=0)
        t1 = tl.load(t_ptr + 2 * row + 1, mask=m, other=0)
        km = (lim[:, None] < 3) & m[None, :]
        a0 = tl.load(keys_ptr + lim[:, None] * nkeys + offs[None, :], mask=km, other=0)  # [4, BLOCK]
        a1 = tl.load(keys_ptr + (3 + lim[:, None]) * nkeys + offs[None, :], mask=km, other=0)
        l0 = (t0[None, :] >> shift) & ((1 << 21) - 1)  # [4, BLOCK]: limb 3 of T < p is 0
        l1 = (t1[None, :] >> shift) & ((1 << 21) - 1)
        acc += a0[:, None, :] * l0[None, :, :] + a1[:, None, :] * l1[None, :, :]
    u = tl.sum(acc, axis=2)  # [4, 4]
    q = lim[:, None] * 3 + lim[None, :]
    tl.store(out_ptr + q * nrec + r, u, mask=(lim[:, None] < 3) & (lim[None, :] < 3))
