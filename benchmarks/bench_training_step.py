"""A LoRA training step on one GPU: strict (the Triton family) against production, side by side.

    $ python benchmarks/bench_training_step.py [--layers 60] [--repeat 3] [--batches 1,2] \
          [--lora-mode merged|unfused-fp32] [--configs production,strict,strict+graph,strict+ledger+graph]
    shape  batch  ckpt  config      forward ms  step ms  ratio vs production  peak GiB

One random full-width Qwen-Image transformer (``random_model.build``: ``--layers`` blocks of
d = 3072, bf16 weights on the device) carries a rank-``--rank`` LoRA on the attention and MLP
projections (``attach_lora`` with Flow-GRPO's targets: α = r, ``lora_B`` ~ N(0, 0.01²) so its
gradients are not trivially zero, base weights frozen, the factors FP32 as ``recompute --grad``
trains them). ``--lora-mode``: ``merged`` (the default: W' = W + s·B·A by ``lora_merge``, then
the base GEMM on the FP32 W' — under strict the IEEE FP32 GEMM) or ``unfused-fp32`` (W stays
bf16 and the adapter branch runs beside it with FP32 factors: production as a peft-wrapped
transformer runs it, Flow-GRPO's configuration; strict by the block GEMMs' ``lora=``). A row whose
mode the family refuses says so (``refused``). A training step
is what a Flow-GRPO trainer does per denoising step and micro-batch: the transformer forward with
autograd recording (batch 2 = the CFG-batched cond + uncond rows, prompts of 128 and 77 valid
tokens of 128 slots), a scalar loss ⟨v, g⟩ with a fixed random g [B, N, 64] FP32, and its backward
into the LoRA factors. ``ckpt``: with gradient checkpointing (each block re-run in the backward).
``strict`` runs ``Runtime(mode="strict")`` (the strict CUDA forward and backward), ``production``
``Runtime(mode="auto")`` (torch's cuBLAS / SDPA kernels and autograd); ``+ledger`` adds the
canonical gradient reduction (``MODES``); ``+graph`` replays either's
step from CUDA graphs (``GraphedTraining``: captured after an untimed eager step, its forward
column left empty, as graphs serve only autograd steps; its peak GiB counts the tensors live in a
replay, not the pool's blocks the capture freed and the replay rewrites; each shape's graphs are
dropped before the next). Configurations are
interleaved across repeats after one untimed round; the median is reported, and the forward
alone (no autograd) beside it. The ratio is the step time against the first configuration's
(production by default) at the same
shape, batch and checkpointing; a
configuration that runs out of GPU memory says so in its row.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drifttool.errors import UnsupportedConfigError  # noqa: E402
from drifttool.model.graphs_train import GraphedTraining  # noqa: E402
from drifttool.model.lora import (LORA_TARGET_MODULES, AdapterConfig, attach_lora,  # noqa: E402
                                  lora_parameters)
from drifttool.runtime import Runtime  # noqa: E402
from drifttool.training.ledger import GradLedger  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_gpu_forward import SHAPES, timed  # noqa: E402
from random_model import build  # noqa: E402

MODES = {"production": "auto", "strict": "strict", "production+graph": "auto", "strict+graph": "strict",
         "strict+ledger": "strict", "strict+ledger+graph": "strict"}
"""Configurations: the mode each runs; ``+graph``: the step's forward and backward replayed from
CUDA graphs (``drifttool.model.graphs_train.GraphedTraining``), timed as a training step only;
``+ledger``: the LoRA gradients by the canonical reduction (``training.ledger.GradLedger``, what
``recompute --grad`` runs in strict mode), its ``finish_step`` inside the step's time."""
LORA_MODES = ("merged", "unfused-fp32")
"""``--lora-mode`` choices: the adapter modes with FP32 factors that both families are measured in."""


def inputs(batch: int, grid: tuple[int, int], device: str):
    """Packed latents [B, N, 64] bf16, prompt embeddings [B, 128, 3584] bf16, their mask (None at
    batch 1), timesteps [B], the loss weights g [B, N, 64] FP32 and the runtime scope."""
    g = torch.Generator().manual_seed(batch)
    n = grid[0] * grid[1]
    x = torch.randn(batch, n, 64, generator=g).bfloat16().to(device)
    txt = torch.randn(batch, 128, 3584, generator=g).bfloat16().to(device)
    lens = [128, 77][:batch]
    mask = None if batch == 1 else (torch.arange(128)[None, :] < torch.tensor(lens)[:, None]).to(device)
    tau = torch.full((batch,), 0.75).to(device)
    weights = torch.randn(batch, n, 64, generator=g).to(device)
    scope = dict(phase="train", step=0, sigma=0.75, branch=("cond", "uncond")[:batch] if batch > 1 else "cond",
                 samples=[0] * batch, txt_lens=lens, img_grid=grid)
    return x, txt, mask, tau, weights, scope


