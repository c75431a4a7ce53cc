"""Peer probes: the probe matrix run against the real production peer, diffusers'
``QwenImageTransformer2DModel``.

    >>> tr = load_peer(None, device="cpu")                 # the tiny fixture's transformer
    >>> m = run_peer_matrix(peer_catalog(), "runs/peer", transformer=tr)
    >>> [(r.name, r.verdict, r.status) for r in m.results][:2]
    [('repeat', 'identical', 'PASS'), ('batch_order_reversed', 'identical', 'PASS')]

Each probe is a baseline rollout and a one-factor variant rollout of the same logical inputs,
whose velocities come from the diffusers transformer through the capture adapter
(``drifttool.adapters.diffusers_qwenimage.instrument``: every named operator of each forward is
recorded, L2 by default on the tiny model, L1 for a checkpoint). A rollout of ``PEER_STEPS`` (2)
steps runs one batched-CFG forward per step ([cond; uncond] rows), so every probe covers two
timesteps and both CFG branches; the sampler is drifttool's ``production`` family (mode
``auto``), the same in both runs. The pair is diffed with ``drifttool.diff.diff_runs``: a drifting
probe names its first drifting operator, block, stream and (at L2) rows; an invariant one must
be IDENTICAL with every record of both runs compared (no record left unmatched).

Baseline (``peer_baseline()``): prompts right-padded to 128 text slots with a key mask (diffusers
0.42.1 masks padded keys: ``[txt_mask, ones(img)]``), torch's default SDPA kernel, ``no_grad``
(as ``QwenImagePipeline.__call__``), an fp32 timestep tensor holding bf16 values (timestep policy
``pipeline_bf16``), zeros in the padded prompt rows, samples [0, 1].

The factors (one per probe; the study on an H200 found the CUDA verdicts):

=====================  =============================================  =========  ==============
probe                  change                                         CUDA       CPU
=====================  =============================================  =========  ==============
repeat                 the baseline again                             identical  identical
batch_order_reversed   samples [1, 0]                                 identical  identical
grad_enabled           forward under ``torch.enable_grad()``          identical  identical
timestep_bf16          bf16 timestep tensor, same bf16 values         identical  identical
pad_garbage            N(0, 100²) garbage in the masked prompt rows   identical  identical
pad_100 / pad_160      100 / 160 text slots instead of 128            drift      observed
sdpa_math              ``sdpa_kernel([MATH])``                        drift (1)  observed
sdpa_efficient         ``sdpa_kernel([EFFICIENT_ATTENTION])``         drift (1)  pending (2)
ulp_norm_q_gain        ``blocks.0.attn.norm_q`` gain[0] + 1 bf16 ULP  drift (3)  drift (3)
=====================  =============================================  =========  ==============

(1) first at ``joint_attention_fused``, block 0, step 0: nothing before the first attention calls
SDPA. (2) torch has no EFFICIENT_ATTENTION kernel on the CPU. (3) first at ``qk_rmsnorm``, img,
block 0, step 0 (``PLANT``).

CPU expectations that production arithmetic makes machine-dependent (the reduction order of
torch's CPU SDPA kernels and GEMMs follows the SIMD width ATen dispatches to, and the blocking
follows the sequence length) are declared ``observed``: run and reported, never judged. The
identical ones on the CPU are declared because nothing in them changes the arithmetic's shapes.
A device without a declaration for a probe gets ``PENDING`` (listed, never run).

The SDPA kernel torch picks is read back per attention call into the trace (the adapter's
``attention_kernel``); the matrix's settings list each probe's kernels (``attention_kernels``).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage
from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import DiffReport, Verdict
from drifttool.probes.peer_catalog import (KINDS, PAD_VARIANTS, PEER_SLOTS, PLANT, VERDICTS, PeerCall, PeerExpect,
                                           PeerProbe, describe, peer_catalog, select)
from drifttool.probes.peer_model import (GARBAGE_SEED, PeerModel, check_device, grid_fixture, load_peer, pixel_grid,
                                         planted_ulp)
from drifttool.probes.runner import ERROR, OBSERVED, PENDING, Matrix, ProbeResult, _from_report, judge
from drifttool.probes.spec import Expectation
from drifttool.runner import execute
from drifttool.settings import RunSpec

__all__ = [  # the declarations (peer_catalog) and the peer (peer_model) are used through this module
    "GARBAGE_SEED", "KINDS", "PAD_VARIANTS", "PEERS", "PEER_SLOTS", "PEER_STEPS", "PLANT", "VERDICTS",
    "PeerCall", "PeerExpect", "PeerModel", "PeerProbe", "all_compared", "attention_kernels", "check_device",
    "describe", "grid_fixture", "judge_peer", "load_peer", "peer_baseline", "peer_catalog", "pixel_grid",
    "planted_ulp", "run_peer", "run_peer_matrix", "run_peer_probe", "select"]

PEER_STEPS = 2


# -- running and judging ------------------------------------------------------------------------
def peer_baseline(*, checkpoint: str | Path | None = None, capture: str | None = None,
                  fixture: str | Path | None = None, slots: int = PEER_SLOTS,
                  steps: int = PEER_STEPS) -> RunSpec:
    """The peer baseline ``RunSpec``: mode ``auto`` (production sampler, traced), ``steps``
    steps, prompts padded to ``slots``, timestep policy ``pipeline_bf16``, batched CFG; capture
    L2 on the tiny fixture's model, L1 with a checkpoint (unless ``capture`` says)."""
    return RunSpec(fixture=fixture, checkpoint=checkpoint, mode="auto", steps=steps,
                   capture=capture or ("L1" if checkpoint else "L2"), pad_prompts_to=slots,
                   timestep_policy="pipeline_bf16", cfg_layout="batched")


