"""Backward of every differentiable operator: accuracy of the strict and production gradients
against the independent FP64 reference (``drifttool.references.ops.vjp``), raw-byte invariance of
the strict gradients, and the strict MMDiT's backward.

    $ python -m pytest tests/ops/test_backward.py -q
    $ python -m tests.ops.test_backward --measure --all-dtypes [--json stats.json]   # re-measure

Criterion (references/tolerances.json, section ``backward``): elementwise
|c − r| ≤ atol + rtol·|r| per gradient, c = the backend's gradient in its input's dtype, r = the
reference vjp on the same inputs and the same output gradient. ``latent_pack_unpack`` is a
permutation and must equal the reference bit for bit.

Invariance scopes (docs/strict-arithmetic.md, "Backward"):

* per-sample gradients (dX, and the gradients of per-sample inputs such as shift/scale/gate/temb)
  are byte-invariant to batch size, batch position, row count and prompt padding;
* parameter gradients (dW, db, gains) are the pairwise tree over samples of per-sample partials:
  the bytes of a batch equal ``tree_sum_stack`` of the per-sample (batch-1) gradients, are the same
  under tree automorphisms of the sample order (swapping aligned halves), and unchanged by
  trailing zero-gradient (padded) rows. Arbitrary reorderings of samples or rows are out of scope.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

import drifttool.ops  # noqa: F401
import drifttool.ops.production  # noqa: F401
from drifttool.ops.registry import implementation
from tests.harness import Target, targets, to_cpu, to_device
from drifttool.ops.strict_math import TreeAccumulator, tree_sum_stack
from drifttool.references import ops as ref
from tests.conftest import assert_same_bytes
from tests.ops.test_reference_accuracy import (
    BACKENDS, CASES, DTYPES, TARGETS, TOLERANCES, _joint_mask, _rn, _seed, assert_bytes_equal_reference,
    assert_within, error_stats,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Run this module on one intra-op thread. Its many small operations each open an OpenMP
    region; on a loaded 2-core machine every region waits for the other core (8-20 ms each), which
    made the module 5× slower at 2 threads. Bytes do not depend on the thread count
    (``test_gradients_do_not_depend_on_the_thread_count``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# cases: the forward cases of test_reference_accuracy plus the two differentiable sampler rows

DIFF_ARGS = {  # positional inputs that get a gradient (others: masks, tables, ints, τ)
    "latent_pack_unpack": (0,),
    "latent_normalize": (0,),  # mean/std are the VAE's constants
    "latent_proj_gemm": (0, 1, 2),
    "txt_in_rmsnorm_linear": (0, 1, 2, 3),
    "timestep_embed_mlp": (1, 2, 3, 4),  # τ is not differentiated (phases pinned in FP32)
    "adaln_mod_projection": (0, 1, 2),
    "adaln_modulation": (0, 1, 2),
    "adaln_gate_residual": (0, 1, 2),
    "qkv_bias_gemm": (0, 1, 2, 3, 4, 5, 6),
    "qk_rmsnorm": (0, 1),
    "multi_axis_rope": (0,),
    "joint_attn_qk_gemm": (0, 1),
    "joint_attn_softmax": (0,),
    "joint_attn_av_gemm": (0, 1),
    "joint_attention_fused": (0, 1, 2),
    "attn_out_bias_gemm": (0, 1, 2),
    "mlp_up_gemm_gelu": (0, 1, 2),
    "mlp_down_gemm": (0, 1, 2),
    "final_adaln_out": (0, 1, 2, 3),
    "cfg_combine_renorm": (0, 1),
    "flow_sde_step_logp": (0, 1),
}

# 6905² attention scores through three FP64 backward passes: ~75 s on the 2-core CI machine.
# The forward test keeps that case; the backward covers 6889 rows with the row-wise operators.
TOO_SLOW = {"joint_attention_fused[real_n6889_l16_valid7_h1]"}


@dataclass(frozen=True)
class BwdCase:
    """One operator call with its output gradient: ``make(dtype, g)`` → (args, kwargs);
    ``outs`` the indices of the outputs that carry a gradient (None: all)."""

    op: str
    label: str
    make: Callable
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    outs: tuple[int, ...] | None = None

    @property
    def id(self) -> str:
        return f"{self.op}[{self.label}]"


def _sigmas():
    from drifttool.ops.scheduler import flow_sigma_table

    return flow_sigma_table(10, 1024)


def _sampler_cases() -> list[BwdCase]:
    C = []

    def cfg(b, n):
        def make(dt, g):
            c = _rn(g, b, n, 64).to(dt)
            return (c, (c * 0.6 + 0.5 * _rn(g, b, n, 64)).to(dt), 4.0), {}
        return make

    C.append(BwdCase("cfg_combine_renorm", "b3_n15", cfg(3, 15)))
    C.append(BwdCase("cfg_combine_renorm", "real_n4096", cfg(1, 4096)))

    def sde(b, n, step, mode):
        def make(dt, g):
            sig = _sigmas()
            v, x = _rn(g, b, n, 64).to(dt), _rn(g, b, n, 64).to(dt)
            kw = {"eta": 0.0 if mode == "euler" else 1.2, "sigma_max": sig[1]}
            if mode == "sample":
                kw["noise"] = _rn(g, b, n, 64)
            elif mode == "replay":
                kw["prev_sample"] = (x.float() + 0.1 * _rn(g, b, n, 64)).to(dt)
            return (v, x, sig[step], sig[step + 1]), kw
        return make

    C.append(BwdCase("flow_sde_step_logp", "sample_b3_n15_step0", sde(3, 15, 0, "sample"), outs=(1, 2)))
    C.append(BwdCase("flow_sde_step_logp", "replay_b2_n15_step4", sde(2, 15, 4, "replay"), outs=(1, 2)))
    C.append(BwdCase("flow_sde_step_logp", "euler_b2_n15_step9", sde(2, 15, 9, "euler"), outs=(2,)))
    C.append(BwdCase("flow_sde_step_logp", "real_replay_n6889_step2", sde(1, 6889, 2, "replay"), outs=(1, 2)))
    return C


# Real-geometry cases run in FP32 only (bf16 on the synthetic cases): the bf16 real cases were
# measured for the tolerances too (--measure --all-dtypes) but double the file's run time.
BWD_CASES = [BwdCase(c.op, c.label, c.make, c.dtypes) for c in CASES if c.id not in TOO_SLOW]
BWD_CASES += _sampler_cases()
ALL_DTYPES = "--all-dtypes" in sys.argv
if not ALL_DTYPES:
    BWD_CASES = [c if "real" not in c.label else BwdCase(c.op, c.label, c.make, ("float32",), c.outs)
                 for c in BWD_CASES]
REF_FNS = {**ref.OPS, **ref.SAMPLER_OPS}


def _grad_outputs(outs: tuple[torch.Tensor, ...], g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]


def backend_grads(fn, args, kwargs, diff, outs_sel, gos=None, g=None):
    """(gradients of the ``diff`` inputs, output gradients) of one backend call."""
    leaves = [a.detach().clone().requires_grad_(True) if i in diff else a for i, a in enumerate(args)]
    out = fn(*leaves, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    outs = tuple(outs[i] for i in outs_sel) if outs_sel is not None else outs
    if gos is None:
        gos = _grad_outputs(outs, g)
    grads = torch.autograd.grad(outs, [leaves[i] for i in diff], gos, allow_unused=True)
    return grads, gos


@functools.lru_cache(maxsize=1)
def _case_data(case_id: str, dtype_name: str):
    """Inputs, output gradients and FP64 reference gradients of one (case, dtype); the output
    gradients come from the reference's outputs (the same for both backends)."""
    case = next(c for c in BWD_CASES if c.id == case_id)
    g = torch.Generator().manual_seed(_seed(case))  # type: ignore[arg-type]
    args, kwargs = case.make(DTYPES[dtype_name], g)
    fn = REF_FNS[case.op]
    sel = case.outs

    def ref_fn(*a, **k):
        out = fn(*a, **k)
        outs = out if isinstance(out, tuple) else (out,)
        outs = tuple(outs[i] for i in sel) if sel is not None else outs
        return outs if len(outs) > 1 else outs[0]

    strict_out = implementation(case.op, "strict")(*args, **kwargs)
    souts = strict_out if isinstance(strict_out, tuple) else (strict_out,)
    souts = tuple(souts[i] for i in sel) if sel is not None else souts
    gos = _grad_outputs(souts, g)
    r = ref.vjp(ref_fn, args, gos if len(gos) > 1 else gos[0], **kwargs)
    return args, kwargs, gos, r


