"""Host synchronisations per denoising step of a CUDA run, and in a strict training step's
backward, counted and bounded.

torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) warns at every operation
that makes the host wait for the GPU (``.item()``, ``.cpu()``, a copy to pageable memory,
``nonzero``, …). The count between two steps' callbacks is one step's: its model calls, the SDE
step and the capture flush to the artifact. Each is a stall in the host's queue of launches, so
the bound is part of the speed contract (``docs/benchmarks.md``). Skipped without CUDA.

    $ python -m tests.gpu.test_host_syncs_cuda      # prints the counts per mode and level
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from drifttool.runner import execute
from drifttool.settings import RunSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MOST_PER_STEP = 3
"""The bound, as measured on an H200 (2026-12-03, batch 2, CFG, 6 steps, ``python -m
tests.gpu.test_host_syncs_cuda``): strict 2 per step at L0 and 3 at L1/L2 (the step's one
read-back of the digests); production (``auto``) 2 at L0 and 3 at L1 (1 and 2 at its last step).
Before the step's sigmas, SDE schedule and prompt rows were read on the host and the strict step's
constants went over in one non-blocking copy, the counts were 27–28 (strict) and 21–22
(production). The forward itself adds none (its CUDA graph replays without the host). A change
that adds one fails here."""


def syncs_per_step(mode: str, level: str, out: Path, steps: int = 6) -> list[int]:
    """Host synchronisations torch counted between consecutive steps of a ``steps``-step CFG run
    (batch 2, the embedded default on ``cuda``): one number per step after the first."""
    marks: list[int] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            execute(RunSpec(device="cuda", mode=mode, capture=level, steps=steps, batch=2), out,
                    on_step=lambda _: marks.append(len(seen)))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [i for i, w in enumerate(seen) if "synchroniz" in str(w.message)]
    return [sum(a <= i < b for i in syncs) for a, b in zip(marks, marks[1:])]


@pytest.mark.parametrize("mode,level", [("strict", "L0"), ("strict", "L1"), ("auto", "L1")])
def test_host_synchronisations_per_step_are_bounded(tmp_path, mode, level):
    counts = syncs_per_step(mode, level, tmp_path / "run")
    print(f"\nhost synchronisations per step, {mode} {level}: {counts}")
    assert len(counts) == 5 and max(counts) <= MOST_PER_STEP, (mode, level, counts)


def sync_sites(mode: str, level: str, out: Path, steps: int = 4, top: int = 12) -> list[tuple[int, str]]:
    """Where a run's host synchronisations come from: (count, innermost drifttool frames) for the
    ``top`` most frequent call sites of a ``steps``-step CFG run (batch 2) on ``cuda``."""
    import collections
    import traceback

    sites: collections.Counter[str] = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "drifttool" in f.filename]
            sites[" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            execute(RunSpec(device="cuda", mode=mode, capture=level, steps=steps, batch=2), out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites.most_common(top)


MOST_PER_BACKWARD = 0
"""Host synchronisations in the strict backward of a LoRA training step (every block's GEMMs,
attention and rows, the adapters' gradients). Each one stalls the host's queue of launches for
the whole GPU backlog; the adapters' gradients once made one per adapted module (a host scalar
copied to the device), 237 in a 20-block step."""


def backward_syncs(lora_mode: str, batch: int = 3) -> tuple[int, int]:
    """(forward, backward) host synchronisations of one strict training step with autograd on a
    tiny bf16 model with a rank-4 adapter in ``lora_mode`` on Flow-GRPO's targets (batch 3,
    prompts of three lengths)."""
    from drifttool.model.config import tiny
    from drifttool.model.lora import LORA_TARGET_MODULES, AdapterConfig, attach_lora
    from drifttool.model.mmdit import MMDiT, random_init_
    from drifttool.runtime import Runtime

    model = random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=2).cuda()
    attach_lora(model, AdapterConfig(r=4, lora_alpha=8.0, target_modules=tuple(sorted(LORA_TARGET_MODULES))),
                init_b_std=0.05, mode=lora_mode)
    g = torch.Generator().manual_seed(0)
    grid, slots, lens = (5, 7), 11, [11, 6, 9][:batch]
    x = torch.randn(batch, 35, 64, generator=g).bfloat16().cuda()
    txt = torch.randn(batch, slots, tiny().joint_attention_dim, generator=g).bfloat16().cuda()
    mask = (torch.arange(slots)[None, :] < torch.tensor(lens)[:, None]).cuda()
    tau, w = torch.rand(batch, generator=g).cuda(), torch.randn(batch, 35, 64, generator=g).cuda()
    counts = []
    for _ in range(2):  # the first step compiles the kernels and fills the caches
        rt = Runtime(mode="strict")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with rt.scope(phase="train", step=0, samples=list(range(batch)), txt_lens=lens, img_grid=grid):
                    loss = (model(x, txt, mask, tau, grid, rt).float() * w).sum()
                    mark = len(seen)
                    loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [i for i, m in enumerate(seen) if "synchroniz" in str(m.message)]
        counts = [sum(i < mark for i in syncs), sum(i >= mark for i in syncs)]
        model.zero_grad(set_to_none=True)
    return counts[0], counts[1]


@pytest.mark.parametrize("lora_mode", ["merged", "unfused-fp32"])
def test_the_strict_backward_makes_no_host_synchronisation(lora_mode):
    forward, backward = backward_syncs(lora_mode)
    print(f"\nhost synchronisations of a strict LoRA step ({lora_mode}): forward {forward}, backward {backward}")
    assert backward <= MOST_PER_BACKWARD, (lora_mode, forward, backward)


if __name__ == "__main__":
    import sys

    if "--where" in sys.argv:
        for mode, level in (("strict", "L1"), ("auto", "L1")):
            with tempfile.TemporaryDirectory() as d:
                print(f"{mode} {level}: host synchronisations by call site (4 steps)")
                for n, site in sync_sites(mode, level, Path(d) / "run"):
                    print(f"  {n:5d}  {site}")
        sys.exit(0)
    for lora_mode in ("merged", "unfused-fp32"):
        print(f"strict LoRA step ({lora_mode}): host syncs (forward, backward):", backward_syncs(lora_mode))
    for mode, level in (("strict", "L0"), ("strict", "L1"), ("strict", "L2"), ("auto", "L0"), ("auto", "L1")):
        with tempfile.TemporaryDirectory() as d:
            print(mode, level, "host syncs per step:", syncs_per_step(mode, level, Path(d) / "run"))