def attention_kernels(run_dir: str | Path) -> list[str]:
    """The distinct attention kernels read back into a run's trace (one per SDPA selection)."""
    return sorted({r["kernel"] for r in open_run(run_dir).trace_rows()
                   if r["op"] == "joint_attention_fused"})


def all_compared(report: DiffReport) -> list[str]:
    """Why not every record of both runs was compared (empty: every record was matched)."""
    out = []
    for kind, c in report.counts.items():
        if c.only_a or c.only_b or c.matched != c.a or c.matched != c.b:
            out.append(f"{kind}: {c.matched} matched of {c.a} (A) and {c.b} (B); "
                       f"{c.only_a} only in A, {c.only_b} only in B")
    if "ops" not in report.counts:
        out.append("no op records compared (capture level L0)")
    return out


def judge_peer(e: PeerExpect, report: DiffReport) -> list[str]:
    """Why ``report`` does not meet ``e`` (empty: it does; ``observed`` always does)."""
    if e.verdict == "observed":
        return []
    if e.verdict == "identical":
        if report.verdict is not Verdict.IDENTICAL:
            return [f"expected identical, got {report.verdict.value}: {report.reason}"]
        return all_compared(report)
    if e.op is not None:
        return judge(_AsProbe(e.as_expectation()), report)
    if report.verdict is not Verdict.DRIFT:
        return [f"expected drift, got {report.verdict.value}: {report.reason}"]
    return []


@dataclass(frozen=True)
class _AsProbe:
    """The one attribute ``runner.judge`` reads of a probe."""

    expect: Expectation


def _result(p: PeerProbe, e: PeerExpect | None, status: str, **kw: Any) -> ProbeResult:
    return ProbeResult(name=p.name, factor=p.factor, kind=p.kind, change=p.change,
                       expected=e.describe() if e else "-", expected_op=e.op if e else None,
                       status=status, **kw)


def run_peer(p: PeerProbe | None, base: RunSpec, transformer: torch.nn.Module,
             device: torch.device, run_dir: Path) -> dict[str, Any]:
    """One rollout of the peer (the baseline when ``p`` is None) written to ``run_dir``."""
    spec = base if p is None else dataclasses.replace(base, **dict(p.spec))
    # the run's device is the transformer's: the runner refuses a model on another device
    spec = dataclasses.replace(spec, device=str(device))
    model = PeerModel(transformer, PeerCall() if p is None else p.call, device)
    with planted_ulp(transformer, None if p is None else p.plant):
        return execute(spec, run_dir, overwrite=True, model=model)


