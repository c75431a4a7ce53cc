"""Compile the strict CUDA attention kernels (forward and backward) for sm_90 without a GPU and
print each one's shared memory, registers and spill stack; check that writing the backward's row
states adds no floating-point instruction to the forward, and that digesting the forward's output
where it is written (``attention(..., digest=True)``) spills no more and fits a block's shared
memory. For the launch that digests the scores and probabilities (``internals``) it prints the
largest key-block loop's instructions a block (SASS instructions a thread × warps) beside the plain
launch's: an offline measure of what digesting them costs the issue slots.

    $ python tools/strict_cuda_sm90.py            # bf16, head dims 128, 64, 32, 16
    $ python tools/strict_cuda_sm90.py --fp32     # FP32 operands too (slow: minutes)

    fwd      bf16 Dh128 mask  smem 229376  REG:231 STACK:0
    dkv      bf16 Dh128 mask  smem 181760  REG:255 STACK:0
    ...

A developer tool of the source tree (Triton's ``ASTSource`` → ``triton.compile`` for
``GPUTarget("cuda", 90, 128)``, with the ptxas and cuobjdump Triton ships), not part of the
installed package. Exits 1 when a compile fails or the forward's floating-point instructions
differ with the row states written.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

import triton
from triton.compiler import ASTSource

from drifttool.ops.strict_cuda.kernels import attention as fwd
from drifttool.ops.strict_cuda.kernels import attention_backward as bwd
from strict_launches_sm90 import SMEM_LIMIT, TARGET, loop_instructions, usage  # the same target and resource reading


FLOAT_OPS = re.compile(r"^\s*((?:fma|mul|add|sub|max|min|ex2|div|rcp|neg|cvt)\.\S*f(?:32|16)\S*|wgmma\S*)")


def _compile(fn, ptrs: dict, consts: dict, warps: int, stages: int):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name], attrs[(i,)] = ptrs[name], [["tt.divisibility", 16]]
        else:
            sig[name] = {"sm_scale": "fp32", "shift_t": "i64", "shift_t2": "i64"}.get(name, "i32")
            if re.fullmatch(r"s[a-z]{1,2}[0-9a-z]?", name) and name != "smb":  # a tensor's strides: multiples
                attrs[(i,)] = [["tt.divisibility", 16]]  # of 16 at the model's shapes, as Triton specialises
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages,
                                                             enable_fp_fusion=False))


def _usage(kernel) -> str:
    reg, stack = usage(kernel)
    return f"REG:{reg} STACK:{stack}"


def _digest_costs(base, dig) -> str:
    """What the digest costs that a device would feel, or '': shared memory over a block's or
    beyond the launch's without it (its pipelining changed), spills where there were none, or
    more than 64 bytes of spills added (the launch without it already spills: the epilogue's
    few extra spills are outside the key loops)."""
    if dig.metadata.shared > SMEM_LIMIT or dig.metadata.shared != base.metadata.shared:
        return "SHARED MEMORY CHANGED OR OVER A BLOCK'S"
    if (_stack(base) == 0 and _stack(dig) > 0) or _stack(dig) > _stack(base) + 64:
        return "SPILLS ADDED"
    return ""


def _stack(kernel) -> int:
    """Spill stack bytes per thread."""
    return usage(kernel)[1]


def _float_ops(kernel) -> Counter:
    return Counter(m.group(1) for line in kernel.asm["ptx"].splitlines() if (m := FLOAT_OPS.match(line)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp32", action="store_true", help="also FP32 operands (IEEE FMA dots: slow to compile)")
    args = ap.parse_args(argv)
    ok = True
    for dt in ("bf16", "fp32") if args.fp32 else ("bf16",):
        p, ieee = f"*{dt}", dt == "fp32"
        ptrs = dict(Q=p, K=p, V=p, O=p, DO=p, DQ=p, DK=p, DV=p, Y=p, X="*fp32", ML="*fp32", DELTA="*fp32",
                    MASK="*u8", IMG_FULL="*i32", KEYS="*i8", DR="*i64", DS="*fp64", IK="*i8", SDR="*i64",
                    SDS="*fp64", PDR="*i64", PDS="*fp64", ISHIFT="*i64", T0="*i32", NV="*i32")
        f_rows, f_w, f_s, *_ = fwd.CONFIG_FP32 if ieee else fwd.CONFIG
        dkv = bwd.DKV_CONFIG_FP32 if ieee else bwd.DKV_CONFIG
        dq = bwd.DQ_CONFIG_FP32 if ieee else bwd.DQ_CONFIG
        for dh in (128, 16) if ieee else (128, 64, 32, 16):
            for mask in (True, False):
                c = dict(HEAD_DIM=dh, HAS_MASK=mask)
                tag = f"{dt} Dh{dh} {'mask' if mask else 'none'}"
                fc = dict(c, BLOCK_M=f_rows, BLOCK_N=fwd.BLOCK_N, MODE=fwd.MODE_FUSED, IEEE=ieee, TMA=False,
                          DIGEST=False, WBYTES=4 if ieee else 2, INTERNALS=False)
                plain = _compile(fwd._attn_kernel, ptrs, dict(fc, STORE_ML=False, ML=None), f_w, f_s)
                stats = _compile(fwd._attn_kernel, ptrs, dict(fc, STORE_ML=True), f_w, f_s)
                same = _float_ops(plain) == _float_ops(stats)
                ok &= same
                print(f"fwd      {tag}  smem {plain.metadata.shared:6d}  {_usage(plain)}  "
                      f"row states: {'same float ops' if same else 'FLOAT OPS DIFFER'}")
                if dh * (4 if ieee else 2) >= 16:  # the output digested where it is written
                    for tma in (False, True) if not ieee else (False,):
                        tptrs = dict(ptrs, KD=f"tensordesc<{dt}[{fwd.BLOCK_N},{dh}]>",
                                     VD=f"tensordesc<{dt}[{fwd.BLOCK_N},{dh}]>") if tma else ptrs
                        base = _compile(fwd._attn_kernel, tptrs, dict(fc, STORE_ML=False, ML=None, TMA=tma), f_w, f_s)
                        dig = _compile(fwd._attn_kernel, tptrs, dict(fc, STORE_ML=False, ML=None, TMA=tma,
                                                                     DIGEST=True), f_w, f_s)
                        grew = _digest_costs(base, dig)
                        ok &= not grew
                        print(f"fwd{'+tma' if tma else '    '}+dig {tag}  smem {dig.metadata.shared:6d}  {_usage(dig)}"
                              f"  (without: {base.metadata.shared}, {_usage(base)}){'  ' + grew if grew else ''}")
                    # L2: the scores and probabilities digested in pass 2 (never stored); a new
                    # launch (pointer loads), reported and checked against a block's shared memory
                    i_rows, i_w, i_s, _ = fwd.CONFIG_FP32 if ieee else fwd.INTERNALS_CONFIG
                    internals = _compile(fwd._attn_kernel, ptrs, dict(fc, BLOCK_M=i_rows, STORE_ML=False, ML=None,
                                                                      DIGEST=True, INTERNALS=True), i_w, i_s)
                    over = internals.metadata.shared > SMEM_LIMIT
                    ok &= not over
                    print(f"fwd+int  {tag}  smem {internals.metadata.shared:6d}  {_usage(internals)}"
                          f"{'  OVER A BLOCK' + chr(39) + 'S SHARED MEMORY' if over else ''}")
                    if not ieee:  # the key-block loops' issue slots, with the internals and without
                        per_block = [loop_instructions(k)[0] * w for k, w in ((plain, f_w), (internals, i_w))]
                        print(f"         {tag}  largest key-block loop: {per_block[1]} warp instructions with the "
                              f"internals, {per_block[0]} without ({per_block[1] / per_block[0]:.1f}x)")
                for name, fn, cfg, extra in (("dkv", bwd._dkv_kernel, dkv, dict(BLOCK_N=bwd.BLOCK_N, IEEE=ieee)),
                                             ("dq", bwd._dq_kernel, dq, dict(BLOCK_N=bwd.BLOCK_N, IEEE=ieee)),
                                             ("delta", bwd._delta_kernel, dq, dict(LOG2_DH=dh.bit_length() - 1))):
                    k = _compile(fn, ptrs, dict(c, BLOCK_M=cfg[0], **extra), cfg[1], cfg[2] if name != "delta" else 1)
                    print(f"{name:<8} {tag}  smem {k.metadata.shared:6d}  {_usage(k)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
