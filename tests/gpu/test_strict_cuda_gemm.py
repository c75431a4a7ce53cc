"""The strict CUDA GEMM family on the GPU, in raw bytes: a row's bytes do not change with batch
size, batch position, prompt padding, launch geometry, repetition or output-feature / row shards
(TP / SP), at 6889 image tokens and full width; the fused activations, SiLU and sinusoid equal the
CPU's bytes; accuracy vs FP64; and a measurement of strict CUDA vs strict CPU per operator (one
line each, run with ``-s``) for the tolerance profile.

    $ python -m pytest tests/gpu/test_strict_cuda_gemm.py -n 0 -s
"""

from __future__ import annotations

import math

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the families)
from drifttool.ops import strict_math
from drifttool.ops.registry import implementation
from drifttool.ops.strict import embed
from drifttool.references import ops as ref
from tests.strict_cuda_cases import gelu_tanh_f32_order, lin, rn
from tests.conftest import assert_same_bytes, bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():  # without CUDA, importing the kernels here would decorate them before
    # tests/ops/strict_cuda/conftest.py sets TRITON_INTERPRET=1 for the interpreter suite
    from drifttool.ops.strict_cuda.kernels import embed as kembed
    from drifttool.ops.strict_cuda.kernels import gemm, gemv

D, HEADS, MLP, TOKENS = 3072, 24, 12288, 6889
GEMM_OPS = ("latent_proj_gemm", "qkv_bias_gemm", "attn_out_bias_gemm", "mlp_up_gemm_gelu", "mlp_down_gemm",
            "adaln_mod_projection", "timestep_embed_mlp", "lora_merge")


def cuda(op):
    return implementation(op, "strict", "cuda")


def cpu(op):
    return implementation(op, "strict", "cpu")


# ---------------------------------------------------------------------------------------------
# row invariance at 6889 tokens, full width

ROW_CASES = {  # op: (input width K, make the call given x)
    "latent_proj_gemm": 64,
    "qkv_bias_gemm": D,
    "attn_out_bias_gemm": D,
    "mlp_up_gemm_gelu": D,
    "mlp_down_gemm": MLP,
}


def _row_call(op):
    k = ROW_CASES[op]
    if op == "qkv_bias_gemm":
        ws = [t for i in range(3) for t in lin(D, D, seed=10 + 2 * i)]
        return lambda x: torch.cat([t.flatten(-2) for t in cuda(op)(x, *ws, HEADS)], -1)
    n = {"latent_proj_gemm": D, "mlp_up_gemm_gelu": MLP}.get(op, D)
    w, b = lin(n, k, seed=20)
    return lambda x: cuda(op)(x, w, b)


@pytest.mark.parametrize("op", list(ROW_CASES))
def test_rows_bytes_invariant_at_6889_tokens(op):
    k = ROW_CASES[op]
    f = _row_call(op)
    x = rn(1, TOKENS, k, seed=1)
    full = f(x)
    assert_same_bytes(full, f(x), f"{op}: repetition")
    batch = torch.cat([rn(1, TOKENS, k, seed=2), rn(1, TOKENS, k, seed=3), x])  # [3, 6889, K]
    assert_same_bytes(full, f(batch)[2:], f"{op}: alone vs position 2 of batch 3")
    assert_same_bytes(full[:, :1], f(x[:, :1]), f"{op}: row 0 alone")
    assert_same_bytes(full[:, -3:], f(x[:, -3:]), f"{op}: last 3 rows alone")
    padded = torch.cat([x, rn(1, 37, k, seed=4)], 1)  # 37 more (padding) rows
    assert_same_bytes(full, f(padded)[:, :TOKENS], f"{op}: 37 padding rows after")
    for t in (2, 4, 8):  # SP: contiguous row shards
        parts = [f(s) for s in x.tensor_split(t, dim=1)]
        assert_same_bytes(full, torch.cat(parts, 1), f"{op}: {t} row shards")


