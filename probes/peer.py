"""Peer probes: the probe matrix run against the real production peer, diffusers'
``QwenImageTransformer2DModel``.

    >>> from drifttool.probes.peer_catalog import peer_catalog
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

The factors and their declared expectations per device type are ``drifttool.probes.peer_catalog``'s.

CPU expectations that production arithmetic makes machine-dependent (the reduction order of
torch's CPU SDPA kernels and GEMMs follows the SIMD width ATen dispatches to, and the blocking
follows the sequence length) are declared ``observed``: run and reported, never judged. The
identical ones on the CPU are declared because nothing in them changes the arithmetic's shapes.
A device without a declaration for a probe gets ``PENDING`` (listed, never run).

The SDPA kernel torch picks is read back per attention call into the trace (the adapter's
``attention_kernel``); the matrix's settings list each probe's kernels (``attention_kernels``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage, load_transformer
from drifttool.artifact.reader import open_run
from drifttool.diff.clip import check_clip_range
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import DiffReport, Verdict
from drifttool.errors import DriftToolError
from drifttool.fixture import DEFAULT_FIXTURE, load_fixture
from drifttool.probes.peer_catalog import (GARBAGE_SEED, PEER_SLOTS, PEER_STEPS, PeerCall,
                                           PeerExpect, PeerProbe)
from drifttool.probes.results import ERROR, OBSERVED, PENDING, Matrix, ProbeResult, _from_report
from drifttool.probes.runner import judge
from drifttool.probes.spec import Expectation
from drifttool.runner import execute
from drifttool.setting_checks import check_device as settings_check_device
from drifttool.setting_checks import check_pixels
from drifttool.settings import RunSpec, resolve


# -- the peer forward ---------------------------------------------------------------------------
class PeerModel(DiffusersQwenImage):
    """The diffusers transformer behind drifttool's model call, run on ``device`` with one
    ``PeerCall``: inputs move to ``device`` (the runner already placed them there), the factor
    is applied, the instrumented forward runs there, and the velocity ``[B, N, C]`` (model
    dtype) goes back to the device of the sampler's latents ``x``, where the sampler's
    operators (drifttool's ``production`` ones, identical in both runs) take it with them."""

    def __init__(self, transformer: torch.nn.Module, call: PeerCall, device: torch.device) -> None:
        super().__init__(transformer)
        object.__setattr__(self, "call", call)
        object.__setattr__(self, "device", torch.device(device))

    def forward(self, x, txt, txt_mask, tau, img_grid, rt):
        dev, c = self.device, self.call
        home = x.device  # the sampler's device: the velocity goes back there
        x, txt, tau = x.to(dev), txt.to(dev), tau.to(dev, c.timestep_dtype)
        mask = None if txt_mask is None else txt_mask.to(dev)
        if c.pad_garbage and mask is not None:
            g = torch.Generator().manual_seed(GARBAGE_SEED)
            junk = (torch.randn(txt.shape, generator=g) * 100).to(dev, txt.dtype)
            txt = torch.where(mask[..., None].bool(), txt, junk)
        with c.around():
            v = super().forward(x, txt, mask, tau, img_grid, rt)
        return v.detach().to(home)


@contextlib.contextmanager
def planted_ulp(transformer: torch.nn.Module, plant: tuple[str, int] | None) -> Iterator[None]:
    """Raise one weight element by one ULP of its dtype (``torch.nextafter`` towards +inf) for
    the block; the original bytes are restored on exit.

    Raises:
        DriftToolError: no such parameter, or the index is outside it.
    """
    if plant is None:
        yield
        return
    name, index = plant
    params = dict(transformer.named_parameters())
    if name not in params or not 0 <= index < params[name].numel():
        raise DriftToolError(f"cannot plant a ULP at {name}[{index}]: no such weight element")
    flat = params[name].data.view(-1)
    old = flat[index].clone()
    flat[index] = torch.nextafter(old, torch.tensor(float("inf"), dtype=old.dtype, device=old.device))
    try:
        yield
    finally:
        flat[index] = old


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


def grid_fixture(out: str | Path, img_grid: tuple[int, int],
                 base: str | Path | None = None) -> Path:
    """Write a fixture directory at ``out`` holding ``base``'s settings (default: the tiny
    fixture) and prompt embeddings with the patch grid ``img_grid`` = (h, w) (pixels / 16); it
    has no ``transformer/`` (the peer's transformer is passed in memory) and no seal. Returns
    ``out``.

    Raises:
        DriftToolError: a grid that is not two positive integers.
        FixtureError: ``base`` cannot be read.
    """
    h, w = (int(v) for v in img_grid)
    if h < 1 or w < 1:
        raise DriftToolError(f"image grid {img_grid} must be positive (pixels / 16)")
    fx = load_fixture(base or DEFAULT_FIXTURE)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**fx.meta, "name": f"{fx.name}-{h}x{w}",
            "description": f"{fx.name}'s settings and prompts on a {h}x{w} patch grid",
            "settings": {**fx.settings, "img_grid": [h, w]}}
    (out / "fixture.json").write_text(json.dumps(meta, indent=2))
    shutil.copyfile(fx.path / "prompts.safetensors", out / "prompts.safetensors")
    return out