def run_backward(case: BwdCase, target: Target, dtype_name: str):
    """[(input index, target gradient on the CPU, reference gradient)] of one (case, target,
    dtype): the inputs and output gradients are made on the CPU and moved to the target's device."""
    fn = target.impl(case.op)
    args, kwargs, gos, r = _case_data(case.id, dtype_name)
    diff = DIFF_ARGS[case.op]
    dev = target.device
    grads, _ = backend_grads(fn, to_device(args, dev), to_device(kwargs, dev), diff, case.outs, to_device(gos, dev))
    grads = to_cpu(grads)
    res = []
    for i, gr in zip(diff, grads):
        want = r[i]
        if gr is None:
            gr = torch.zeros_like(args[i])
        if case.op == "joint_attn_av_gemm" and target.family == "production" and i == 0 and args[2] is not None:
            # production's AV treats the mask as validation only: its probability gradient at a
            # masked key is dO·v_j (unused: the softmax backward multiplies it by P = 0). The
            # contract (and strict, and the reference) zero the masked values, hence +0 there.
            gr = gr.masked_fill(~args[2][:, None, None, :], 0.0)
        res.append((i, gr, want))
    return res


def backward_tolerance(op: str, backend: str, dtype_name: str) -> dict:
    return TOLERANCES["backward"]["ops"][op][backend][dtype_name]


