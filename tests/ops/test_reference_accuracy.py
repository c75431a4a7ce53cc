"""Forward accuracy of the strict and production backends against the independent FP64 reference.

    $ python -m pytest tests/ops/test_reference_accuracy.py -q
    $ python -m tests.ops.test_reference_accuracy --measure     # re-measure, print the table

Criterion (references/tolerances.json, profile drifttool-ws1-cpu-v2): elementwise
|c − r| ≤ atol + rtol·|r|, r = ``drifttool.references.ops`` on the same inputs (bf16 cases:
the same bf16-quantised tensors, upcast), c = the backend's output upcast to float64 after
rounding to the operator's declared output dtype. Operators marked ``byte_equal`` must equal the
reference rounded to the output dtype bit for bit.

Cases: a short synthetic case per operator with awkward shapes (prompt lengths 7 and 13, a 3×5
image grid, batch 1 and 3, masks with different valid lengths), and the real geometry at reduced
batch (hidden 3072, 24 heads × 128, 64 tokens for per-token GEMMs, the 1328² grid of 6889 image
tokens for row-wise operators and for single-head attention).

Targets (``tests/harness.py``): every case runs per (family, device). The reference runs on the
CPU in FP64 on the CPU-made inputs; the implementation runs on the target's device on the same
values moved there; its outputs are compared on the CPU. A CPU family lacking an operator fails;
a CUDA target skips without a GPU or without a registered implementation.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers specs and strict backends)
from drifttool.model import rope as model_rope
from drifttool.ops.registry import impls, specs
from drifttool.ops.specs import TRANSFORMER_OPERATORS
from drifttool.references import ops as ref
from tests.harness import Target, targets, to_cpu, to_device


REF_SOURCE = Path(ref.__file__)
TOLERANCES = json.loads(REF_SOURCE.with_name("tolerances.json").read_text())
CUDA_PROFILE = REF_SOURCE.with_name("tolerances_cuda.json")
"""CUDA qualifies separately (RFC: "CUDA and ROCm qualify separately ... any deviation requires an
explicit tolerance profile"): forward tolerances of the families registered on CUDA, measured on
an H200 with ``python -m tests.ops.test_reference_accuracy --measure --device cuda --derive
--json references/tolerances_cuda.json``."""
CUDA_TOLERANCES = json.loads(CUDA_PROFILE.read_text()) if CUDA_PROFILE.exists() else None
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS = ("strict", "production")
TARGETS = targets(*BACKENDS)  # (family, device); tolerances are per family (profile measured on CPU)

# VAE latent statistics (numerics §1)
LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]

# ---------------------------------------------------------------------------------------------
# cases


@dataclass(frozen=True)
class Case:
    """One operator call. ``make(dtype, g)`` returns (args, kwargs) with every floating input
    already in the case dtype (τ, scores and probs stay FP32 by signature); ``out`` is the
    declared output dtype per output: "act" (the case dtype) or "fp32"; ``dtypes`` the case
    dtypes it runs in."""

    op: str
    label: str
    make: Callable[[torch.dtype, torch.Generator], tuple[tuple, dict]]
    out: tuple[str, ...] = ("act",)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")

    @property
    def id(self) -> str:
        return f"{self.op}[{self.label}]"


def _rn(g: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale + shift


def _lin(g, dt, n_out, k, *, bias=0.1):
    """Weight [n_out, k] with unit-variance outputs for unit-variance inputs, and a bias."""
    return (_rn(g, n_out, k, scale=1 / math.sqrt(k)).to(dt), _rn(g, n_out, scale=bias).to(dt))


def _tau(g: torch.Generator, b: int, dt: torch.dtype) -> torch.Tensor:
    """Timesteps ≈ σ: 1, the terminal 0.02, and random values; bf16-representable for bf16 cases
    (diffusers rounds τ to the model dtype; the pipeline already passes bf16 values)."""
    t = torch.cat([torch.tensor([1.0, 0.019999980926513672]), torch.rand(max(b - 2, 0), generator=g)])[:b]
    return t.to(dt).to(torch.float32)


def _joint_mask(valid: list[int], txt_len: int, n_img: int) -> torch.Tensor:
    """Joint key mask [B, L+N] = [text valid prefix, ones(N)] (right padding, numerics §2.4)."""
    m = torch.zeros(len(valid), txt_len + n_img, dtype=torch.bool)
    for i, v in enumerate(valid):
        m[i, :v] = True
        m[i, txt_len:] = True
    return m


def _rope_freqs(h: int, w: int, txt_len: int, axes=(16, 56, 56)) -> torch.Tensor:
    """Joint [text, image] table rows as complex64 (the operator's input dtype)."""
    img, txt = ref.rope_tables(h, w, txt_len, axes)
    return torch.cat([txt, img]).to(torch.complex64)  # [L+N, Dh/2]


def _cases() -> list[Case]:
    C: list[Case] = []
    d, heads, dh = 48, 3, 16  # synthetic hidden size

    # latent layout -------------------------------------------------------------------------
    C.append(Case("latent_pack_unpack", "pack_b3_grid3x5",
                  lambda dt, g: ((_rn(g, 3, 16, 6, 10).to(dt),), {"direction": "pack"})))
    C.append(Case("latent_pack_unpack", "pack5d_b1_grid3x5",
                  lambda dt, g: ((_rn(g, 1, 16, 1, 6, 10).to(dt),), {"direction": "pack"})))
    C.append(Case("latent_pack_unpack", "unpack_b3_grid3x5",
                  lambda dt, g: ((_rn(g, 3, 15, 64).to(dt),), {"direction": "unpack", "grid": (3, 5)})))
    C.append(Case("latent_pack_unpack", "pack_real_1328",
                  lambda dt, g: ((_rn(g, 1, 16, 166, 166).to(dt),), {"direction": "pack"})))
    C.append(Case("latent_pack_unpack", "unpack_real_1328",
                  lambda dt, g: ((_rn(g, 1, 6889, 64).to(dt),), {"direction": "unpack", "grid": (83, 83)})))

    def norm_case(shape, inverse):
        def make(dt, g):
            z = _rn(g, *shape, scale=2.0).to(dt)
            return (z, torch.tensor(LATENTS_MEAN).to(dt), torch.tensor(LATENTS_STD).to(dt)), {"inverse": inverse}
        return make

    C.append(Case("latent_normalize", "fwd_b3_grid3x5", norm_case((3, 16, 1, 6, 10), False)))
    C.append(Case("latent_normalize", "inv_b3_grid3x5", norm_case((3, 16, 6, 10), True)))
    C.append(Case("latent_normalize", "fwd_real_1328", norm_case((1, 16, 1, 166, 166), False)))
    C.append(Case("latent_normalize", "inv_real_1328", norm_case((1, 16, 1, 166, 166), True)))

    # inputs -----------------------------------------------------------------------------------
    def gemm_case(b, s, k, n, *, x_scale=1.0):
        def make(dt, g):
            return (_rn(g, b, s, k, scale=x_scale).to(dt), *_lin(g, dt, n, k)), {}
        return make

    C.append(Case("latent_proj_gemm", "img_in_b3_s15", gemm_case(3, 15, 64, d)))
    C.append(Case("latent_proj_gemm", "proj_out_b1_s7", gemm_case(1, 7, d, 64)))
    C.append(Case("latent_proj_gemm", "img_in_real_s256", gemm_case(1, 256, 64, 3072)))
    C.append(Case("latent_proj_gemm", "proj_out_real_s256", gemm_case(1, 256, 3072, 64)))

    def txt_case(b, s, dj, n):
        def make(dt, g):
            e = _rn(g, b, s, dj, scale=3.0, shift=0.2).to(dt)
            gain = _rn(g, dj, scale=0.3, shift=1.0).to(dt)
            return (e, gain, *_lin(g, dt, n, dj)), {"eps": 1e-6}
        return make

    C.append(Case("txt_in_rmsnorm_linear", "b3_l13", txt_case(3, 13, 56, d)))
    C.append(Case("txt_in_rmsnorm_linear", "b1_l7", txt_case(1, 7, 56, d)))
    C.append(Case("txt_in_rmsnorm_linear", "real_l64", txt_case(1, 64, 3584, 3072)))

    def temb_case(b, n):
        def make(dt, g):
            return (_tau(g, b, dt), *_lin(g, dt, n, 256), *_lin(g, dt, n, n)), {}
        return make

    C.append(Case("timestep_embed_mlp", "b3", temb_case(3, d)))
    C.append(Case("timestep_embed_mlp", "real_b3", temb_case(3, 3072)))

    # modulation --------------------------------------------------------------------------------
    def modproj_case(b, n, k):
        def make(dt, g):
            return (_rn(g, b, k, scale=2.0).to(dt), *_lin(g, dt, n, k)), {}
        return make

    C.append(Case("adaln_mod_projection", "b3", modproj_case(3, 6 * d, d)))
    C.append(Case("adaln_mod_projection", "real_b2", modproj_case(2, 6 * 3072, 3072)))

    def mod_case(b, s, dd):
        def make(dt, g):
            x = _rn(g, b, s, dd, scale=2.0, shift=0.5).to(dt)
            return (x, _rn(g, b, dd, scale=0.5).to(dt), _rn(g, b, dd, scale=0.5).to(dt)), {"eps": 1e-6}
        return make

    C.append(Case("adaln_modulation", "b3_s15", mod_case(3, 15, d)))
    C.append(Case("adaln_modulation", "b1_s7", mod_case(1, 7, d)))
    C.append(Case("adaln_modulation", "real_s6889", mod_case(1, 6889, 3072)))

    def gate_case(b, s, dd):
        def make(dt, g):
            return (_rn(g, b, s, dd).to(dt), _rn(g, b, dd, scale=0.5).to(dt), _rn(g, b, s, dd).to(dt)), {}
        return make

    C.append(Case("adaln_gate_residual", "b3_s13", gate_case(3, 13, d)))
    C.append(Case("adaln_gate_residual", "real_s256", gate_case(1, 256, 3072)))

    # attention ---------------------------------------------------------------------------------
    def qkv_case(b, s, dd, h):
        def make(dt, g):
            ws = [t for _ in range(3) for t in _lin(g, dt, dd, dd)]
            return (_rn(g, b, s, dd).to(dt), *ws, h), {}
        return make

    C.append(Case("qkv_bias_gemm", "b3_s13", qkv_case(3, 13, d, heads), ("act",) * 3))
    C.append(Case("qkv_bias_gemm", "real_s64", qkv_case(1, 64, 3072, 24), ("act",) * 3))

    def qkn_case(b, s, h, hd):
        def make(dt, g):
            return (_rn(g, b, s, h, hd, scale=3.0).to(dt), _rn(g, hd, scale=0.3, shift=1.0).to(dt)), {"eps": 1e-6}
        return make

    C.append(Case("qk_rmsnorm", "b3_s13", qkn_case(3, 13, heads, dh)))
    C.append(Case("qk_rmsnorm", "real_s64_h24", qkn_case(1, 64, 24, 128)))

    def rope_case(b, grid, txt_len, h, axes):
        def make(dt, g):
            freqs = _rope_freqs(*grid, txt_len, axes)
            return (_rn(g, b, freqs.shape[0], h, 2 * freqs.shape[1], scale=2.0).to(dt), freqs), {}
        return make

    C.append(Case("multi_axis_rope", "b3_l7_grid3x5", rope_case(3, (3, 5), 7, 2, (4, 6, 6))))
    C.append(Case("multi_axis_rope", "real_l512_grid83x83", rope_case(1, (83, 83), 512, 2, (16, 56, 56))))

    # attention core, joint [text, image] (batch, text slots, image tokens, heads, Dh, valid text
    # lengths or None): synthetic prompt 13 with valid lengths 13, 7, 10 and a 3×5 image; prompt 7
    # unmasked at batch 1; real head size on a 512² image (32×32) with 64 text slots, 9 padded; and
    # (fused only — the strict fused operator is the three unfused ones composed) the 1328² image's
    # 6889 tokens with one head and a 16-slot prompt of valid length 7.
    attn_geoms = {
        "b3_l13_grid3x5_masked": (3, 13, 15, 2, dh, [13, 7, 10]),
        "b1_l7_grid3x5_nomask": (1, 7, 15, 2, dh, None),
        "real_h2_l64_grid32x32_pad9": (1, 64, 1024, 2, 128, [55]),
    }
    fused_only = {"real_n6889_l16_valid7_h1": (1, 16, 6889, 1, 128, [7])}  # fp32 only (time)

    def qkv_attn(geom, dt, g):
        b, txt, n, h, hd, valid = geom
        s = txt + n
        q = _rn(g, b, s, h, hd, scale=1.5).to(dt)
        k = _rn(g, b, s, h, hd, scale=1.5).to(dt)
        v = _rn(g, b, s, h, hd).to(dt)
        mask = None if valid is None else _joint_mask(valid, txt, n)
        return q, k, v, mask

    for label, geom in attn_geoms.items():
        C.append(Case("joint_attn_qk_gemm", label,
                      lambda dt, g, geom=geom: (qkv_attn(geom, dt, g)[:2], {}), ("fp32",)))

        def soft(dt, g, geom=geom):
            q, k, _, mask = qkv_attn(geom, dt, g)
            scores = ref.joint_attn_qk_gemm(q, k).to(torch.float32)
            return (scores, mask), {}

        def av(dt, g, geom=geom):
            q, k, v, mask = qkv_attn(geom, dt, g)
            probs = ref.joint_attn_softmax(ref.joint_attn_qk_gemm(q, k), mask).to(torch.float32)
            return (probs, v, mask), {}

        C.append(Case("joint_attn_softmax", label, soft, ("fp32",)))
        C.append(Case("joint_attn_av_gemm", label, av))
    for label, geom in {**attn_geoms, **fused_only}.items():
        C.append(Case("joint_attention_fused", label,
                      lambda dt, g, geom=geom: (qkv_attn(geom, dt, g), {}),
                      dtypes=("float32",) if label in fused_only else ("float32", "bfloat16")))

    C.append(Case("attn_out_bias_gemm", "b3_s13", gemm_case(3, 13, d, d)))
    C.append(Case("attn_out_bias_gemm", "real_s64", gemm_case(1, 64, 3072, 3072)))

    # MLP, final layer --------------------------------------------------------------------------
    C.append(Case("mlp_up_gemm_gelu", "b3_s13", gemm_case(3, 13, d, 4 * d, x_scale=2.0)))
    C.append(Case("mlp_up_gemm_gelu", "real_s64", gemm_case(1, 64, 3072, 4 * 3072, x_scale=2.0)))
    C.append(Case("mlp_down_gemm", "b3_s13", gemm_case(3, 13, 4 * d, d)))
    C.append(Case("mlp_down_gemm", "real_s64", gemm_case(1, 64, 4 * 3072, 3072)))

    def final_case(b, s, dd):
        def make(dt, g):
            x = _rn(g, b, s, dd, scale=2.0, shift=-0.3).to(dt)
            return (x, _rn(g, b, dd, scale=2.0).to(dt), *_lin(g, dt, 2 * dd, dd)), {"eps": 1e-6}
        return make

    C.append(Case("final_adaln_out", "b3_s15", final_case(3, 15, d)))
    C.append(Case("final_adaln_out", "b1_s7", final_case(1, 7, d)))
    C.append(Case("final_adaln_out", "real_s256", final_case(1, 256, 3072)))
    return C


CASES = _cases()
BYTE_EQUAL_OPS = {op for op, e in TOLERANCES["ops"].items() if e.get("byte_equal")}


def _seed(case: Case) -> int:
    return sum(ord(ch) * (i + 1) for i, ch in enumerate(case.id)) % (2**31)


@functools.lru_cache(maxsize=1)
def _inputs_and_reference(case_id: str, dtype_name: str):
    """Inputs and FP64 reference outputs of one (case, dtype); cached for the next backend."""
    case = next(c for c in CASES if c.id == case_id)
    g = torch.Generator().manual_seed(_seed(case))
    args, kwargs = case.make(DTYPES[dtype_name], g)
    r = ref.OPS[case.op](*args, **kwargs)
    return args, kwargs, (r if isinstance(r, tuple) else (r,))


def _out_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if kind == "fp32" else dtype


def run_case(case: Case, target: Target, dtype_name: str):
    """(target outputs on the CPU, FP64 reference outputs, declared output dtypes).

    Raises:
        UnsupportedConfigError: the CPU target has no implementation of ``case.op``.
        pytest.skip.Exception: a non-CPU target without its device or implementation.
    """
    fn = target.impl(case.op)
    args, kwargs, r = _inputs_and_reference(case.id, dtype_name)
    c = to_cpu(fn(*to_device(args, target.device), **to_device(kwargs, target.device)))
    c = c if isinstance(c, tuple) else (c,)
    return c, r, tuple(_out_dtype(k, DTYPES[dtype_name]) for k in case.out)


# ---------------------------------------------------------------------------------------------
# comparison


def tolerance(op: str, backend: str, dtype_name: str, device: str = "cpu") -> dict:
    """The tolerance of (op, family, dtype) in the device's profile: the CPU profile
    (``tolerances.json``) on the CPU, the CUDA profile (``tolerances_cuda.json``) on CUDA — a
    family on CUDA without an entry there fails (it has not qualified), never borrows the CPU's."""
    if device == "cpu":
        return TOLERANCES["ops"][op][backend][dtype_name]
    entry = ((CUDA_TOLERANCES or {}).get("ops", {}).get(op, {}).get(backend, {}).get(dtype_name)
             if device == "cuda" else None)
    if entry is None:
        pytest.fail(f"no {device} tolerance for {op} {backend} {dtype_name}: measure the profile "
                    "(python -m tests.ops.test_reference_accuracy --measure --device cuda --derive "
                    "--json references/tolerances_cuda.json)")
    return entry


def assert_within(c: torch.Tensor, r: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    """|c − r| ≤ atol + rtol·|r| elementwise (reference on the right); on failure report the worst
    element (largest excess over its allowance), its value, the reference and the allowance."""
    assert c.shape == r.shape, f"{what}: shape {tuple(c.shape)} vs reference {tuple(r.shape)}"
    c64 = c.to(torch.float64)
    if not torch.isfinite(c64).all():
        idx = (~torch.isfinite(c64)).nonzero()[0].tolist()
        pytest.fail(f"{what}: non-finite output {c64[tuple(idx)].item()} at {idx}")
    err = (c64 - r).abs_()
    excess = err - r.abs().mul_(rtol).add_(atol)  # |c − r| − (atol + rtol·|r|)
    if excess.max() > 0:
        allowed = atol + rtol * r.abs()
        flat = int(torch.argmax(excess))
        idx = list(torch.unravel_index(torch.tensor(flat), r.shape))
        idx = [int(i) for i in idx]
        pytest.fail(
            f"{what}: {(excess > 0).sum().item()} of {r.numel()} elements out of tolerance "
            f"(atol={atol:g}, rtol={rtol:g}); worst at {idx}: got {c64.reshape(-1)[flat].item():.9g}, "
            f"reference {r.reshape(-1)[flat].item():.9g}, |diff| {err.reshape(-1)[flat].item():.3g} > "
            f"allowed {allowed.reshape(-1)[flat].item():.3g}; max |diff| overall {err.max().item():.3g}"
        )


def assert_bytes_equal_reference(c: torch.Tensor, r: torch.Tensor, what: str) -> None:
    """``c`` equals the reference rounded to c's dtype, bit for bit (±0 distinguished)."""
    want = r.to(c.dtype)
    assert c.shape == want.shape, f"{what}: shape {tuple(c.shape)} vs reference {tuple(want.shape)}"
    ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}
    a, b = c.contiguous().view(ints[c.element_size()]), want.contiguous().view(ints[c.element_size()])
    if not torch.equal(a, b):
        diff = a != b
        idx = [int(i) for i in diff.nonzero()[0]]
        pytest.fail(f"{what}: {diff.sum().item()} elements differ in bytes from the reference; first at "
                    f"{idx}: got {c[tuple(idx)].item()!r}, reference {want[tuple(idx)].item()!r}")


UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def error_stats(c: torch.Tensor, r: torch.Tensor) -> dict[str, float]:
    """Error of ``c`` (already in its declared output dtype) against the FP64 reference ``r``.

    ``abs_small``/``rel_large``: max |c − r| over |r| < 1, and max |c − r|/|r| over |r| ≥ 1.
    ``excess_*``: the same for the excess over the output rounding, max(0, |c − r| − u·|r|) with
    u the output dtype's unit roundoff — the part the tolerances put 4× headroom on
    (references/README.md, "How tolerances are set").
    """
    u = UNIT_ROUNDOFF[c.dtype]
    err = (c.to(torch.float64) - r).abs()
    mag = r.abs()
    exc = (err - u * mag).clamp_min(0)
    small = mag < 1
    big = ~small

    def mx(t: torch.Tensor) -> float:
        return t.max().item() if t.numel() else 0.0

    return {
        "abs_small": mx(err[small]),
        "rel_large": mx(err[big] / mag[big]),
        "excess_abs_small": mx(exc[small]),
        "excess_rel_large": mx(exc[big] / mag[big]),
    }


# ---------------------------------------------------------------------------------------------
# tests

SLOW_CASES = {"joint_attention_fused[real_n6889_l16_valid7_h1]"}  # 20–40 s each: run by .ci/run's slow step

def _params(cases: list[Case]) -> list:
    """(case, dtype, target) parameters: the target's device skip marks, ``slow`` for SLOW_CASES."""
    out = []
    for case in cases:
        for dt in case.dtypes:
            for tp in TARGETS:
                target = tp.values[0]
                slow = [pytest.mark.slow] if case.id in SLOW_CASES else []
                out.append(pytest.param(case, dt, target, id=f"{case.id}-{dt}-{target.id}",
                                        marks=[*tp.marks, *slow]))
    return out


PARAMS = _params(CASES)


@pytest.mark.parametrize("case,dtype_name,target", PARAMS)
def test_forward_matches_reference(case: Case, dtype_name: str, target: Target):
    c, r, out_dtypes = run_case(case, target, dtype_name)
    backend = target.family
    assert len(c) == len(r), f"{case.id}: {len(c)} outputs, reference has {len(r)}"
    what = f"{case.id} {target} {dtype_name}"
    for i, (ci, ri, od) in enumerate(zip(c, r, out_dtypes)):
        wi = what if len(c) == 1 else f"{what} output {i}"
        # judged at the declared output boundary (a wider output is rounded to it first;
        # test_output_dtype_follows_contract flags the dtype itself)
        ci = ci.to(od)
        if case.op in BYTE_EQUAL_OPS:
            assert_bytes_equal_reference(ci, ri, wi)
        else:
            tol = tolerance(case.op, backend, dtype_name, target.device)
            assert_within(ci, ri, tol["atol"], tol["rtol"], wi)


MASKED_SOFTMAX_CASES = [c for c in CASES if c.op == "joint_attn_softmax" and ("masked" in c.label or "pad" in c.label)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in MASKED_SOFTMAX_CASES])
def test_masked_keys_get_exactly_zero_probability(case: Case, target: Target):
    """numerics §2.4: padded text keys are excluded — probability exactly +0, not merely small
    (an atol would let a leaked 1e-8 through)."""
    (p,), _, _ = run_case(case, target, "float32")
    mask = _inputs_and_reference(case.id, "float32")[0][1]  # [B, S] bool
    masked = p.masked_select(~mask[:, None, None, :])
    assert masked.numel() > 0
    assert torch.equal(masked.view(torch.int32), torch.zeros_like(masked).view(torch.int32)), (
        f"{case.id} {target}: {(masked != 0).sum().item()} masked-key probabilities are not +0 "
        f"(max {masked.abs().max().item():.3g})")


DTYPE_PARAMS = _params([case for case in CASES if "real" not in case.label])


@pytest.mark.parametrize("case,dtype_name,target", DTYPE_PARAMS)
def test_output_dtype_follows_contract(case: Case, dtype_name: str, target: Target):
    c, _, out_dtypes = run_case(case, target, dtype_name)
    got = tuple(t.dtype for t in c)
    assert got == out_dtypes, f"{case.id} {target} {dtype_name}: output dtypes {got}, contract {out_dtypes}"


_TRANSFORMER_ROWS = set(TRANSFORMER_OPERATORS)  # the declaration's rows but the sampler's


def test_every_operator_has_reference_cases_and_tolerances():
    """Every transformer row of specs.py has a reference function, synthetic and real-size cases
    in both dtypes, and a tolerance entry (with a rationale) per backend and dtype."""
    assert _TRANSFORMER_ROWS <= set(specs()), _TRANSFORMER_ROWS - set(specs())
    assert set(ref.OPS) == _TRANSFORMER_ROWS
    assert TOLERANCES["profile"] == "drifttool-ws1-cpu-v2"
    for op in _TRANSFORMER_ROWS:
        labels = [c.label for c in CASES if c.op == op]
        assert any("real" in lab for lab in labels) and any("real" not in lab for lab in labels), op
        assert {dt for c in CASES if c.op == op for dt in c.dtypes} == set(DTYPES), op
        entry = TOLERANCES["ops"][op]
        assert entry.get("rationale"), f"{op}: tolerance entry without a rationale"
        for be in BACKENDS:
            for dt in DTYPES:
                tol = entry[be][dt]
                assert tol["atol"] >= 0 and tol["rtol"] >= 0, (op, be, dt)
                if entry.get("byte_equal"):
                    assert tol["atol"] == 0 and tol["rtol"] == 0, (op, be, dt)


def test_cuda_profile_covers_every_family_registered_on_cuda():
    """The CUDA profile is a separate qualification (RFC): every (op, family) registered on CUDA
    has a measured entry per dtype, derived as the CPU profile's (byte-equal ops at 0 / 0)."""
    assert CUDA_TOLERANCES is not None and CUDA_TOLERANCES["profile"] == "drifttool-ws1-cuda-v1"
    assert CUDA_TOLERANCES["measured_on"]["device"].startswith("NVIDIA")
    for op in _TRANSFORMER_ROWS:
        for be in BACKENDS:
            if not impls(op, be, "cuda"):
                continue
            for dt in DTYPES:
                tol = CUDA_TOLERANCES["ops"][op][be][dt]
                assert tol["atol"] >= 0 and tol["rtol"] >= 0, (op, be, dt)
                if TOLERANCES["ops"][op].get("byte_equal"):
                    assert tol["atol"] == 0 and tol["rtol"] == 0, (op, be, dt)


def test_reference_module_imports_nothing_from_drifttool():
    """The reference must never import the code under test: statically (its import statements)
    and at run time (a fresh interpreter importing it loads no other drifttool module)."""
    tree = ast.parse(REF_SOURCE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import in {REF_SOURCE}: from {'.' * node.level}{node.module}"
            imported.add(node.module)
    assert imported <= {"__future__", "math", "typing", "torch", "numpy"}, f"unexpected imports {imported}"
    code = ("import sys; import drifttool.references.ops; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'drifttool'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = eval(out.stdout.strip())  # a list literal of module names
    assert loaded == ["drifttool", "drifttool.references", "drifttool.references.ops"], loaded


def test_reference_rope_positions_follow_spec():
    """numerics §2.2: h=4 rows → −2..1, h=5 → −3..1; text starts at max(⌊h/2⌋, ⌊w/2⌋)."""
    img, txt = ref.rope_positions(4, 5, 3)
    assert img[:, 1].unique().tolist() == [-2, -1, 0, 1]
    assert img[:, 2].unique().tolist() == [-3, -2, -1, 0, 1]
    assert (img[:, 0] == 0).all() and img[6].tolist() == [0, -1, -2]  # token 6 = (i=1, j=1)
    assert txt.tolist() == [[2, 2, 2], [3, 3, 3], [4, 4, 4]]
    assert ref.rope_positions(64, 64, 1)[1].tolist() == [[32, 32, 32]]  # 1024²: text starts at 32


def test_reference_rope_table_matches_model_tables():
    """drifttool.model.rope's strict (``exact``) complex64 tables vs the reference's (same FP32
    angle contract, FP64 cos/sin), on the 1328² geometry with 512 text slots: each part within
    half an fp32 ULP of the FP64 value plus 1e-15 for FP64 error at a rounding tie (a bound from
    rounding, so it holds on every CPU dispatch level; torch's fp32 ``polar`` breaks it)."""
    img, txt = model_rope.rope_tables((83, 83), 512, axes_dims=(16, 56, 56), theta=10000, algorithm="exact")
    rimg, rtxt = ref.rope_tables(83, 83, 512)
    tol = TOLERANCES["tables"]["rope_tables_complex64"]
    for got, want, name in ((img, rimg, "image"), (txt, rtxt, "text")):
        g = torch.view_as_real(got.to(torch.complex128))
        w = torch.view_as_real(want)
        assert_within(g, w, tol["atol"], tol["rtol"], f"rope table ({name})")


def test_reference_vjp_matches_finite_differences():
    """The FP64 backward helper: vjp agrees with torch.autograd.gradcheck-style finite
    differences on tiny inputs for a few operators of each kind."""
    g = torch.Generator().manual_seed(386)
    x = _rn(g, 2, 3, 8)
    w, b = _rn(g, 12, 8, scale=0.3), _rn(g, 12, scale=0.1)
    shift, scale, gain = _rn(g, 2, 8), _rn(g, 2, 8), _rn(g, 8, shift=1.0)
    q = _rn(g, 2, 5, 2, 8)
    mask = _joint_mask([2, 1], 3, 2)
    freqs = _rope_freqs(1, 2, 3, (2, 2, 4))
    checks = [
        (ref.mlp_up_gemm_gelu, (x, w, b), {}),
        (ref.adaln_modulation, (x, shift, scale), {}),
        (ref.final_adaln_out, (x, shift, _rn(g, 16, 8, scale=0.3), _rn(g, 16)), {}),
        (ref.qk_rmsnorm, (q, gain), {}),
        (ref.multi_axis_rope, (q, freqs), {}),
        (ref.joint_attention_fused, (q, q * 0.5, q.flip(1), mask), {}),
        (ref.latent_pack_unpack, (_rn(g, 1, 2, 4, 2),), {"direction": "pack"}),
        (ref.latent_normalize, (_rn(g, 2, 3, 2), _rn(g, 3), _rn(g, 3).abs() + 1), {"inverse": True}),
    ]
    for fn, inputs, kw in checks:
        out = fn(*inputs, **kw)
        go = torch.randn(out.shape, generator=g, dtype=torch.float64)
        grads = ref.vjp(fn, inputs, go, **kw)
        for i, (a, gr) in enumerate(zip(inputs, grads)):
            if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
                assert gr is None
                continue
            a64 = a.to(torch.float64)
            # directional derivative along a random direction u: <go, J u> = <vjp, u>
            u = torch.randn(a.shape, generator=g, dtype=torch.float64)
            h = 1e-6
            args_p = list(inputs)
            args_m = list(inputs)
            args_p[i], args_m[i] = a64 + h * u, a64 - h * u
            fd = ((fn(*args_p, **kw) - fn(*args_m, **kw)) * go).sum() / (2 * h)
            assert torch.allclose((gr * u).sum(), fd, rtol=1e-6, atol=1e-8), f"{fn.__name__} input {i}"


# ---------------------------------------------------------------------------------------------
# measurement (python -m tests.ops.test_reference_accuracy --measure)


def _up2(x: float) -> float:
    """``x`` rounded up to 2 significant digits."""
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - 1
    return math.ceil(x / 10**e) * 10**e


def derive_profile(stats: dict, device: str) -> dict:
    """A tolerance profile from measured statistics, by the derivation of ``tolerances.json``
    (its ``derivation``: 4x the excess over one output rounding; bf16 floored at the fp32
    entry's excess of the same family); byte-equal operators stay at 0 / 0."""
    ops: dict = {}
    for op, fams in stats.items():
        if op not in TOLERANCES["ops"]:
            continue
        for fam, dts in fams.items():
            for dt, e in dts.items():
                u = UNIT_ROUNDOFF[DTYPES[e["out_dtype"]]] if e["out_dtype"] in DTYPES else 0.0
                exa, exr = e["excess_abs_small"], e["excess_rel_large"]
                if dt == "bfloat16" and "float32" in dts:
                    exa = max(exa, dts["float32"]["excess_abs_small"])
                    exr = max(exr, dts["float32"]["excess_rel_large"])
                tol = ({"atol": 0.0, "rtol": 0.0} if TOLERANCES["ops"][op].get("byte_equal") else
                       {"atol": _up2(4 * exa), "rtol": _up2(u + 4 * exr)})
                ops.setdefault(op, {}).setdefault(fam, {})[dt] = {
                    **tol, "out_dtype": e["out_dtype"], "measured": {k: e[k] for k in (
                        "abs_small", "rel_large", "excess_abs_small", "excess_rel_large")}}
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor()
    return {"profile": f"drifttool-ws1-{device}-v1", "device": device,
            "measured_on": {"date": time.strftime("%Y-%m-%d"), "device": name,
                            "torch": torch.__version__, "command": " ".join(["python", "-m",
                            "tests.ops.test_reference_accuracy", *sys.argv[1:]])},
            "derivation": TOLERANCES["derivation"], "criterion": TOLERANCES["criterion"],
            "ops": ops}


def measure(device: str = "cpu") -> dict:
    """Per (op, backend, dtype): the error statistics (``error_stats``), max over all cases, for
    the families registered on ``device``."""
    stats: dict = {}
    for case in CASES:
        for dt in case.dtypes:
            for be in BACKENDS:
                if device != "cpu" and not impls(case.op, be, device):
                    continue
                t0 = time.perf_counter()
                c, r, ods = run_case(case, Target(be, device), dt)
                e = stats.setdefault(case.op, {}).setdefault(be, {}).setdefault(dt, {})
                for ci, ri, od in zip(c, r, ods):
                    for key, val in error_stats(ci.to(od), ri).items():
                        e[key] = max(e.get(key, 0.0), val)
                    e["out_dtype"] = str(od).removeprefix("torch.")
                last = error_stats(c[0].to(ods[0]), r[0])
                print(f"{case.id:48s} {dt:9s} {be:10s} abs|r|<1 {last['abs_small']:9.3g}  "
                      f"rel|r|>=1 {last['rel_large']:9.3g}  excess {last['excess_abs_small']:9.3g} "
                      f"{last['excess_rel_large']:9.3g}  {time.perf_counter() - t0:6.2f}s", flush=True)
    if device != "cpu":
        return stats
    img, txt = model_rope.rope_tables((83, 83), 512, axes_dims=(16, 56, 56), theta=10000, algorithm="exact")
    rimg, rtxt = ref.rope_tables(83, 83, 512)
    got = torch.view_as_real(torch.cat([img, txt]))  # float32 [S, 64, 2]
    want = torch.view_as_real(torch.cat([rimg, rtxt]))
    stats["rope_tables_complex64"] = error_stats(got, want)
    print("rope_tables_complex64", stats["rope_tables_complex64"])
    return stats


if __name__ == "__main__":  # pragma: no cover
    torch.set_num_threads(2)
    if "--measure" in sys.argv:
        dev = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
        result = measure(dev)
        if "--derive" in sys.argv:
            result = derive_profile(result, dev)
        if "--json" in sys.argv:
            Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(result, indent=1))