def test_text_rows_invariant_to_prompt_padding():
    """A text stream of 128 slots vs the same prompt padded to 165 slots (batch 2, CFG)."""
    w, b = lin(D, D, seed=30)
    x = rn(2, 128, D, seed=31)
    full = cuda("attn_out_bias_gemm")(x, w, b)
    padded = torch.cat([x, rn(2, 37, D, seed=32)], 1)
    assert_same_bytes(full, cuda("attn_out_bias_gemm")(padded, w, b)[:, :128], "128 vs 165 text slots")


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_output_feature_shards_reproduce_bytes(shards):
    """TP: each rank's slice of the output features (whole heads for q/k/v) is the unsharded
    output's slice, byte for byte."""
    x = rn(1, 1000, D, seed=40)
    w, b = lin(MLP, D, seed=41)
    full = gemm.linear(x, w, b, act="gelu_tanh")
    step = MLP // shards
    parts = [gemm.linear(x, w[i:i + step], b[i:i + step], act="gelu_tanh") for i in range(0, MLP, step)]
    assert_same_bytes(full, torch.cat(parts, -1), f"{shards} column shards")
    ws = [t for i in range(3) for t in lin(D, D, seed=42 + 2 * i)]
    q, k, v = cuda("qkv_bias_gemm")(x, *ws, HEADS)
    h = HEADS // shards
    for r in range(shards):
        sl = slice(r * h * 128, (r + 1) * h * 128)
        part = cuda("qkv_bias_gemm")(x, ws[0][sl], ws[1][sl], ws[2][sl], ws[3][sl], ws[4][sl], ws[5][sl], h)
        for got, want, name in zip(part, (q, k, v), "qkv"):
            assert_same_bytes(want[:, :, r * h:(r + 1) * h], got, f"{name}: rank {r} of {shards} heads")


CONFIGS = {"bm128bn128w8s3": dict(tma=False),
           "bm128bn128w8s3.tma": dict(),
           "bm128bn128w8s3.tma.p2": dict(persistent=2),
           "bm128bn256w8s3.tma.p1": dict(block_n=256, persistent=1),
           "bm64bn128w4s4.tma": dict(block_m=64, block_n=128, num_warps=4, num_stages=4),
           "bm128bn64w8s3.tma": dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
           "bm128bn256w8s3.tma": dict(block_m=128, block_n=256, num_warps=8, num_stages=3),
           "bm64bn64w4s2": dict(block_m=64, block_n=64, num_warps=4, num_stages=2, tma=False),
           "bm128bn128w8s3.tma.r128": dict(maxnreg=128)}  # two CTAs per SM, the epilogue spills


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("act", [None, "gelu_tanh", "gelu_tanh_f32"])
def test_launch_geometry_does_not_change_bytes(name, act):
    cfg = gemm.GemmConfig(**CONFIGS[name])
    x = rn(777, D, seed=50)
    w, b = lin(D + 64, D, seed=51)  # N not a multiple of 128
    assert_same_bytes(gemm.linear(x, w, b, act=act), gemm.linear(x, w, b, act=act, config=cfg), cfg.id)
    xt, wt = x[:, :1000], w[:, :1000]  # K = 1000: a tail chunk, 16-byte rows
    assert_same_bytes(gemm.linear(xt, wt, b), gemm.linear(xt, wt, b, config=cfg), f"{cfg.id}, K = 1000")


@pytest.mark.parametrize("cfg", [dict(block_m=32, block_n=128, num_warps=4, num_stages=1, tma=False),
                                 dict(block_m=32, block_n=64, num_warps=4, num_stages=1, tma=True)],
                         ids=["fp32-32x128", "fp32-tma"])
def test_fp32_path_launch_geometry_and_rows(cfg):
    cfg = gemm.GemmConfig(**cfg)
    x = rn(3, 300, dtype=torch.float32, seed=55)
    w, b = lin(500, 300, seed=56, dtype=torch.float32)
    full = gemm.linear(x, w, b)
    assert_same_bytes(full, gemm.linear(x, w, b, config=cfg), cfg.id)
    assert_same_bytes(full[1:2], gemm.linear(x[1:2], w, b), "fp32: row alone")
    xb = x.to(torch.bfloat16)  # bf16 activations × an FP32 (e.g. LoRA-merged) weight: IEEE FP32
    mixed = gemm.linear(xb, w, b)
    assert_same_bytes(mixed[2:], gemm.linear(xb[2:], w, b), "bf16 × fp32: row alone")