SLOW = {"adaln_mod_projection[real_b2]-float32-strict-cpu", "mlp_up_gemm_gelu[real_s64]-float32-strict-cpu",
        "mlp_down_gemm[real_s64]-float32-strict-cpu", "adaln_modulation[real_s6889]-float32-strict-cpu"}
"""6–9 s each on 2 cores: in the slow set (these operators' small strict cases and their full-width
production cases stay in the default one)."""

PARAMS = [
    pytest.param(case, dt, tp.values[0], id=f"{case.id}-{dt}-{tp.values[0].id}",
                 marks=(*tp.marks, *([pytest.mark.slow] if f"{case.id}-{dt}-{tp.values[0].id}" in SLOW else [])))
    for case in BWD_CASES
    for dt in case.dtypes
    for tp in TARGETS
    if tp.id != "strict-cuda"  # GEMM and row backward: tests/gpu/test_strict_cuda_*backward.py
]
STRICT = targets("strict", devices=("cpu",))  # strict CUDA backward (GEMMs, rows): tests/gpu
STRICT_CPU = Target("strict", "cpu")


@pytest.mark.parametrize("case,dtype_name,target", PARAMS)
def test_backward_matches_reference(case: BwdCase, dtype_name: str, target: Target):
    backend = target.family
    for i, c, r in run_backward(case, target, dtype_name):
        what = f"{case.id} {target} {dtype_name} d(input {i})"
        if TOLERANCES["backward"]["ops"][case.op].get("byte_equal"):
            assert_bytes_equal_reference(c, r, what)
        else:
            tol = backward_tolerance(case.op, backend, dtype_name)
            assert_within(c, r, tol["atol"], tol["rtol"], what)


@pytest.mark.parametrize("target", STRICT)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in BWD_CASES if "real" not in c.label])
def test_strict_gradient_dtype_is_input_dtype(case: BwdCase, target: Target):
    """Each gradient is cast once, to its input's dtype (bf16 inputs get bf16 gradients)."""
    args, _, _, _ = _case_data(case.id, "bfloat16")
    for i, c, _ in run_backward(case, target, "bfloat16"):
        assert c.dtype == args[i].dtype, f"{case.id}: d(input {i}) is {c.dtype}, input {args[i].dtype}"


def test_every_differentiable_operator_has_backward_cases_and_tolerances():
    from drifttool.ops.registry import specs
    from drifttool.ops.specs import WS1_OPERATORS

    diff_ops = {n for n in WS1_OPERATORS if specs()[n].differentiable}
    assert diff_ops == set(DIFF_ARGS), diff_ops ^ set(DIFF_ARGS)
    bw = TOLERANCES["backward"]
    assert bw["measured_on"]["command"].startswith("python -m tests.ops.test_backward --measure")
    for op in diff_ops:
        labels = [c.label for c in BWD_CASES if c.op == op]
        assert any("real" in lab for lab in labels) and any("real" not in lab for lab in labels), op
        entry = bw["ops"][op]
        assert entry.get("rationale"), op
        for be in BACKENDS:
            for dt in DTYPES:
                tol = entry[be][dt]
                assert tol["atol"] >= 0 and tol["rtol"] >= 0 and "measured" in tol, (op, be, dt)


# ---------------------------------------------------------------------------------------------
# invariance: per-sample gradients vs batch size, position, row count and prompt padding


def _plant(t: torch.Tensor, batch: int, pos: int, g: torch.Generator) -> torch.Tensor:
    """A batch of ``batch`` samples whose row ``pos`` is ``t[0]``, the others random."""
    others = torch.randn((batch,) + tuple(t.shape[1:]), generator=g).to(t.dtype)
    others[pos] = t[0]
    return others


def _lin(g, n, k, dt):
    return (_rn(g, n, k, scale=1 / math.sqrt(k)).to(dt), _rn(g, n, scale=0.1).to(dt))


