"""Strict CUDA vs production CUDA, per operator, at the model's full-size shapes, side by side in
one run (each strict CUDA operator the registry holds: ``impls(op, "strict", "cuda")``).

    $ python benchmarks/bench_strict_cuda.py [--shapes 1024x1024,1664x928] [--batches 1,2] [--ops a,b]
    operator  case  shape  batch  strict ms  prod ms  strict/prod  strict rate  prod rate  bound  strict % of limit

Shapes: Qwen-Image's full width (d = 3072, 24 heads × 128, MLP 12288, text width 3584), a prompt
of 128 text slots (batch 2 = CFG-batched cond + uncond, 128 and 77 valid), 4096 image tokens
(1024²) or 6032 (1664×928); bf16 activations and weights, FP32 where the signature says so (τ,
σ, attention scores and probabilities, LoRA factors). Per-token operators run on the image
stream's rows. Each cell is the median of ``triton.testing.do_bench`` (CUDA events, L2 flushed
between calls). The rate column is TFLOP/s for operators whose roofline time is set by the
tensor cores (≈ 790 TFLOP/s bf16 dense on an H200) and GB/s (input + output bytes once) for the
others (≈ 4.8 TB/s); "% of limit" is the roofline time over the measured time. ``mlp_up_gemm_gelu`` has four more rows, ``img, GELU f32`` and ``img, GELU f64``: the GEMM
with each epilogue (``strict_cuda.linear.GELU_EPILOGUE`` chooses the registered one), side by side,
and the same with 128 registers per thread (``r128``: two CTAs per SM; same bytes)
(``--ops mlp_up_gemm_gelu`` runs just these). Operators
without a strict CUDA implementation are listed as such. Without CUDA the script prints why and
exits 0. The table's title names the GPU, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import drifttool.ops  # noqa: E402,F401
from drifttool.ops.registry import implementation, impls, specs  # noqa: E402

PEAK_FLOPS = 790e12  # H200 bf16 dense tensor-core peak
PEAK_BYTES = 4.8e12  # H200 HBM3e bandwidth
SHAPES = {"1024x1024": (64, 64), "1664x928": (58, 104)}  # packed latent grid (h, w)
D, HEADS, DH, MLP, TXT_DIM, TXT = 3072, 24, 128, 12288, 3584, 128


@dataclass
class Case:
    """One operator call: ``make()`` → (args, kwargs) on the device; ``flops`` of the call."""

    op: str
    label: str
    make: Callable[[], tuple[tuple, dict]]
    flops: float
    strict: Callable[..., Any] | None = None  # a variant in place of the registered strict operator


def _rn(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _lin(n, k):
    return _rn(n, k, scale=1 / math.sqrt(k)), _rn(n, scale=0.1)


def _gelu_variant(act: str, maxnreg: int | None = None) -> Callable[..., Any]:
    """mlp_up_gemm_gelu with the given epilogue (``linear.GELU_EPILOGUE`` picks the registered
    one): both timed side by side, so the FP64 (CPU bytes) vs FP32 (faster) choice is measured;
    ``maxnreg`` = 128 caps the registers so two CTAs share an SM (same bytes)."""
    def run(x, w, b):
        from drifttool.ops.strict_cuda.kernels import gemm

        cfg = gemm.GemmConfig(maxnreg=maxnreg) if maxnreg else None
        return gemm.linear(x, w, b, act=act, config=cfg)

    return run


def cases(grid: tuple[int, int], batch: int) -> list[Case]:
    """Every operator's full-size call(s) at this image grid and batch."""
    h, w = grid
    n = h * w
    s = TXT + n  # joint sequence [text, image]
    m = batch * n  # image-stream rows
    lens = [128, 77][:batch] if batch <= 2 else [128] * batch
    tm = torch.arange(TXT, device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None]
    key_mask = torch.cat([tm, torch.ones(batch, n, dtype=torch.bool, device="cuda")], 1)  # [B, S]

    def qkv4(seq):
        return _rn(batch, seq, HEADS, DH)

    def scores():
        return torch.randn(batch, HEADS, s, s, device="cuda") * 3

    def probs():
        return torch.softmax(scores(), -1)

    def sde_args():
        from drifttool.ops.scheduler import flow_sigma_table

        sig = flow_sigma_table(50, n)
        v, x, prev = (torch.randn(batch, n, 64, device="cuda") for _ in range(3))
        return (v, x, sig[3], sig[4]), {"eta": 1.2, "sigma_max": sig[1], "prev_sample": prev}

    def freqs():
        ang = torch.randn(s, DH // 2, device="cuda")
        return torch.polar(torch.ones_like(ang), ang)  # complex64 [S, 64]

    att = 2.0 * batch * HEADS * s * s * DH
    C = [
        Case("latent_pack_unpack", "pack", lambda: ((_rn(batch, 16, 2 * h, 2 * w),), {"direction": "pack"}), 0),
        Case("latent_normalize", "forward", lambda: (
            (_rn(batch, 16, 1, 2 * h, 2 * w), _rn(16), _rn(16).abs() + 1), {}), 0),
        Case("latent_proj_gemm", "img_in 64→d", lambda: ((_rn(batch, n, 64), *_lin(D, 64)), {}), 2.0 * m * 64 * D),
        Case("latent_proj_gemm", "proj_out d→64", lambda: ((_rn(batch, n, D), *_lin(64, D)), {}), 2.0 * m * D * 64),
        Case("txt_in_rmsnorm_linear", f"[B,{TXT},{TXT_DIM}]→d", lambda: (
            (_rn(batch, TXT, TXT_DIM, scale=3), _rn(TXT_DIM, scale=0.3) + 1, *_lin(D, TXT_DIM)), {}),
            2.0 * batch * TXT * TXT_DIM * D),
        Case("timestep_embed_mlp", "[B]→d", lambda: (
            (torch.rand(batch, device="cuda"), *_lin(D, 256), *_lin(D, D)), {}), 2.0 * batch * (256 * D + D * D)),
        Case("adaln_mod_projection", "[B,d]→6d", lambda: ((_rn(batch, D), *_lin(6 * D, D)), {}), 2.0 * batch * D * 6 * D),
        Case("adaln_modulation", "img", lambda: ((_rn(batch, n, D, scale=2), _rn(batch, D), _rn(batch, D)), {}), 0),
        Case("adaln_gate_residual", "img", lambda: ((_rn(batch, n, D), _rn(batch, D), _rn(batch, n, D)), {}), 0),
        Case("qkv_bias_gemm", "img", lambda: ((_rn(batch, n, D), *_lin(D, D), *_lin(D, D), *_lin(D, D), HEADS), {}),
             3 * 2.0 * m * D * D),
        Case("qk_rmsnorm", "img", lambda: ((_rn(batch, n, HEADS, DH, scale=3), _rn(DH) + 1), {}), 0),
        Case("multi_axis_rope", "joint", lambda: ((qkv4(s), freqs()), {}), 0),
        Case("joint_attn_qk_gemm", "joint", lambda: ((qkv4(s), qkv4(s)), {"text_len": TXT}), att),
        Case("joint_attn_softmax", "joint", lambda: ((scores(), key_mask), {"text_len": TXT}), 0),
        Case("joint_attn_av_gemm", "joint", lambda: ((probs(), qkv4(s), key_mask), {"text_len": TXT}), att),
        Case("joint_attention_fused", "joint, masked", lambda: (
            (qkv4(s), qkv4(s), qkv4(s), key_mask), {"text_len": TXT}), 2 * att),
        Case("attn_out_bias_gemm", "img", lambda: ((_rn(batch, n, D), *_lin(D, D)), {}), 2.0 * m * D * D),
        Case("mlp_up_gemm_gelu", "img", lambda: ((_rn(batch, n, D), *_lin(MLP, D)), {}), 2.0 * m * D * MLP),
        Case("mlp_up_gemm_gelu", "img, GELU f32", lambda: ((_rn(batch, n, D), *_lin(MLP, D)), {}),
             2.0 * m * D * MLP, strict=_gelu_variant("gelu_tanh_f32")),
        Case("mlp_up_gemm_gelu", "img, GELU f64", lambda: ((_rn(batch, n, D), *_lin(MLP, D)), {}),
             2.0 * m * D * MLP, strict=_gelu_variant("gelu_tanh")),
        Case("mlp_up_gemm_gelu", "img, GELU f32 r128", lambda: ((_rn(batch, n, D), *_lin(MLP, D)), {}),
             2.0 * m * D * MLP, strict=_gelu_variant("gelu_tanh_f32", 128)),
        Case("mlp_up_gemm_gelu", "img, GELU f64 r128", lambda: ((_rn(batch, n, D), *_lin(MLP, D)), {}),
             2.0 * m * D * MLP, strict=_gelu_variant("gelu_tanh", 128)),
        Case("mlp_down_gemm", "img", lambda: ((_rn(batch, n, MLP), *_lin(D, MLP)), {}), 2.0 * m * MLP * D),
        Case("final_adaln_out", "img", lambda: ((_rn(batch, n, D, scale=2), _rn(batch, D), *_lin(2 * D, D)), {}),
             2.0 * batch * D * 2 * D),
        Case("cfg_combine_renorm", "[B,N,64]", lambda: (
            (torch.randn(batch, n, 64, device="cuda"), torch.randn(batch, n, 64, device="cuda"), 4.0), {}), 0),
        Case("flow_sde_step_logp", "[B,N,64]", sde_args, 0),
        Case("lora_merge", "d×d, r=64", lambda: (
            (_rn(D, D), torch.randn(64, D, device="cuda"), torch.randn(D, 64, device="cuda") * 0.01, 0.5), {}),
            2.0 * D * D * 64),
    ]
    return C


def _tensors(x: Any):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def nbytes(args, kwargs, out) -> int:
    """Input and output bytes, each tensor once (the memory traffic floor)."""
    seen, total = set(), 0
    for t in _tensors((args, kwargs, out)):
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def time_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--ops", default="", help="comma-separated operator names (default: all)")
    ap.add_argument("--markdown", action="store_true", help="also print the table as markdown (docs/benchmarks.md)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_strict_cuda: no CUDA device here; skipped (run it on the GPU machine)")
        return 0
    wanted = set(filter(None, args.ops.split(",")))
    missing = [op for op in specs() if not impls(op, "strict", "cuda") and (not wanted or op in wanted)]
    rows = []
    with torch.no_grad():
        for shape in args.shapes.split(","):
            grid = SHAPES[shape]
            for batch in map(int, args.batches.split(",")):
                for case in cases(grid, batch):
                    if (wanted and case.op not in wanted) or not impls(case.op, "strict", "cuda"):
                        continue
                    a, kw = case.make()
                    strict = case.strict or implementation(case.op, "strict", "cuda")
                    prod = implementation(case.op, "production", "cuda")
                    try:
                        out = strict(*a, **kw)
                        t_s = time_ms(lambda: strict(*a, **kw))
                        t_p = time_ms(lambda: prod(*a, **kw))
                    except Exception as e:  # noqa: BLE001 - report the failing case, go on
                        print(f"{case.op} {case.label} {shape} b{batch}: {type(e).__name__}: {str(e)[:200]}",
                              file=sys.stderr, flush=True)
                        continue
                    by = nbytes(a, kw, out)
                    roof_f, roof_b = case.flops / PEAK_FLOPS, by / PEAK_BYTES
                    flop_bound = roof_f >= roof_b
                    roof = max(roof_f, roof_b) * 1e3  # ms

                    def rate(t_ms, fb=flop_bound):
                        return (f"{case.flops / t_ms / 1e9:.0f} TFLOP/s" if fb
                                else f"{by / t_ms / 1e6:.0f} GB/s")

                    rows.append((case.op, case.label, shape, batch, t_s, t_p, rate(t_s), rate(t_p),
                                 "tensor cores" if flop_bound else "HBM", roof / t_s))
                    print(f"{case.op:24s} {case.label:16s} {shape} b{batch}: strict {t_s:.3f} ms, "
                          f"production {t_p:.3f} ms", file=sys.stderr, flush=True)
                    del a, kw, out
                    torch.cuda.empty_cache()
    import triton

    props = torch.cuda.get_device_properties(0)
    title = (f"strict CUDA vs production CUDA, per operator — {datetime.date.today()} — {props.name} "
             f"(sm_{props.major}{props.minor}), torch {torch.__version__}, CUDA {torch.version.cuda}, "
             f"Triton {triton.__version__}, Python {platform.python_version()}")
    cols = ("operator", "case", "shape", "batch", "strict ms", "prod ms", "strict/prod", "strict rate",
            "prod rate", "bound", "strict % of limit")
    table = Table(title=title)
    for col in cols:
        table.add_column(col, justify="left" if col in ("operator", "case", "bound") else "right")
    lines = []
    for op, label, shape, batch, t_s, t_p, r_s, r_p, bound, frac in rows:
        cells = (op, label, shape, str(batch), f"{t_s:.3f}", f"{t_p:.3f}", f"{t_s / t_p:.2f}", r_s, r_p, bound,
                 f"{100 * frac:.0f}%")
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console = Console(width=200)
    console.print(table)
    if rows:
        ratios = [r[4] / r[5] for r in rows]
        console.print(f"geomean strict/prod over {len(rows)} cases: "
                      f"{math.exp(statistics.mean(math.log(x) for x in ratios)):.3f}")
    if missing:
        console.print("no strict CUDA implementation yet: " + ", ".join(missing))
    if args.markdown:
        print(f"\n{title}\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
