"""Per-operator timings: strict vs production vs the FP64 reference, forward and forward+backward,
side by side in one run (ratios against production measured in the same process).

    $ python benchmarks/bench_ops.py [--tokens 4096] [--hidden 3072] [--repeat 1] [--ops a,b]
    operator  shape  strict fwd  prod fwd  ref fwd  strict/prod  strict f+b  prod f+b  ref f+b  strict/prod f+b

Shapes are the reference geometry scaled to what a 2-core CPU holds: ``--tokens`` image tokens
(4096 = 1024²) at hidden ``--hidden`` (3072) for the row-wise and GEMM operators, MLP 4×hidden,
text 512 slots of 3584 for ``txt_in``, and joint attention with one head of 128 over
512 text slots (200 valid) + ``--tokens`` image tokens. Inputs are FP32. "f+b" is one forward
with autograd recording plus the backward of a random output gradient for every differentiable
input (the reference's is ``references.ops.vjp`` in FP64). Each cell is the best of ``--repeat``
runs. Timings are wall-clock on whatever else the machine is running; the table header names
the machine, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import platform
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import drifttool.ops  # noqa: E402,F401
import drifttool.ops.production  # noqa: E402,F401
from drifttool.environment import environment  # noqa: E402
from drifttool.ops.registry import implementation, specs  # noqa: E402
from drifttool.references import ops as ref  # noqa: E402
from drifttool.references import sampler as ref_sampler  # noqa: E402


def _rn(g, *shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, generator=g) * scale + shift


def _lin(g, n, k):
    return _rn(g, n, k, scale=1 / math.sqrt(k)), _rn(g, n, scale=0.1)


def cases(tokens: int, d: int) -> dict:
    """{op: (shape label, make(g) → (args, kwargs), differentiable arg indices, outputs with a
    gradient (None = all))}."""
    side = int(round(math.sqrt(tokens)))
    h, w = side, tokens // side
    n = h * w
    txt, dj, heads_dim = 512, 3584, 128

    def sig():
        from drifttool.ops.scheduler import flow_sigma_table

        return flow_sigma_table(50, n)

    def attn(g):
        s = txt + n
        q, k, v = (_rn(g, 1, s, 1, heads_dim, scale=1.5) for _ in range(3))
        mask = torch.ones(1, s, dtype=torch.bool)
        mask[0, 200:txt] = False
        return q, k, v, mask

    def scores(g):
        q, k, _, m = attn(g)
        return ref.joint_attn_qk_gemm(q, k).float(), m

    c = {
        "latent_pack_unpack": (f"[1,16,{2*h},{2*w}]", lambda g: ((_rn(g, 1, 16, 2 * h, 2 * w),), {}), (0,), None),
        "latent_normalize": (f"[1,16,1,{2*h},{2*w}]", lambda g: (
            (_rn(g, 1, 16, 1, 2 * h, 2 * w), _rn(g, 16), _rn(g, 16).abs() + 1), {}), (0,), None),
        "latent_proj_gemm": (f"[1,{n},64]→{d}", lambda g: ((_rn(g, 1, n, 64), *_lin(g, d, 64)), {}), (0, 1, 2), None),
        "txt_in_rmsnorm_linear": (f"[1,{txt},{dj}]→{d}", lambda g: (
            (_rn(g, 1, txt, dj, scale=3), _rn(g, dj, scale=0.3, shift=1), *_lin(g, d, dj)), {}), (0, 1, 2, 3), None),
        "timestep_embed_mlp": (f"[2]→{d}", lambda g: (
            (torch.tensor([1.0, 0.3]), *_lin(g, d, 256), *_lin(g, d, d)), {}), (1, 2, 3, 4), None),
        "adaln_mod_projection": (f"[2,{d}]→{6*d}", lambda g: ((_rn(g, 2, d), *_lin(g, 6 * d, d)), {}), (0, 1, 2), None),
        "adaln_modulation": (f"[1,{n},{d}]", lambda g: (
            (_rn(g, 1, n, d, scale=2), _rn(g, 1, d), _rn(g, 1, d)), {}), (0, 1, 2), None),
        "adaln_gate_residual": (f"[1,{n},{d}]", lambda g: (
            (_rn(g, 1, n, d), _rn(g, 1, d), _rn(g, 1, n, d)), {}), (0, 1, 2), None),
        "qkv_bias_gemm": (f"[1,{n},{d}]→3×{d}", lambda g: (
            (_rn(g, 1, n, d), *_lin(g, d, d), *_lin(g, d, d), *_lin(g, d, d), d // heads_dim), {}),
            (0, 1, 2, 3, 4, 5, 6), None),
        "qk_rmsnorm": (f"[1,{n},{d // heads_dim},{heads_dim}]", lambda g: (
            (_rn(g, 1, n, d // heads_dim, heads_dim, scale=3), _rn(g, heads_dim, shift=1)), {}), (0, 1), None),
        "multi_axis_rope": (f"[1,{txt + n},{d // heads_dim},{heads_dim}]", lambda g: (
            (_rn(g, 1, txt + n, d // heads_dim, heads_dim),
             torch.cat(ref.rope_tables(h, w, txt)[::-1]).to(torch.complex64)), {}), (0,), None),
        "joint_attn_qk_gemm": (f"1 head×128, {txt}+{n} keys", lambda g: (attn(g)[:2], {}), (0, 1), None),
        "joint_attn_softmax": (f"[1,1,{txt + n},{txt + n}]", lambda g: (scores(g), {}), (0,), None),
        "joint_attn_av_gemm": (f"1 head×128, {txt}+{n} keys", lambda g: (
            (ref.joint_attn_softmax(*scores(g)).float(), attn(g)[2], attn(g)[3]), {}), (0, 1), None),
        "joint_attention_fused": (f"1 head×128, {txt}+{n} keys", lambda g: (attn(g), {}), (0, 1, 2), None),
        "attn_out_bias_gemm": (f"[1,{n},{d}]→{d}", lambda g: ((_rn(g, 1, n, d), *_lin(g, d, d)), {}), (0, 1, 2), None),
        "mlp_up_gemm_gelu": (f"[1,{n},{d}]→{4*d}", lambda g: ((_rn(g, 1, n, d, scale=2), *_lin(g, 4 * d, d)), {}),
                             (0, 1, 2), None),
        "mlp_down_gemm": (f"[1,{n},{4*d}]→{d}", lambda g: ((_rn(g, 1, n, 4 * d), *_lin(g, d, 4 * d)), {}),
                          (0, 1, 2), None),
        "final_adaln_out": (f"[1,{n},{d}]", lambda g: (
            (_rn(g, 1, n, d, scale=2), _rn(g, 1, d, scale=2), *_lin(g, 2 * d, d)), {}), (0, 1, 2, 3), None),
        "cfg_combine_renorm": (f"[1,{n},64]", lambda g: ((_rn(g, 1, n, 64), _rn(g, 1, n, 64), 4.0), {}), (0, 1), None),
        "flow_sigma_table": (f"50 steps, {n} tokens", lambda g: ((50, n), {}), (), None),
        "flow_sde_step_logp": (f"[1,{n},64]", lambda g: (
            (_rn(g, 1, n, 64), _rn(g, 1, n, 64), sig()[3], sig()[4]),
            {"eta": 1.2, "sigma_max": sig()[1], "prev_sample": _rn(g, 1, n, 64)}), (0, 1), (1, 2)),
    }
    return c


REFS = {**ref.OPS, **ref.SAMPLER_OPS,
        "flow_sigma_table": lambda steps, n: torch.from_numpy(ref_sampler.flow_sigma_table_ref(steps, n))}


def _select(out, sel):
    outs = out if isinstance(out, tuple) else (out,)
    return tuple(outs[i] for i in sel) if sel is not None else outs


def time_forward(fn, args, kwargs) -> float:
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        return time.perf_counter() - t0


def time_fwd_bwd(fn, args, kwargs, diff, sel, g) -> float:
    leaves = [a.detach().clone().requires_grad_(True) if i in diff else a for i, a in enumerate(args)]
    t0 = time.perf_counter()
    outs = _select(fn(*leaves, **kwargs), sel)
    t_fwd = time.perf_counter() - t0
    gos = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]  # not timed
    t0 = time.perf_counter()
    torch.autograd.grad(outs, [leaves[i] for i in diff], gos, allow_unused=True)
    return t_fwd + time.perf_counter() - t0


def time_ref_fwd_bwd(fn, args, kwargs, sel, g) -> float:
    """``references.ops.vjp`` (FP64 forward with autograd + backward); the output gradients
    come from an untimed forward."""
    with torch.no_grad():
        outs = _select(fn(*args, **kwargs), sel)
    gos = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]

    def picked(*a, **k):
        o = _select(fn(*a, **k), sel)
        return o if len(o) > 1 else o[0]

    t0 = time.perf_counter()
    ref.vjp(picked, args, gos if len(gos) > 1 else gos[0], **kwargs)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ops", default="", help="comma-separated operator names (default: all 22)")
    ap.add_argument("--no-reference-backward", action="store_true", help="skip the FP64 vjp column")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # The first torch.autograd.grad with explicit output gradients imports sympy (about 1 s, once
    # per process): pay it outside the timings.
    warm = torch.ones(1, 2, 2, 2, requires_grad=True)
    y = implementation("latent_pack_unpack", "strict")(warm)
    torch.autograd.grad(y, warm, torch.ones_like(y))
    table_cases = cases(args.tokens, args.hidden)
    names = [n for n in specs() if not args.ops or n in args.ops.split(",")]
    rows = []
    for name in names:
        label, make, diff, sel = table_cases[name]
        g = torch.Generator().manual_seed(0)
        a, kw = make(g)
        best: dict[str, float] = {}

        def keep(key, t):
            best[key] = min(best.get(key, math.inf), t)

        for _ in range(args.repeat):
            for be in ("strict", "production"):
                fn = implementation(name, be)
                keep(f"{be} fwd", time_forward(fn, a, kw))
                if diff:
                    keep(f"{be} f+b", time_fwd_bwd(fn, a, kw, diff, sel, g))
                gc.collect()
            keep("ref fwd", time_forward(REFS[name], a, kw))
            if diff and not args.no_reference_backward:
                keep("ref f+b", time_ref_fwd_bwd(REFS[name], a, kw, sel, g))
            gc.collect()
        rows.append((name, label, best))
        print(f"{name:24s} " + "  ".join(f"{k} {v:.3f}s" for k, v in best.items()), file=sys.stderr, flush=True)
        del a, kw
        gc.collect()

    env = environment()
    table = Table(title=f"WS1 operators, FP32 — {datetime.date.today()} — {env['cpu']} ({env['cpu_count']} cores, "
                        f"{args.threads} threads, torch {torch.__version__}, Python {platform.python_version()}, "
                        f"{env['cpu_capability']})")
    cols = ("operator", "shape", "strict fwd s", "prod fwd s", "ref fwd s", "strict/prod fwd", "strict/ref fwd",
            "strict f+b s", "prod f+b s", "ref f+b s", "strict/prod f+b")
    for col in cols:
        table.add_column(col, justify="right" if col not in ("operator", "shape") else "left")

    def f(v):
        return "—" if v is None else f"{v:.3f}"

    def r(a, b):
        return "—" if a is None or b is None or b == 0 else f"{a / b:.1f}×"

    for name, label, b in rows:
        sf, pf, rf = b.get("strict fwd"), b.get("production fwd"), b.get("ref fwd")
        sb, pb, rb = b.get("strict f+b"), b.get("production f+b"), b.get("ref f+b")
        table.add_row(name, label, f(sf), f(pf), f(rf), r(sf, pf), r(sf, rf), f(sb), f(pb), f(rb), r(sb, pb))
    Console(width=240).print(table)


if __name__ == "__main__":
    main()
