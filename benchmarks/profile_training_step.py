"""Where a LoRA training step spends its GPU time: strict against production, per kernel.

    $ python benchmarks/profile_training_step.py [--layers 60] [--shape 1024x1024] [--batch 1] \
          [--lora-mode unfused-fp32] [--checkpointing on] [--top 30] [--by-role] [--host]

The step of ``bench_training_step.py`` (one random full-width transformer with a rank-``--rank``
LoRA on Flow-GRPO's targets, the forward with autograd, the loss ⟨v, g⟩ and its backward into the
factors), after one untimed step, under ``torch.profiler`` for each family (production: mode
``auto``; strict: the Triton family): the step's wall time, the sum of its GPU kernel times (the
rest is the GPU waiting for the host) and the kernels grouped by name (count, total ms, share of
the family's kernel time), so the backward's costly kernels show against production's. Then, for
the strict family: ``--by-role`` one more step under the profiler, each strict GEMM kernel
paired with the ``kernels.gemm.linear`` call that launched it and its GPU time summed by the
call's role — operand dtypes, rows M, K, N, a merged epilogue, the activation; ``--host`` one step under
cProfile (own time: Triton's launch, the dispatch, autograd). Without CUDA it prints why and
exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import collections  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402

from bench_training_step import LORA_MODES, MODES, inputs, step  # noqa: E402
from profile_strict_forward import SHAPES, profile_gpu  # noqa: E402

from drifttool.model.lora import LORA_TARGET_MODULES, AdapterConfig, attach_lora  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--shape", default="1024x1024", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-mode", default="unfused-fp32", choices=LORA_MODES)
    ap.add_argument("--checkpointing", default="on", choices=("on", "off"))
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--by-role", action="store_true", help="the strict GEMMs' GPU time by role")
    ap.add_argument("--host", action="store_true", help="one strict step's host time under cProfile")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return 0
    from random_model import build

    _, model = build(args.layers, "cuda")
    attach_lora(model, AdapterConfig(r=args.rank, lora_alpha=float(args.rank),
                                     target_modules=tuple(sorted(LORA_TARGET_MODULES))),
                init_b_std=0.01, mode=args.lora_mode)
    model.gradient_checkpointing = args.checkpointing == "on"
    grid = SHAPES[args.shape]
    batch_inputs = inputs(args.batch, grid, "cuda")
    for config in MODES:
        profile_gpu(lambda: step(model, config, batch_inputs, grid, grad=True),
                    f"{config}: training step, {args.layers} blocks, {args.shape}, batch {args.batch}, "
                    f"{args.lora_mode}, checkpointing {args.checkpointing}", args.top)
    strict_step = lambda: step(model, "strict", batch_inputs, grid, grad=True)  # noqa: E731
    if args.by_role:
        by_role(strict_step, args.top)
    if args.host:
        pr = cProfile.Profile()
        pr.enable()
        strict_step()
        torch.cuda.synchronize()
        pr.disable()
        print("--- host, strict training step (cProfile, own time)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)
        print("--- host, strict training step (cProfile, with callees: drifttool's and Triton's)")
        pstats.Stats(pr).sort_stats("cumulative").print_stats("drifttool|triton", args.top)
    return 0


def _role(x: torch.Tensor, w: torch.Tensor, kw: dict) -> str:
    """A strict GEMM call's role: operand dtypes, rows, K, N, merged epilogue, activation."""
    dt = {torch.bfloat16: "bf16", torch.float32: "fp32"}
    m, k, n = x.numel() // x.shape[-1], x.shape[-1], w.shape[0]
    extra = (" +merge" if kw.get("merge_into") is not None else "") + (f" {kw['act']}" if kw.get("act") else "")
    return f"gemm {dt.get(x.dtype, x.dtype)}x{dt.get(w.dtype, w.dtype)} M{m} K{k} N{n}{extra}"


@contextlib.contextmanager
def _logged_gemms(roles: list[str]):
    """Every ``kernels.gemm.linear`` call inside that launches a kernel (M, N > 0) appends its role
    (``_role``) to ``roles``, in the host's order: the order its one kernel runs in on the stream."""
    from drifttool.ops.strict_cuda.kernels import gemm

    plain = gemm.linear

    def linear(x, w, b=None, **kw):
        if x.numel() and w.shape[0]:
            roles.append(_role(x, w, kw))
        return plain(x, w, b, **kw)

    gemm.linear = linear
    try:
        yield
    finally:
        gemm.linear = plain


def by_role(fn, top: int) -> None:
    """One ``fn`` under ``torch.profiler`` with the strict GEMM calls' roles logged in call order
    (``_logged_gemms``): the step's GEMM kernels (``_linear*``), in the order they ran, paired
    with the calls one to one (one stream, one kernel per call), their GPU time summed by role,
    largest first. The step runs as it does unprofiled: no call waits for another."""
    fn()
    torch.cuda.synchronize()
    roles: list[str] = []
    with _logged_gemms(roles), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.name.startswith("_linear")), key=lambda e: e.time_range.start)
    if len(kernels) != len(roles):
        print(f"\n=== strict GEMMs by role: {len(roles)} calls but {len(kernels)} GEMM kernels; not paired")
        return
    calls: dict[str, int] = collections.Counter()
    gpu_ms: dict[str, float] = collections.Counter()
    for role, k in zip(roles, kernels):
        calls[role] += 1
        gpu_ms[role] += k.device_time_total / 1e3
    total = sum(gpu_ms.values())
    print(f"\n=== strict GEMMs by role: {sum(calls.values())} calls, {total:.1f} ms of GPU time")
    for key, ms in sorted(gpu_ms.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{ms:9.2f} ms {calls[key]:6d}× {ms / calls[key] * 1e3:8.1f} µs/call  {key}")


if __name__ == "__main__":
    sys.exit(main())