def test_odd_k_and_unaligned_rows_take_the_pointer_path():
    x = rn(37, 100, seed=57)[:, :99]  # K = 99: rows not 16-byte aligned (no TMA)
    w, b = lin(70, 99, seed=58)
    y = gemm.linear(x, w, b)
    want = x.double() @ w.double().T + b.double()
    assert ((y.double() - want).abs() <= 2**-7 * want.abs() + 1e-3).all()
    assert_same_bytes(y[5:6], gemm.linear(x[5:6], w, b), "K = 99: row alone")


# ---------------------------------------------------------------------------------------------
# the GEMV (adaln_mod_projection, timestep_embed_mlp): its stated order, reproduced by torch ops


def gemv_order(x, w, b):
    """The GEMV's stated order by separate torch FP32 ops (64 lane sums over K ascending, adjacent
    lanes added pairwise, then the bias): IEEE operations on any device."""
    pad = (-x.shape[-1]) % 64
    p = torch.nn.functional.pad(x.float(), (0, pad))[:, None, :] * torch.nn.functional.pad(w.float(), (0, pad))[None]
    lanes = p.unflatten(-1, (-1, 64))
    s = torch.zeros(lanes.shape[:2] + (64,), device=x.device)
    for c in range(lanes.shape[2]):
        s = s + lanes[:, :, c]
    while s.shape[-1] > 1:
        s = s[..., 0::2] + s[..., 1::2]
    return s[..., 0] + (0 if b is None else b.float())


def test_gemv_full_width_rows_order_and_geometry():
    """adaln_mod_projection at full width (N = 6d = 18432, K = d): a row's bytes are the same alone,
    in M = 3 and in M = 7, equal the stated order computed by torch (on the GPU and on the CPU),
    and do not depend on the launch configuration."""
    w, b = lin(6 * D, D, seed=90)
    temb = rn(7, D, seed=91, scale=2.0)
    op = cuda("adaln_mod_projection")
    full = op(temb, w, b)
    for m in (1, 3):
        assert_same_bytes(op(temb[:m], w, b), full[:m], f"adaln: rows 0..{m - 1} alone vs in M = 7")
    assert_same_bytes(op(temb[5:6], w, b), full[5:6], "adaln: row 5 alone vs in M = 7")
    s = kembed.silu32(temb)
    y32 = gemv.gemv(s[:2], w, b, out_dtype=torch.float32)
    assert_same_bytes(y32, gemv_order(s[:2], w, b), "gemv vs its order by torch on the GPU")
    assert_same_bytes(y32[:1].cpu(), gemv_order(s[:1].cpu(), w.cpu(), b.cpu()), "gemv vs its order on the CPU")
    assert_same_bytes(full[:2], y32.to(torch.bfloat16), "bf16 output = one cast of the FP32 result")
    for cfg in (gemv.GemvConfig(block_n=32, num_warps=4, unroll=1),
                gemv.GemvConfig(block_n=128, num_warps=8, unroll=2)):
        assert_same_bytes(gemv.gemv(s, w, b, out_dtype=torch.bfloat16, config=cfg), full, cfg.id)
    tau = torch.tensor([1.0, 0.3, 0.7], device="cuda")
    w1, b1 = lin(D, 256, seed=92)
    w2, b2 = lin(D, D, seed=93)
    t3 = cuda("timestep_embed_mlp")(tau, w1, b1, w2, b2)
    assert_same_bytes(cuda("timestep_embed_mlp")(tau[1:2], w1, b1, w2, b2), t3[1:2], "temb: sample 1 of 3 alone")


def test_lora_merge_fused_epilogue_equals_separate_fp32_ops():
    """lora_merge (64×64 tiles, the merge in the epilogue) = fp32(W) + fp32(s)·(B·A) by separate
    torch ops on B·A from the default FP32 tiles (16×64): the tile and the fusion change no byte."""
    w = rn(D, D, seed=95)
    a, bb = rn(64, D, seed=96, dtype=torch.float32), rn(D, 64, seed=97, dtype=torch.float32) * 0.01
    delta = gemm.linear(bb, a.t())
    want = w.float() + torch.tensor(0.5, dtype=torch.float32, device="cuda") * delta
    assert_same_bytes(cuda("lora_merge")(w, a, bb, 0.5), want, "lora_merge vs separate FP32 ops")


# ---------------------------------------------------------------------------------------------
# elementwise arithmetic done the CPU's way: byte-equal to the CPU


