"""Compile the strict CUDA GEMM's launches and the row operators' digesting launches for sm_90
without a GPU, and check what a GPU would refuse or run slowly.

    $ python tools/strict_launches_sm90.py
    bf16 GEMM → bf16 (q, k, v, to_out, mlp_down)  plain   bm128bn256w8s3.tma.p1  smem 151576  REG:218 STACK:0
    bf16 GEMM → bf16 (q, k, v, to_out, mlp_down)  plain   bm128bn256w8s3.tma     smem 147480  REG:164 STACK:0
    bf16 GEMM → bf16 (q, k, v, to_out, mlp_down)  digest  bm128bn256w8s3.tma     smem 147480  REG:240 STACK:0
    ...

Each launch the strict operators make (``drifttool.ops.strict_cuda.linear``: the registered
``GemmConfig`` per operand precision, the GELU's register cap, the unfused adapter's FP32 merge)
is compiled by Triton's ``ASTSource`` → ``triton.compile`` for ``GPUTarget("cuda", 90, 128)``
with the ptxas and cuobjdump Triton ships. Exits 1 when a compile fails, a launch needs more
shared memory than an H100/H200 block may have (232,448 bytes: Triton refuses it at the first
call on the device), or the digest changes a launch's shared memory (its software pipelining
lost) or spills more than the launch without it, or a row operator's digesting launch (the gate
residual's, the rotation's, the head-wise RMSNorm's, the LayerNorm's) spills. A developer tool of the source
tree (run with ``TRITON_INTERPRET`` unset); ``tests/ops/test_strict_launches_sm90.py`` runs it.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from drifttool.ops.strict_cuda.kernels import elementwise, gemm, narrow, norms  # noqa: E402
from drifttool.ops.strict_cuda.kernels.exact_math import ACTS  # noqa: E402

TARGET = GPUTarget("cuda", 90, 128)
SMEM_LIMIT = 232_448
"""Shared memory one block may use on sm_90 (H100/H200), in bytes."""
_BF16, _FP32 = "bf16", "fp32"
CALLS = [
    # what calls gemm.linear: (x, w, y) dtypes, activation, merge, the config it passes, digested
    ("bf16 GEMM → bf16 (q, k, v, to_out, mlp_down)", (_BF16, _BF16, _BF16), None, False, None, True),
    ("mlp_up: bf16, FP32 GELU, 128 registers", (_BF16, _BF16, _BF16), "gelu_tanh_f32", False,
     gemm.GemmConfig(maxnreg=128), True),
    ("bf16 GEMM → FP32 (an adapter's base pre)", (_BF16, _BF16, _FP32), None, False, None, False),
    ("adapter up-projection merged → bf16", (_FP32, _FP32, _BF16), None, True, None, True),
    ("adapter up-projection merged, GELU → bf16", (_FP32, _FP32, _BF16), "gelu_tanh_f32", True,
     gemm.MERGE_ACT_CONFIG, True),
    ("adapter up-projection merged → FP32 (backward)", (_FP32, _FP32, _FP32), None, True, None, False),
    ("lora_merge B·A merged into W", (_FP32, _FP32, _FP32), None, True, gemm.LORA_CONFIG, False),
]
"""The launches of ``drifttool.ops.strict_cuda.linear``: ``gemm.linear`` picks each one's
configuration (``registered_config``) and kernel (``persists``) as it would on the device."""

_TORCH = {_BF16: torch.bfloat16, _FP32: torch.float32}


def compile_launch(cfg: gemm.GemmConfig, dtypes: tuple[str, str, str], act: str | None, merge: bool,
                   digest: bool, one_per_tile: bool = False):
    """The launch ``gemm.linear`` would make for these operands (TMA where the operands allow it:
    bf16 × bf16 at the model's aligned shapes), compiled for sm_90; ``one_per_tile``: its
    one-program-per-tile kernel even where it would run persistent programs."""
    x, w, y = dtypes
    ieee = _FP32 in (x, w)
    tma = cfg.tma and not ieee
    persistent = gemm.persists(cfg, tma, act, digest) and not one_per_tile
    fn = gemm._linear_persistent_kernel if persistent else gemm._linear_kernel
    consts = dict(HAS_BIAS=True, ACT=ACTS[act], IEEE=ieee, MERGE=merge, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=gemm.CHUNK, GROUP_M=cfg.group_m)
    if not persistent:
        consts.update(TMA=tma, EVEN_K=True, DIGEST=digest, WBYTES=4 if y == _FP32 else 2)
    types = dict(X=f"tensordesc<{x}[{cfg.block_m},{gemm.CHUNK}]>" if tma else f"*{x}",
                 W=f"tensordesc<{w}[{cfg.block_n},{gemm.CHUNK}]>" if tma else f"*{w}",
                 B="*bf16", Y=f"*{y}", R="*fp32", DK="*i8", DR="*i64", DS="*fp64", scale="fp32",
                 shift_t="i64", shift_t2="i64")
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        sig[name] = "constexpr" if name in consts else types.get(name, "i32")
        if sig[name].startswith("*") or name in ("sxm", "swn", "sym", "srm"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # aligned bases and row strides, as Triton specialises
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET, options=opts)
    return kernel, cfg.id if persistent else replace(cfg, persistent=0).id


ROW_LAUNCHES = [
    # name, kernel, argument types (the rest i32), constants
    ("gate residual, digesting", elementwise._gate_residual_tile_kernel,
     dict(x_ptr="*bf16", g_ptr="*bf16", y_ptr="*bf16"), dict(BM=elementwise.TILE[0], BC=elementwise.TILE[1])),
    ("rotation, digesting", elementwise._rope_tile_kernel, dict(x_ptr="*bf16", f_ptr="*fp32"),
     dict(BM=elementwise.TILE[0], BC=elementwise.TILE[1])),
    ("qk RMSNorm (Dh 128), digesting", norms._rms_heads_kernel,
     dict(x_ptr="*bf16", gain_ptr="*bf16", eps_ptr="*fp64"), dict(D=128, LOG2=7, BM=norms.HEADS_ROWS)),
    ("modulated LayerNorm (d 3072), digesting", norms._ln_digest_kernel,
     dict(x_ptr="*bf16", shift_ptr="*bf16", scale_ptr="*bf16", eps_ptr="*fp64"),
     dict(D=3072, NT_LOG2=2, TLOG2=10, BM=norms.LN_DIGEST[0], BC=norms.LN_DIGEST[1])),
]


def compile_narrow(x: str):
    """The rank-wide GEMM's segment launch (``kernels.narrow``: u = x·Aᵀ with x ``x``, du = dt·B with
    dt FP32) for sm_90, at its registered tile."""
    fn, cfg = narrow._parts_kernel, narrow.CONFIG
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=gemm.CHUNK)
    types = dict(X=f"*{x}", W="*fp32", P="*fp32")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False))


def compile_row_launch(fn, types: dict[str, str], consts: dict, out: str):
    """A row operator's digesting launch (``kernels.elementwise``, ``kernels.norms``) for an
    ``out`` output, at 4 warps (``kernels.rows._launch``; the LayerNorm's ``LN_DIGEST``)."""
    consts = dict(consts, WBYTES=4 if out == _FP32 else 2)
    if fn is norms._ln_digest_kernel and out == _FP32:
        consts["BC"] //= 2  # as ln_modulation launches it
    types = dict(types, o_ptr=f"*{out}", KT="*i8", DR="*i64", DS="*fp64", shift_t="i64", shift_t2="i64")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                          options=dict(num_warps=norms.LN_DIGEST[2] if fn is norms._ln_digest_kernel else 4,
                                       num_stages=1, enable_fp_fusion=False))