def run_peer_probe(p: PeerProbe, base: RunSpec, transformer: torch.nn.Module,
                   device: torch.device, baseline: Path, out: Path) -> ProbeResult:
    """Run ``p`` under ``out/runs/<name>``, diff it against ``baseline``, judge it."""
    e = p.expectation(device.type)
    if e is None:
        why = p.pending.get(device.type, f"no expectation declared for {device.type}")
        return _result(p, e, PENDING, reasons=[why])
    t0 = time.perf_counter()
    run_dir = out / "runs" / p.name
    try:
        run_peer(p, base, transformer, device, run_dir)
        report = diff_runs(open_run(baseline), open_run(run_dir))
    except Exception as ex:  # noqa: BLE001 - a probe that cannot run is itself a finding
        return _result(p, e, ERROR, seconds=time.perf_counter() - t0,
                       reasons=[f"{type(ex).__name__}: {ex}",
                                traceback.format_exc(limit=3).strip().splitlines()[-1]])
    (out / "diffs").mkdir(parents=True, exist_ok=True)
    (out / "diffs" / f"{p.name}.json").write_text(report.to_json())
    reasons = judge_peer(e, report)
    r = _from_report(_ProbeLike(p, e), report, reasons, time.perf_counter() - t0, run_dir)
    if e.verdict == "observed":
        r.status = OBSERVED
    return r


class _ProbeLike:
    """What ``runner._from_report`` reads of a probe."""

    def __init__(self, p: PeerProbe, e: PeerExpect) -> None:
        self.name, self.factor, self.kind, self.change = p.name, p.factor, p.kind, p.change
        self.expect = e
        self.compare = "all"


def run_peer_matrix(
    probes: list[PeerProbe],
    out: str | Path,
    *,
    transformer: torch.nn.Module,
    base: RunSpec | None = None,
    device: str | torch.device = "cpu",
    on_result: Callable[[ProbeResult], Any] | None = None,
) -> Matrix:
    """Run the peer baseline, then every probe against it (module docstring).

    Args:
        probes: ``peer_catalog()`` or a selection.
        out: output directory: ``runs/<probe>`` (artifacts), ``diffs/<probe>.json``.
        transformer: the diffusers ``QwenImageTransformer2DModel`` (on ``device``, model dtype).
        base: the baseline spec (default ``peer_baseline()``).
        device: where the forwards run (``cpu`` or ``cuda``); picks the declared expectations.
        on_result: called with each ``ProbeResult`` as it is judged.

    Returns:
        ``Matrix`` (``drifttool.probes.matrix`` renders and writes it); its ``settings`` hold the
        baseline's settings plus ``peer`` (implementation, device, torch, diffusers) and
        ``attention_kernels`` (``{run: [kernels]}``).

    Raises:
        DriftToolError: the baseline cannot run (bad settings, checkpoint, device).
    """
    base = base or peer_baseline()
    device = torch.device(device)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    baseline = out / "runs" / "baseline"
    run_peer(None, base, transformer, device, baseline)
    t_base = time.perf_counter() - t0
    results, kernels = [], {"baseline": attention_kernels(baseline)}
    for p in probes:
        r = run_peer_probe(p, base, transformer, device, baseline, out)
        if r.run_dir is not None:
            kernels[p.name] = attention_kernels(r.run_dir)
        results.append(r)
        if on_result is not None:
            on_result(r)
    settings = dict(open_run(baseline).manifest["settings"])
    settings["peer"] = {"implementation": "diffusers.QwenImageTransformer2DModel",
                        "device": str(device), "torch": torch.__version__,
                        **DiffusersQwenImage(transformer).source}
    settings["attention_kernels"] = kernels
    return Matrix(out=str(out), baseline=str(baseline), settings=settings, results=results,
                  seconds=time.perf_counter() - t0, baseline_seconds=t_base)


# -- command-line helpers -----------------------------------------------------------------------
PEERS = ("diffusers",)
"""Implementations ``drifttool probe --peer`` runs against."""