def step(model, config: str, batch_inputs, grid, *, grad: bool, fwd=None) -> None:
    """One forward (``grad``: with autograd, the loss and its backward) under ``config``'s mode,
    through ``fwd`` (the transformer's ``GraphedTraining``) or ``model`` itself."""
    x, txt, mask, tau, weights, scope = batch_inputs
    ledger = GradLedger(model) if grad and "+ledger" in config else None
    rt = Runtime(mode=MODES[config], grad_ledger=ledger)
    with rt.scope(**scope), torch.set_grad_enabled(grad):
        v = (fwd or model)(x, txt, mask, tau, grid, rt)
        if grad:
            (v.float() * weights).sum().backward()
    if ledger is not None:
        ledger.finish_step(0)  # the atoms reduced, the factors' .grad set
        ledger.close()
    if grad:
        for p in lora_parameters(model).values():
            p.grad = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--shapes", default="1024x1024", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--checkpointing", default="off,on", help="off, on or both (off,on)")
    ap.add_argument("--configs", default="production,strict",
                    help=f"comma-separated, of {', '.join(MODES)}; the first is the ratio's base")
    ap.add_argument("--lora-mode", default="merged", choices=LORA_MODES,
                    help="merged (lora_merge, then the base GEMM on W') or unfused-fp32 (W bf16, the FP32 "
                         "adapter branch beside it: a peft-wrapped transformer, Flow-GRPO's configuration)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_training_step.py: no CUDA device here; the training step is timed on a GPU (nothing run)")
        return
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        sys.exit(f"unknown shapes {bad}: choose from {', '.join(SHAPES)}")
    configs = [c for c in args.configs.split(",") if c]
    if not configs or any(c not in MODES for c in configs):
        sys.exit(f"unknown configs in {args.configs!r}: choose from {', '.join(MODES)}")
    batches = [int(b) for b in args.batches.split(",")]
    ckpts = [c == "on" for c in args.checkpointing.split(",")]
    _, model = build(args.layers, "cuda")
    cfg = AdapterConfig(r=args.rank, lora_alpha=float(args.rank), target_modules=tuple(sorted(LORA_TARGET_MODULES)))
    attach_lora(model, cfg, init_b_std=0.01, mode=args.lora_mode)
    graphed = {c: GraphedTraining(model) for c in configs if c.endswith("+graph")}
    rows = []
    for shape in shapes:
        grid = SHAPES[shape]
        for batch in batches:
            bi = inputs(batch, grid, "cuda")
            for ckpt in ckpts:
                model.gradient_checkpointing = ckpt
                times: dict[tuple[str, bool], list[float]] = {}
                peaks: dict[str, float] = {}
                failed: dict[tuple[str, bool], str] = {}  # out of memory, or the family refuses the mode
                for r in range(args.repeat + 1):
                    for config in configs:
                        fwd = graphed.get(config)
                        for grad in (False, True) if fwd is None else (True,):
                            if (config, grad) in failed:
                                continue
                            torch.cuda.reset_peak_memory_stats()
                            try:
                                if not r and fwd is not None:  # eager warm-up, then the capture
                                    step(model, config, bi, grid, grad=grad, fwd=fwd)
                                t = timed(lambda: step(model, config, bi, grid, grad=grad, fwd=fwd))
                            except torch.cuda.OutOfMemoryError:
                                failed[(config, grad)] = "out of memory"
                                torch.cuda.empty_cache()
                                continue
                            except UnsupportedConfigError as e:
                                failed[(config, grad)] = "refused"
                                print(f"{config} refuses LoRA mode {args.lora_mode}: {e}", flush=True)
                                continue
                            if grad:
                                peaks[config] = torch.cuda.max_memory_allocated() / 2**30
                            if r:
                                times.setdefault((config, grad), []).append(t)
                for fast in graphed.values():  # this signature's graphs and pools go
                    fast.reset()
                torch.cuda.empty_cache()
                med = {k: statistics.median(v) for k, v in times.items() if k not in failed}
                base = med.get((configs[0], True))
                for config in configs:
                    fwd, st = med.get((config, False)), med.get((config, True))
                    why = failed.get((config, True)) or failed.get((config, False)) or (
                        "–" if config in graphed and st is not None else "out of memory")
                    rows.append((shape, batch, "on" if ckpt else "off", config, fwd, st,
                                 None if st is None or base is None else st / base, peaks.get(config), why))
                    print(*rows[-1][:-1], *([why] if st is None else []), flush=True)  # as measured (a long run may be cut short)
    table = Table(title=f"LoRA training step ({args.lora_mode}), {args.layers} blocks, rank {args.rank}, median of "
                        f"{args.repeat} ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
                        f"{datetime.date.today()})")
    for col in ("shape", "batch", "ckpt", "config", "forward ms", "step ms", "ratio vs production",
                "peak GiB"):
        table.add_column(col, justify="right" if col not in ("shape", "config") else "left")
    for shape, batch, ckpt, config, fwd, st, ratio, peak, why in rows:
        def cell(v, fmt: str) -> str:
            return why if v is None else format(v, fmt)

        table.add_row(shape, str(batch), ckpt, config, cell(fwd and fwd * 1e3, ",.1f"),
                      cell(st and st * 1e3, ",.1f"), cell(ratio, ".2f"), cell(peak, ".1f"))
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