def usage(kernel) -> tuple[int, int]:
    """(registers, spill stack bytes) per thread, by the cuobjdump Triton ships."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if not found:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out[-200:]}")
    return int(found.group(1)), int(found.group(2))


def loop_instructions(kernel) -> list[int]:
    """The SASS instructions of each loop body of ``kernel`` (a backward branch's span, by the
    nvdisasm Triton ships), largest first: per thread and iteration, an offline measure of what a
    loop costs the issue slots (not a timing)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-c", f.name], capture_output=True, text=True).stdout
    labels, branches, n = {}, [], 0
    for line in text.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = n
        elif re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+\S", line):
            target = re.search(r"\bBRA\b.*?(\.L_x_\d+)", line)
            if target:
                branches.append((n, target.group(1)))
            n += 1
    return sorted((at - labels[t] + 1 for at, t in branches if t in labels and labels[t] <= at), reverse=True)


def _fits(name: str, what: str, launch: str, compile_fn) -> bool:
    """Compile one launch, print its resources; False if it fails to compile, needs more shared
    memory than a block has or spills."""
    try:
        k = compile_fn()
    except Exception as e:  # noqa: BLE001 - a refused compile is the finding
        print(f"{name:48} {what:6}  FAILED {type(e).__name__}: {str(e)[:200]}")
        return False
    reg, stack = usage(k)
    bad = k.metadata.shared > SMEM_LIMIT or stack > 0
    print(f"{name:48} {what:6}  {launch:32} smem {k.metadata.shared:6d}  REG:{reg} STACK:{stack}"
          f"{'  spills or too much shared memory' if bad else ''}")
    return not bad


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("strict_launches_sm90.py: unset TRITON_INTERPRET (the interpreter compiles nothing)")
        return 1
    ok = True
    for name, dtypes, act, merge, config, digested in CALLS:
        x, w, y = (_TORCH[d] for d in dtypes)
        cfg = config or gemm.registered_config(x, w, y, merge)
        seen: dict[tuple[str, bool], tuple[int, int]] = {}
        variants = [(False, False)]
        if digested and gemm.digestible(cfg, y):  # the digest beside the same kernel without it
            variants += [(False, True), (True, True)] if gemm.persists(cfg, True, act, False) else [(True, False)]
        for digest, one_per_tile in variants:
            what = "digest" if digest else "plain"
            try:
                kernel, launch = compile_launch(cfg, dtypes, act, merge, digest, one_per_tile)
            except Exception as e:  # noqa: BLE001 - a refused compile is the finding
                print(f"{name:48} {what:6}  FAILED {type(e).__name__}: {str(e)[:200]}")
                ok = False
                continue
            reg, stack = usage(kernel)
            smem = kernel.metadata.shared
            seen[(launch, digest)] = (smem, stack)
            over = smem > SMEM_LIMIT
            ok &= not over
            print(f"{name:48} {what:6}  {launch:32} smem {smem:6d}  REG:{reg} STACK:{stack}"
                  f"{'  > a block' + chr(39) + 's shared memory' if over else ''}")
        for (launch, digest), (smem, stack) in seen.items():
            plain = seen.get((launch, False))
            if digest and plain and (smem != plain[0] or stack > plain[1]):
                print(f"{name:48} the digest changed shared memory {plain[0]} → {smem} or spills "
                      f"{plain[1]} → {stack} bytes")
                ok = False
    for x in (_BF16, _FP32):
        ok &= _fits(f"rank-wide segment (u = x·Aᵀ, du = dt·B), x {x}", "plain", narrow.CONFIG.id,
                    lambda x=x: compile_narrow(x))
    for name, kernel, types, consts in ROW_LAUNCHES:
        for out in (_BF16, _FP32):
            ok &= _fits(f"{name} → {out}", "digest", f"rows {consts['BM']}",
                        lambda kernel=kernel, types=types, consts=consts, out=out:
                        compile_row_launch(kernel, types, consts, out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