def _rowwise_ops(d: int, k_big: int, g: torch.Generator, dt: torch.dtype, target: Target = STRICT_CPU):
    """{name: (fn(x, t) → output, per-sample args, parameters)} for ops with a per-sample x
    [B, S, d] and a per-sample t [B, d]; parameters are shared across the batch. ``k_big`` sizes a
    GEMM whose weight exceeds 65536 elements (``k_big``·d > 65536: tiled kernels) next to the exact
    small ones. The operators are ``target``'s (``Target.fn``: CPU tensors in and out)."""
    w_up, b_up = _lin(g, 4 * d, d, dt)  # exact (4d·d ≤ 65536)
    w_big, b_big = _lin(g, k_big, d, dt)  # tiled
    w_dn, b_dn = _lin(g, d, k_big, dt)
    w_mod, b_mod = _lin(g, 6 * d, d, dt)
    w_fin, b_fin = _lin(g, 2 * d, d, dt)
    gain = (1 + 0.1 * _rn(g, d)).to(dt)
    gain_h = (1 + 0.1 * _rn(g, 16)).to(dt)
    wq, bq, wk, bk, wv, bv = (t for _ in range(3) for t in _lin(g, d, d, dt))
    def S(name: str, family: str):
        assert family == target.family
        return target.fn(name)

    return {
        "latent_proj_gemm": (lambda x, t, w, b: S("latent_proj_gemm", "strict")(x, w, b), [w_up, b_up]),
        "mlp_up_gemm_gelu[tiled]": (lambda x, t, w, b: S("mlp_up_gemm_gelu", "strict")(x, w, b), [w_big, b_big]),
        "mlp_down_gemm[tiled]": (lambda x, t, w, b: S("mlp_down_gemm", "strict")(
            S("mlp_up_gemm_gelu", "strict")(x, w_big, b_big), w, b), [w_dn, b_dn]),
        "qkv_bias_gemm": (lambda x, t, *p: torch.cat([o.flatten(-2) for o in S("qkv_bias_gemm", "strict")(
            x, *p, 2)], -1), [wq, bq, wk, bk, wv, bv]),
        "txt_in_rmsnorm_linear": (lambda x, t, gn, w, b: S("txt_in_rmsnorm_linear", "strict")(x, gn, w, b),
                                  [gain, w_up, b_up]),
        "adaln_modulation": (lambda x, t: S("adaln_modulation", "strict")(x, t, t * 0.3), []),
        "adaln_gate_residual": (lambda x, t: S("adaln_gate_residual", "strict")(x, t, x * 0.5 + 1), []),
        "adaln_mod_projection": (lambda x, t, w, b: S("adaln_mod_projection", "strict")(t, w, b)[:, None], [w_mod, b_mod]),
        "final_adaln_out": (lambda x, t, w, b: S("final_adaln_out", "strict")(x, t, w, b), [w_fin, b_fin]),
        "qk_rmsnorm": (lambda x, t, gn: S("qk_rmsnorm", "strict")(x.unflatten(-1, (-1, 16)), gn).flatten(-2), [gain_h]),
        "multi_axis_rope": (lambda x, t: S("multi_axis_rope", "strict")(
            x.unflatten(-1, (-1, 16)), _freqs(x.shape[1])).flatten(-2), []),
    }


_ANGLES = torch.randn(512, 8, generator=torch.Generator().manual_seed(512)) * 3


def _freqs(s: int) -> torch.Tensor:
    """A RoPE table for the first ``s`` rows (the same angles for a row at any row count)."""
    return torch.polar(torch.ones(s, 8), _ANGLES[:s])


def _grads(f, x, t, params, gy):
    """(dx, dt, [dparams]) of ``(f(x, t, *params) · gy).sum()``."""
    x, t = x.detach().clone().requires_grad_(True), t.detach().clone().requires_grad_(True)
    ps = [p.detach().clone().requires_grad_(True) for p in params]
    y = f(x, t, *ps)
    gs = torch.autograd.grad(y, [x, t, *ps], gy, allow_unused=True)
    return [torch.zeros_like(a) if gr is None else gr for a, gr in zip([x, t, *ps], gs)]