@pytest.mark.parametrize("act,fn", [("gelu_tanh", strict_math.gelu_tanh32), ("silu", strict_math.silu32)])
def test_epilogue_activation_equals_cpu_bytes(act, fn):
    x = rn(1000, D, seed=60, scale=3.0)
    w, b = lin(4096, D, seed=61)
    pre = gemm.linear(x, w, b, out_dtype=torch.float32)
    got = gemm.linear(x, w, b, act=act, out_dtype=torch.float32)
    assert_same_bytes(got.cpu(), fn(pre.cpu()), f"{act} epilogue vs CPU {fn.__name__}")
    bf = gemm.linear(x, w, b, act=act)
    assert_same_bytes(bf, got.to(torch.bfloat16), "bf16 output = one cast of the FP32 result")


def test_gelu_f32_epilogue_is_its_formula_and_close_to_the_f64_one():
    """The optional FP32 GELU epilogue equals its formula done by torch (on the GPU and the CPU);
    prints how often its bf16 bytes equal the FP64 epilogue's (the CPU's) at full width."""
    x = rn(1000, D, seed=63, scale=3.0)
    w, b = lin(4096, D, seed=64)
    pre = gemm.linear(x, w, b, out_dtype=torch.float32)
    got = gemm.linear(x, w, b, act="gelu_tanh_f32", out_dtype=torch.float32)
    assert_same_bytes(got, gelu_tanh_f32_order(pre), "FP32 GELU epilogue vs its formula by torch (GPU)")
    assert_same_bytes(got[:64].cpu(), gelu_tanh_f32_order(pre[:64].cpu()), "… by torch (CPU)")
    c = compare(gemm.linear(x, w, b, act="gelu_tanh_f32"), gemm.linear(x, w, b, act="gelu_tanh"))
    print(f"\nGELU epilogue f32 vs f64, bf16 output [1000, 4096]: max|Δ| {c['max_abs']:.3g}, "
          f"max ulp {c['max_ulp']}, bytes equal {c['equal']:.4f}")
    assert c["max_abs"] <= 2.0**-8 * c["scale"], c  # (ulps can be many near 0: the FP64 form rounds tiny GELUs to -0)


def test_silu_and_sinusoid_equal_cpu_bytes():
    x = rn(300_001, scale=8.0, seed=62, dtype=torch.float32, device="cpu")
    x[:4] = torch.tensor([math.inf, 800.0, -800.0, -0.0])
    assert_same_bytes(kembed.silu32(x.cuda()).cpu(), strict_math.silu32(x), "silu32")
    nan_in = torch.tensor([math.nan, -math.inf])  # NaN out: the GPU's NaN payload is its own
    assert torch.isnan(kembed.silu32(nan_in.cuda()).cpu()).all() and torch.isnan(strict_math.silu32(nan_in)).all()
    xb = x.to(torch.bfloat16)
    assert_same_bytes(kembed.silu32(xb.cuda()).cpu(), strict_math.silu32(xb.float()), "silu32 of bf16")
    tau = torch.cat([torch.tensor([1.0, 0.019999980926513672, 0.0]), torch.rand(61)])
    assert_same_bytes(kembed.sinusoid(tau.cuda()).cpu(), embed.sinusoid(tau), "sinusoid")


# ---------------------------------------------------------------------------------------------
# accuracy vs FP64, through the registry


def _cases(dtype, device, tokens, d, heads, mlp, seed=70):
    """{op: (args, kwargs)} for every GEMM-bearing operator at one geometry."""
    def x_(s, k, sd):
        return rn(1, s, k, seed=sd, dtype=dtype, device=device)

    ws = [t for i in range(3) for t in lin(d, d, seed=seed + 2 * i, dtype=dtype, device=device)]
    tau = torch.tensor([1.0, 0.3]).to(device)
    return {
        "latent_proj_gemm": ((x_(tokens, 64, seed), *lin(d, 64, seed + 10, dtype, device)), {}),
        "qkv_bias_gemm": ((x_(tokens, d, seed + 1), *ws, heads), {}),
        "attn_out_bias_gemm": ((x_(tokens, d, seed + 2), *lin(d, d, seed + 12, dtype, device)), {}),
        "mlp_up_gemm_gelu": ((x_(tokens, d, seed + 3), *lin(mlp, d, seed + 14, dtype, device)), {}),
        "mlp_down_gemm": ((x_(tokens, mlp, seed + 4), *lin(d, mlp, seed + 16, dtype, device)), {}),
        "adaln_mod_projection": ((rn(2, d, seed=seed + 5, dtype=dtype, device=device, scale=2.0),
                                  *lin(6 * d, d, seed + 18, dtype, device)), {}),
        "timestep_embed_mlp": ((tau, *lin(d, 256, seed + 20, dtype, device), *lin(d, d, seed + 22, dtype, device)),
                               {}),
        "lora_merge": ((lin(d, d, seed + 24, dtype, device)[0], rn(16, d, seed=seed + 26, dtype=torch.float32,
                        device=device), rn(d, 16, seed=seed + 27, dtype=torch.float32, device=device) * 0.01, 2.0),
                       {}),
    }