def load_peer(checkpoint: str | Path | None, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.bfloat16, fixture: str | Path | None = None) -> torch.nn.Module:
    """diffusers' ``QwenImageTransformer2DModel.from_pretrained`` of ``checkpoint`` (a transformer
    or pipeline folder; default: the fixture's ``transformer/``), in ``dtype``, on ``device``.

    Raises:
        DriftToolError: diffusers missing, an unloadable folder, or an unavailable device
            (``check_device``).
    """
    device = check_device(str(device))
    folder = checkpoint
    if folder is None:
        fx, _ = resolve(RunSpec(fixture=fixture))
        folder = fx.model_dir
    return load_transformer(folder, dtype).to(device)


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
                   device: torch.device, baseline: Path, out: Path,
                   clip_range: float | None = None) -> ProbeResult:
    """Run ``p`` under ``out/runs/<name>``, diff it against ``baseline`` (with ``clip_range``:
    its log-prob drift against it, ``ProbeResult.clip_*``), judge it."""
    e = p.expectation(device.type)
    if e is None:
        why = p.pending.get(device.type, f"no expectation declared for {device.type}")
        return _result(p, e, PENDING, reasons=[why])
    t0 = time.perf_counter()
    run_dir = out / "runs" / p.name
    try:
        run_peer(p, base, transformer, device, run_dir)
        report = diff_runs(open_run(baseline), open_run(run_dir), clip_range=clip_range)
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
    clip_range: float | None = None,
) -> Matrix:
    """Run the peer baseline, then every probe against it (module docstring).

    Args:
        probes: ``peer_catalog()`` or a selection.
        out: output directory: ``runs/<probe>`` (artifacts), ``diffs/<probe>.json``.
        transformer: the diffusers ``QwenImageTransformer2DModel`` (on ``device``, model dtype).
        base: the baseline spec (default ``peer_baseline()``).
        device: where the forwards run (``cpu`` or ``cuda``); picks the declared expectations.
        on_result: called with each ``ProbeResult`` as it is judged.
        clip_range: a PPO clip range ε: each probe's log-prob drift is reported against it
            (``drifttool.diff.clip``; ``ProbeResult.clip_*``, ``settings["clip_range"]``).

    Returns:
        ``Matrix`` (``drifttool.probes.matrix`` renders and writes it); its ``settings`` hold the
        baseline's settings plus ``peer`` (implementation, device, torch, diffusers) and
        ``attention_kernels`` (``{run: [kernels]}``).

    Raises:
        DriftToolError: the baseline cannot run (bad settings, checkpoint, device).
    """
    base = base or peer_baseline()
    device = torch.device(device)
    clip_range = None if clip_range is None else check_clip_range(clip_range)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    baseline = out / "runs" / "baseline"
    run_peer(None, base, transformer, device, baseline)
    t_base = time.perf_counter() - t0
    results, kernels = [], {"baseline": attention_kernels(baseline)}
    for p in probes:
        r = run_peer_probe(p, base, transformer, device, baseline, out, clip_range)
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
    if clip_range is not None:
        settings["clip_range"] = clip_range
    return Matrix(out=str(out), baseline=str(baseline), settings=settings, results=results,
                  seconds=time.perf_counter() - t0, baseline_seconds=t_base)


# -- command-line helpers -----------------------------------------------------------------------
def check_device(device: str | None) -> torch.device:
    """``device`` (default ``cpu``) as a ``torch.device``: ``setting_checks.check_device``'s rules
    (cpu, cuda or cuda:N, available here).

    Raises:
        DriftToolError: as ``drifttool.setting_checks.check_device``.
    """
    return torch.device(settings_check_device("cpu" if device is None else device))


def pixel_grid(height: int | None, width: int | None) -> tuple[int, int] | None:
    """The (h, w) patch grid of an image of ``height`` x ``width`` pixels (16 pixels a patch:
    8x VAE, 2x2 packing), or ``None`` when neither is given.

    Raises:
        DriftToolError: only one given, or not a multiple of 16 from 16 to
            ``setting_checks.MAX_PIXELS`` (``setting_checks.check_pixels``).
    """
    if height is None and width is None:
        return None
    if height is None or width is None:
        raise DriftToolError("give --height and --width together")
    return check_pixels("height", height) // 16, check_pixels("width", width) // 16