@pytest.mark.parametrize("target", STRICT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_per_sample_gradients_invariant_to_batch_and_position(dtype, target):
    """A sample's dX and d(per-sample input) bytes alone (batch 1) equal its bytes at every
    position of batches of 2, 3 and 8 with random companions; its first row's dX is the same
    with 1 and 37 rows. The weight gradient of the batch equals tree_sum_stack of the per-sample
    (batch-1) weight gradients in batch order."""
    g = torch.Generator().manual_seed(11)
    d, rows = 32, 37
    ops = _rowwise_ops(d, 2304, g, dtype, target)
    x1, t1 = _rn(g, 1, rows, d, scale=2.0, shift=0.3).to(dtype), _rn(g, 1, d).to(dtype)
    for name, (f, params) in ops.items():
        y1 = f(x1, t1, *params)
        gy1 = torch.randn(y1.shape, generator=g).to(y1.dtype)
        solo = _grads(f, x1, t1, params, gy1)
        one_row = _grads(f, x1[:, :1], t1, params, gy1[:, :1])
        if name != "adaln_mod_projection":  # per-token ops: row 0's dx alone vs among 37 rows
            assert_same_bytes(one_row[0][:, 0], solo[0][:, 0], f"{name}: dx of row 0 alone vs among {rows}")
        for batch, positions in ((2, (1,)), (3, (0, 2)), (8, (5,))):
            for pos in positions:
                xb, tb, gyb = (_plant(a, batch, pos, g) for a in (x1, t1, gy1))
                full = _grads(f, xb, tb, params, gyb)
                what = f"{name} {dtype}: batch {batch} position {pos}"
                assert_same_bytes(full[0][pos : pos + 1], solo[0], f"{what}: dx")
                assert_same_bytes(full[1][pos : pos + 1], solo[1], f"{what}: d(per-sample input)")
                if batch == 3 and pos == 0 and params and dtype == torch.float32:
                    per_sample = [_grads(f, xb[i : i + 1], tb[i : i + 1], params, gyb[i : i + 1])
                                  for i in range(batch)]
                    for j in range(len(params)):
                        want = tree_sum_stack([p[2 + j] for p in per_sample])
                        assert_same_bytes(full[2 + j], want, f"{what}: param {j} vs tree of per-sample")


@pytest.mark.parametrize("target", STRICT)
def test_parameter_gradients_under_tree_automorphisms(target):
    """dW of samples [a, b, c, d] equals dW of [b, a, d, c] and [c, d, a, b] (swaps of aligned
    halves are automorphisms of the pairwise tree), for exact and tiled weight shapes, and for the
    per-sample-input operators' parameter gradients (gains, modulation projection)."""
    g = torch.Generator().manual_seed(5)
    d = 32
    ops = _rowwise_ops(d, 2304, g, torch.float32, target)
    x, t = _rn(g, 4, 19, d), _rn(g, 4, d)
    for name, (f, params) in ops.items():
        if not params:
            continue
        y = f(x, t, *params)
        gy = torch.randn(y.shape, generator=g)
        base = _grads(f, x, t, params, gy)[2:]
        for perm in ([1, 0, 3, 2], [2, 3, 0, 1]):
            got = _grads(f, x[perm], t[perm], params, gy[perm])[2:]
            for j, (a, b) in enumerate(zip(base, got)):
                assert_same_bytes(b, a, f"{name}: param {j} under sample order {perm}")


@pytest.mark.parametrize("target", STRICT)
@pytest.mark.parametrize("L,pad", [(13, 4), (13, 150), (200, 150)])
def test_gradients_invariant_to_prompt_padding(L, pad, target):
    """Text-stream operators: right-padding a prompt of L rows with ``pad`` rows that carry a
    zero output gradient (as padded text rows do in the model) leaves the valid rows' dX and every
    parameter and per-sample gradient unchanged, byte for byte. pad = 150 adds 64-row blocks;
    with L = 200 (4 blocks → 6 blocks) the halving of the block list into 8 segments differs, so
    only dropping the trailing zero-gradient rows keeps the bytes (contract v2)."""
    g = torch.Generator().manual_seed(21)
    d = 32
    ops = _rowwise_ops(d, 2304, g, torch.float32, target)
    x, t = _rn(g, 2, L, d, scale=2.0), _rn(g, 2, d)
    xp = torch.cat([x, _rn(g, 2, pad, d, scale=3.0)], 1)  # garbage in the padded rows
    for name, (f, params) in ops.items():
        y = f(x, t, *params)
        gy = torch.randn(y.shape, generator=g)
        if name == "adaln_mod_projection":
            continue  # per-sample input only, no rows
        gyp = torch.cat([gy, torch.zeros(2, pad, *gy.shape[2:])], 1)
        a = _grads(f, x, t, params, gy)
        b = _grads(f, xp, t, params, gyp)
        assert_same_bytes(b[0][:, :L], a[0], f"{name}: valid rows' dx with {pad} padded rows")
        for j in range(1, len(a)):
            assert_same_bytes(b[j], a[j], f"{name}: gradient {j} with {pad} padded rows")


def _attn_inputs(g, lens, pad, n_img, heads, dh, dtype):
    lmax = max(lens) + pad
    b = len(lens)
    q, k, v = (_rn(g, b, lmax + n_img, heads, dh, scale=1.5).to(dtype) for _ in range(3))
    return q, k, v, _joint_mask(lens, lmax, n_img), lmax


@pytest.mark.parametrize("dh,dtype", [(16, torch.float32), (16, torch.bfloat16), (64, torch.float32)],
                         ids=["exact-float32", "exact-bfloat16", "tiled-float32"])
@pytest.mark.parametrize("target", STRICT)
def test_attention_gradients_invariant_to_padding_and_batch(dh, dtype, target):
    """Joint attention (fused, and the unfused chain with the same bytes): each sample's dQ, dK,
    dV on its valid rows, padded to the batch's longest prompt (+ extra padding) among
    companions, equal those of the sample alone, unpadded and unmasked. Padded query rows carry a
    zero output gradient, as in the model."""
    g = torch.Generator().manual_seed(3 + dh)
    lens, pad, n_img, heads = [7, 13, 2], 5, 70, 2
    q, k, v, km, lmax = _attn_inputs(g, lens, pad, n_img, heads, dh, dtype)
    go = torch.randn(q.shape, generator=g).to(dtype)
    go = go * km[:, :, None, None].to(dtype)  # padded query rows: zero gradient
    fused = target.fn("joint_attention_fused")
    grads, _ = backend_grads(fused, (q, k, v, km), {"text_len": lmax}, (0, 1, 2), None, [go])

    def unfused(q_, k_, v_, m_, text_len):
        s = target.fn("joint_attn_qk_gemm")(q_, k_, m_, text_len=text_len)
        p = target.fn("joint_attn_softmax")(s, m_, text_len=text_len)
        return target.fn("joint_attn_av_gemm")(p, v_, m_, text_len=text_len)

    grads_u, _ = backend_grads(unfused, (q, k, v, km), {"text_len": lmax}, (0, 1, 2), None, [go])
    for a, b, n in zip(grads, grads_u, "qkv"):
        assert_same_bytes(a, b, f"d{n}: fused vs unfused")
    for i, n in enumerate(lens):
        keep = torch.cat([torch.arange(n), torch.arange(lmax, lmax + n_img)])
        alone, _ = backend_grads(fused, tuple(t[i : i + 1, keep] for t in (q, k, v)) + (None,), {"text_len": n},
                                 (0, 1, 2), None, [go[i : i + 1, keep]])
        for a, b, name in zip(grads, alone, "qkv"):
            assert_same_bytes(a[i : i + 1, keep], b, f"d{name} of sample {i} (prompt {n} padded to {lmax})")


def test_unfused_attention_gradients_at_valid_keys_only():
    """The softmax gradient is exactly +0 at masked keys, and so are the AV probability and value
    gradients there (the contract zeroes masked values)."""
    g = torch.Generator().manual_seed(8)
    q, k, v, km, _ = _attn_inputs(g, [3, 9], 2, 6, 2, 16, torch.float32)
    s = ref.joint_attn_qk_gemm(q, k).float()
    p = implementation("joint_attn_softmax", "strict")(s, km)
    gp = torch.randn(p.shape, generator=g)
    (ds,), _ = backend_grads(implementation("joint_attn_softmax", "strict"), (s, km), {}, (0,), None, [gp])
    (dp, dv), _ = backend_grads(implementation("joint_attn_av_gemm", "strict"), (p, v, km), {}, (0, 1), None,
                                [torch.randn(v.shape, generator=g)])
    masked = ~km
    for t, what in ((ds.masked_select(masked[:, None, None, :]), "dscores"),
                    (dp.masked_select(masked[:, None, None, :]), "dprobs"),
                    (dv.masked_select(masked[:, :, None, None]), "dv")):
        assert t.numel() and torch.equal(t.view(torch.int32), torch.zeros_like(t).view(torch.int32)), what


def test_rowwise_gradients_at_6889_tokens():
    """The 1328² image token count (not a multiple of any tile): one sample's dX, dshift, dscale,
    dgate of the image-stream row-wise operators alone and planted at position 1 of a batch of 2."""
    g = torch.Generator().manual_seed(6889)
    d = 64
    x, t = _rn(g, 1, 6889, d, scale=2.0), _rn(g, 1, d)
    fs = {
        "adaln_modulation": lambda x_, t_: implementation("adaln_modulation", "strict")(x_, t_, t_ * 0.5),
        "adaln_gate_residual": lambda x_, t_: implementation("adaln_gate_residual", "strict")(x_, t_, x_ * 0.3),
        "final_adaln_out": lambda x_, t_: implementation("final_adaln_out", "strict")(
            x_, t_, *(p.detach() for p in _lin(torch.Generator().manual_seed(1), 2 * d, d, torch.float32))),
    }
    for name, f in fs.items():
        gy = torch.randn(1, 6889, d, generator=g)
        solo = _grads(f, x, t, [], gy)
        xb, tb, gyb = (_plant(a, 2, 1, g) for a in (x, t, gy))
        full = _grads(f, xb, tb, [], gyb)
        assert_same_bytes(full[0][1:], solo[0], f"{name}: dx at 6889 tokens")
        assert_same_bytes(full[1][1:], solo[1], f"{name}: d(per-sample input) at 6889 tokens")


@pytest.mark.parametrize("mode", ["sample", "replay", "euler"])
def test_sampler_gradients_invariant_to_batch(mode):
    """cfg_combine_renorm and flow_sde_step_logp: a sample's dv, dx (and dv_cond, dv_uncond)
    bytes alone equal its bytes at position 2 of a batch of 3 with companions at other steps."""
    g = torch.Generator().manual_seed(17)
    sig = _sigmas()
    n = 257
    v, x, eps = _rn(g, 1, n, 64), _rn(g, 1, n, 64), _rn(g, 1, n, 64)
    step = 9 if mode == "euler" else 3
    sde = implementation("flow_sde_step_logp", "strict")

    def run(v_, x_, e_, steps, gos):
        kw = {"eta": 0.0 if mode == "euler" else 1.2, "sigma_max": sig[1]}
        if mode == "sample":
            kw["noise"] = e_
        elif mode == "replay":
            kw["prev_sample"] = x_ + 0.1 * e_
        outs = (2,) if mode == "euler" else (1, 2)
        return backend_grads(sde, (v_, x_, sig[steps], sig[steps + 1]), kw, (0, 1), outs, gos)[0]

    g_logp, g_mu = torch.full((1,), 0.7), _rn(g, 1, n, 64)
    solo = run(v, x, eps, torch.tensor([step]), [g_mu] if mode == "euler" else [g_logp, g_mu])
    vb, xb, eb, gb = (_plant(a, 3, 2, g) for a in (v, x, eps, g_mu))
    steps = torch.tensor([0, 5, step]) if mode != "euler" else torch.tensor([9, 9, 9])
    gl = torch.tensor([-0.2, 1.5, 0.7])
    full = run(vb, xb, eb, steps, [gb] if mode == "euler" else [gl, gb])
    for a, b, name in zip(full, solo, ("dv", "dx")):
        assert_same_bytes(a[2:], b, f"flow_sde_step_logp {mode}: {name}")
    cfg = implementation("cfg_combine_renorm", "strict")
    c, u = _rn(g, 1, n, 64), _rn(g, 1, n, 64)
    gv = _rn(g, 1, n, 64)
    solo, _ = backend_grads(cfg, (c, u, 4.0), {}, (0, 1), None, [gv])
    full, _ = backend_grads(cfg, (_plant(c, 3, 2, g), _plant(u, 3, 2, g), 4.0), {}, (0, 1), None,
                            [_plant(gv, 3, 2, g)])
    for a, b, name in zip(full, solo, ("dv_cond", "dv_uncond")):
        assert_same_bytes(a[2:], b, f"cfg_combine_renorm: {name}")


# ---------------------------------------------------------------------------------------------
# mechanics


def test_tree_accumulator_is_tree_sum_stack():
    g = torch.Generator().manual_seed(2)
    for n in (1, 2, 3, 5, 8, 13):
        parts = [torch.randn(7, 5, generator=g) * 10 ** (i % 4) for i in range(n)]
        acc = TreeAccumulator()
        for p in parts:
            acc.add(p)
        assert_same_bytes(acc.result(), tree_sum_stack(parts), f"{n} partials")


def test_gradients_do_not_depend_on_the_thread_count():
    """The tiled GEMM (forward, dX, dW) and the tiled attention backward give the same bytes on
    1 and 2 intra-op threads."""
    g = torch.Generator().manual_seed(12)
    x = _rn(g, 2, 150, 256)
    w, b = _lin(g, 384, 256, torch.float32)
    q, k, v, km, _ = _attn_inputs(g, [5, 9], 3, 40, 1, 64, torch.float32)
    gy = torch.randn(2, 150, 384, generator=g)
    go = torch.randn(q.shape, generator=g)
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            lin = backend_grads(implementation("mlp_up_gemm_gelu", "strict"), (x, w, b), {}, (0, 1, 2), None, [gy])[0]
            att = backend_grads(implementation("joint_attention_fused", "strict"), (q, k, v, km), {}, (0, 1, 2),
                                None, [go])[0]
        finally:
            torch.set_num_threads(1)
        runs.append(lin + att)
    for i, (a, c) in enumerate(zip(*runs)):
        assert_same_bytes(a, c, f"gradient {i}: 1 vs 2 threads")


def test_unsupported_inputs_fail_closed():
    """Forward checks on the tensors the backward relies on, and the backward's own limit: a key
    mask orders queries and keys alike, so the AV backward refuses Sq ≠ Sk under a mask."""
    from drifttool.errors import UnsupportedConfigError

    g = torch.Generator().manual_seed(13)
    x = _rn(g, 1, 5, 2, 16)
    with pytest.raises(UnsupportedConfigError, match="complex table"):
        implementation("multi_axis_rope", "strict")(x, _freqs(4))
    with pytest.raises(UnsupportedConfigError, match="key_mask"):
        implementation("joint_attn_qk_gemm", "strict")(x, x, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(UnsupportedConfigError, match="float16"):
        implementation("mlp_down_gemm", "strict")(x.half(), torch.randn(8, 16).half(), None)
    probs = torch.softmax(_rn(g, 1, 2, 3, 5), -1).requires_grad_(True)  # 3 queries, 5 keys
    out = implementation("joint_attn_av_gemm", "strict")(probs, x, torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(UnsupportedConfigError, match="as many queries as keys"):
        out.sum().backward()


def test_noncontiguous_output_gradient_gives_the_same_bytes():
    g = torch.Generator().manual_seed(4)
    x = _rn(g, 2, 9, 48)
    w, b = _lin(g, 96, 48, torch.float32)
    gy = torch.randn(2, 96, 9, generator=g)
    fn = implementation("mlp_up_gemm_gelu", "strict")
    a, _ = backend_grads(fn, (x, w, b), {}, (0, 1, 2), None, [gy.transpose(1, 2)])
    c, _ = backend_grads(fn, (x, w, b), {}, (0, 1, 2), None, [gy.transpose(1, 2).contiguous()])
    for p, q in zip(a, c):
        assert_same_bytes(p, q, "non-contiguous vs contiguous output gradient")


def test_strict_backward_is_deterministic_and_leaves_forward_unchanged():
    """Autograd recording does not change the forward bytes; two backwards give the same bytes."""
    g = torch.Generator().manual_seed(9)
    x = _rn(g, 2, 11, 48)
    w, b = _lin(g, 640, 48, torch.float32)
    fn = implementation("mlp_up_gemm_gelu", "strict")
    with torch.no_grad():
        y0 = fn(x, w, b)
    xr = x.clone().requires_grad_(True)
    y1 = fn(xr, w, b)
    assert_same_bytes(y1.detach(), y0, "forward with and without autograd")
    gy = torch.randn(y0.shape, generator=g)
    a = torch.autograd.grad(fn(xr, w, b), xr, gy)[0]
    c = torch.autograd.grad(fn(xr, w, b), xr, gy)[0]
    assert_same_bytes(a, c, "repeat")


# ---------------------------------------------------------------------------------------------
# model level


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_strict_mmdit_backward_is_batch_and_padding_invariant(dtype):
    """The tiny strict MMDiT (registry calls, runtime mode strict): backward runs, every
    parameter gradient is finite and some are non-zero, and each sample's input gradients
    (packed latents x, prompt embeddings on its valid rows) are byte-equal alone (unpadded, no
    mask) and in a batch of 3 with different prompt lengths padded to the longest."""
    from drifttool.model.config import tiny
    from drifttool.model.mmdit import MMDiT, random_init_
    from drifttool.runtime import Runtime

    model = random_init_(MMDiT(tiny(), dtype=dtype), seed=1)
    cfg = model.config
    g = torch.Generator().manual_seed(31)
    h, w = 3, 4
    lens = [5, 9, 2]
    L = max(lens)
    B = len(lens)
    x = _rn(g, B, h * w, cfg.in_channels).to(dtype)
    txt = _rn(g, B, L, cfg.joint_attention_dim).to(dtype)
    mask = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]
    tau = torch.tensor([1.0, 0.5, 0.25])
    gv = _rn(g, B, h * w, cfg.out_dim).to(dtype)

    def grads(xb, tb, mb, taub, gvb):
        xb, tb = xb.clone().requires_grad_(True), tb.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        v = model(xb, tb, mb, taub, (h, w), Runtime(mode="strict"))
        v.backward(gvb)
        return xb.grad, tb.grad

    dx, dt = grads(x, txt, mask, tau, gv)
    params = dict(model.named_parameters())
    last = f"transformer_blocks.{cfg.num_layers - 1}."
    unused = {n for n in params if n.startswith(last) and ("to_add_out" in n or "txt_mlp" in n)}
    # the last block's text output is discarded (as in diffusers): those weights get no gradient
    assert {n for n, p in params.items() if p.grad is None} == unused
    assert all(torch.isfinite(p.grad).all() for n, p in params.items() if n not in unused)
    assert params["transformer_blocks.0.attn.to_q.weight"].grad.abs().sum() > 0
    assert params["proj_out.weight"].grad.abs().sum() > 0
    for i, n in enumerate(lens):
        sx, st = grads(x[i : i + 1], txt[i : i + 1, :n], None, tau[i : i + 1], gv[i : i + 1])
        assert_same_bytes(dx[i : i + 1], sx, f"sample {i}: d latents, batch of 3 vs alone")
        assert_same_bytes(dt[i : i + 1, :n], st, f"sample {i}: d prompt (valid rows), padded to {L} vs alone")
        if n < L:
            assert torch.all(dt[i, n:] == 0), f"sample {i}: padded prompt rows get a zero gradient"


# ---------------------------------------------------------------------------------------------
# measurement (python -m tests.ops.test_backward --measure)


def measure() -> dict:
    """Per (op, backend, dtype): ``error_stats`` of every gradient, max over all cases."""
    import time

    stats: dict = {}
    for case in BWD_CASES:
        for dt in case.dtypes:
            for be in BACKENDS:
                t0 = time.perf_counter()
                e = stats.setdefault(case.op, {}).setdefault(be, {}).setdefault(dt, {})
                worst = 0.0
                for _, c, r in run_backward(case, Target(be, "cpu"), dt):
                    s = error_stats(c, r)
                    for key, val in s.items():
                        e[key] = max(e.get(key, 0.0), val)
                    worst = max(worst, (c.double() - r).abs().max().item())
                print(f"{case.id:52s} {dt:9s} {be:10s} max|err| {worst:9.3g}  "
                      f"{time.perf_counter() - t0:6.2f}s", flush=True)
    return stats


if __name__ == "__main__":  # pragma: no cover
    torch.set_num_threads(2)
    if "--measure" in sys.argv:  # with --all-dtypes: the real cases in bf16 too
        result = measure()
        if "--json" in sys.argv:
            Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(result, indent=1))