def _outs(y):
    return y if isinstance(y, tuple) else (y,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_registry_ops_accurate_vs_fp64(dtype):
    cases = _cases(dtype, "cuda", 64, D, HEADS, MLP)
    for op, (args, kw) in cases.items():
        got = _outs(cuda(op)(*args, **kw))
        cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
        want = _outs(ref.OPS[op](*cpu_args, **kw) if op in ref.OPS else cpu("lora_merge")(*cpu_args).double())
        u = 2.0**-8 if got[0].dtype == torch.bfloat16 else 2.0**-24
        for g, r in zip(got, want):
            r = r.double()
            bound = 4 * u * r.abs() + 1e-3 * r.abs().max() * (16 if g.dtype == torch.bfloat16 else 1)
            err = (g.cpu().double() - r).abs()
            assert (err <= bound).all(), f"{op} {dtype}: max error {err.max().item():.3g}"


# ---------------------------------------------------------------------------------------------
# strict CUDA vs strict CPU: the measurement behind the tolerance profile


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns as integers ordered like the values (adjacent floats differ by 1)."""
    i = bits(t).long()
    sign = 1 << (8 * t.element_size() - 1)
    return torch.where(i < 0, -(i & (sign - 1)), i)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """max |Δ|, max ulp distance (in the output dtype), fraction of elements with equal bytes."""
    a, b = a.cpu(), b.cpu()
    return {"max_abs": (a.double() - b.double()).abs().max().item(),
            "max_ulp": (_ordered(a) - _ordered(b)).abs().max().item(),
            "equal": (bits(a) == bits(b)).double().mean().item(),
            "scale": b.double().abs().max().item()}


@pytest.mark.parametrize("geometry", ["tiny", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_measure_strict_cuda_vs_strict_cpu(geometry, dtype):
    """Prints one line per operator; asserts a generous bound only (relative to the output's
    magnitude): the CPU (contract v2) and CUDA (cuda1) K orders differ by design."""
    d, heads, mlp, tokens = (32, 2, 128, 7) if geometry == "tiny" else (D, HEADS, MLP, 64)
    cases = _cases(dtype, "cpu", tokens, d, heads, mlp)
    for op, (args, kw) in cases.items():
        want = _outs(cpu(op)(*args, **kw))
        dev = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
        got = _outs(cuda(op)(*dev, **kw))
        for i, (g, w) in enumerate(zip(got, want)):
            c = compare(g, w)
            print(f"\nstrict-cuda vs strict-cpu {op}[{i}] {geometry} {str(dtype)[6:]}: max|Δ| {c['max_abs']:.3g} "
                  f"(max |y| {c['scale']:.3g}), max ulp {c['max_ulp']}, bytes equal {c['equal']:.4f}")
            # bf16: two ulps of the largest output; FP32: two K orders over up to 12288 terms
            rel = 2 * 2.0**-8 if g.dtype == torch.bfloat16 else 1e-4
            assert c["max_abs"] <= rel * max(c["scale"], 1e-30), f"{op}: {c}"


def test_registry_fails_closed_on_gradients_and_dtypes():
    from drifttool.errors import UnsupportedConfigError

    x = rn(1, 7, 64, seed=80).requires_grad_(True)
    w, b = lin(D, 64, seed=81)
    with pytest.raises(UnsupportedConfigError, match="forward only"):  # the GEMMs have a backward
        cuda("adaln_mod_projection")(x[:, 0], *lin(6 * 64, 64, seed=82))
    with pytest.raises(UnsupportedConfigError, match="float16"):
        cuda("mlp_down_gemm")(x.detach().half(), w.half(), None)
