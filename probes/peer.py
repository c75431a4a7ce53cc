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

import contextlib
import dataclasses
import json
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage, load_transformer
from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import DiffReport, Verdict
from drifttool.errors import DriftToolError
from drifttool.fixture import DEFAULT_FIXTURE, load_fixture
from drifttool.probes.runner import ERROR, OBSERVED, PENDING, Matrix, ProbeResult, _from_report, judge
from drifttool.probes.spec import Expectation
from drifttool.runner import execute
from drifttool.setting_checks import check_device as settings_check_device
from drifttool.setting_checks import check_pixels
from drifttool.settings import RunSpec, resolve

PEER_STEPS = 2
PEER_SLOTS = 128
PAD_VARIANTS = (100, 160)
GARBAGE_SEED = 10_386
PLANT = ("transformer_blocks.0.attn.norm_q.weight", 0)
"""The planted weight of ``ulp_norm_q_gain``: element 0 of block 0's image-stream Q RMSNorm
gain. diffusers multiplies the normalized bf16 row by the bf16 gain in bf16, so a gain one ULP
larger moves the product by at least half an output ULP: rows flip at ``qk_rmsnorm`` (img,
block 0, call 0), whatever the width."""

KINDS = ("invariant", "drifting", "sensitivity")
VERDICTS = ("identical", "drift", "observed")


# -- declarations -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PeerExpect:
    """What the diff of a peer probe against the peer baseline must say on one device type.

    Attributes:
        verdict: ``identical`` (every record of both runs compared and equal), ``drift`` (some
            common record differs) or ``observed`` (reported, not judged: production arithmetic
            that is machine-dependent).
        op, step, block, stream: fields of the first drift, checked when set (``drift`` only).
        why: where the expectation comes from (the study, a measurement, a reason).
    """

    verdict: str
    op: str | None = None
    step: int | None = None
    block: int | None = None
    stream: str | None = None
    why: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} not in {VERDICTS}")
        if self.verdict != "drift" and any(
                getattr(self, k) is not None for k in ("op", "step", "block", "stream")):
            raise ValueError("only a drift expectation names where the first drift is")

    def describe(self) -> str:
        """One line, e.g. ``drift at qk_rmsnorm (img, block 0, step 0)`` or ``observed``."""
        if self.verdict != "drift" or self.op is None:
            return self.verdict
        where = [f"{k} {getattr(self, k)}" for k in ("block", "step") if getattr(self, k) is not None]
        if self.stream:
            where.insert(0, self.stream)
        return f"drift at {self.op}" + (f" ({', '.join(where)})" if where else "")

    def as_expectation(self) -> Expectation:
        """The strict matrix's ``Expectation`` (for ``runner.judge``); ``drift`` with an op."""
        return Expectation(verdict=self.verdict, op=self.op, step=self.step, block=self.block,
                           stream=self.stream, origin=True)


@dataclass(frozen=True, kw_only=True)
class PeerCall:
    """How the peer's forward is called: every field at its default is the baseline call.

    Attributes:
        sdpa: names of ``torch.nn.attention.SDPBackend`` members the forward may use
            (``sdpa_kernel([...])`` around it); ``None``: torch's default selection.
        grad: run the forward under ``torch.enable_grad()`` (default ``torch.no_grad()``).
        timestep_dtype: dtype of the timestep tensor handed to diffusers (the values are bf16
            values in either dtype under the ``pipeline_bf16`` policy).
        pad_garbage: overwrite the masked (padded) prompt rows with finite garbage,
            N(0, 100²) from ``GARBAGE_SEED``, in the model dtype.
    """

    sdpa: tuple[str, ...] | None = None
    grad: bool = False
    timestep_dtype: torch.dtype = torch.float32
    pad_garbage: bool = False

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        """Grad mode and SDPA backend selection for one forward."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad() if self.grad else torch.no_grad())
            if self.sdpa is not None:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                stack.enter_context(sdpa_kernel([getattr(SDPBackend, n) for n in self.sdpa]))
            yield


@dataclass(frozen=True, kw_only=True)
class PeerProbe:
    """One row of the peer matrix: one factor against the peer baseline.

    Attributes:
        name, factor, kind (``KINDS``), change: as in the strict matrix.
        expect: ``{device type: PeerExpect}`` (``"cuda"``, ``"cpu"``); a device type without an
            entry makes the probe ``PENDING`` there, with ``pending[device]`` as the reason.
        spec: ``RunSpec`` field overrides (``samples``, ``pad_prompts_to``).
        call: the forward's call (``PeerCall``).
        plant: ``(parameter name, flat index)``: that weight element is raised by one ULP for
            the probe run (restored afterwards).
    """

    name: str
    factor: str
    kind: str
    change: str
    expect: Mapping[str, PeerExpect]
    spec: Mapping[str, Any] = field(default_factory=dict)
    call: PeerCall = PeerCall()
    plant: tuple[str, int] | None = None
    pending: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"peer probe {self.name}: kind {self.kind!r} not in {KINDS}")
        for dev, e in self.expect.items():
            if self.kind == "invariant" and e.verdict == "drift":
                raise ValueError(f"peer probe {self.name}: an invariant cannot expect drift ({dev})")
            if self.kind == "sensitivity" and (e.verdict != "drift" or e.op is None):
                raise ValueError(f"peer probe {self.name}: a sensitivity probe names its operator")

    def expectation(self, device: str) -> PeerExpect | None:
        """The expectation on ``device`` (a device type or ``torch.device`` string)."""
        return self.expect.get(torch.device(device).type)


_STUDY = "H200 study (torch 2.11, diffusers 0.42.1, full width, 1024², 128 slots)"
_SIMD = ("CPU: observed only; the CPU SDPA/GEMM reduction order follows the SIMD width ATen "
         "dispatches to and the blocking follows the sequence length")


def _identical(why_cuda: str = _STUDY, why_cpu: str = "nothing changes the arithmetic's shapes"):
    return {"cuda": PeerExpect(verdict="identical", why=why_cuda),
            "cpu": PeerExpect(verdict="identical", why=why_cpu)}


def peer_catalog(slots: int = PEER_SLOTS, pads: tuple[int, ...] = PAD_VARIANTS,
                 samples: tuple[int, ...] = (0, 1)) -> list[PeerProbe]:
    """The declared peer probes for a baseline of ``slots`` text slots and ``samples``."""
    attn = dict(op="joint_attention_fused", block=0, step=0, stream="joint")
    out = [
        PeerProbe(name="repeat", factor="repetition", kind="invariant",
                  change="the baseline rollout again", expect=_identical()),
        PeerProbe(name="batch_order_reversed", factor="batch position", kind="invariant",
                  change=f"samples {list(samples[::-1])} instead of {list(samples)}",
                  spec={"samples": list(samples[::-1])}, expect=_identical()),
        PeerProbe(name="grad_enabled", factor="grad mode", kind="invariant",
                  change="forward under torch.enable_grad() instead of torch.no_grad()",
                  call=PeerCall(grad=True), expect=_identical()),
        PeerProbe(name="timestep_bf16", factor="timestep dtype", kind="invariant",
                  change="bf16 timestep tensor holding the same bf16 values as the fp32 one",
                  call=PeerCall(timestep_dtype=torch.bfloat16), expect=_identical()),
        PeerProbe(name="pad_garbage", factor="masked pad contents", kind="invariant",
                  change="N(0, 100²) garbage instead of zeros in the masked prompt rows",
                  call=PeerCall(pad_garbage=True),
                  expect=_identical(why_cpu="masked keys get weight exactly 0; rows are "
                                    "independent in every other operator")),
    ]
    for n in pads:
        out.append(PeerProbe(
            name=f"pad_{n}", factor="prompt padding length", kind="drifting",
            change=f"prompts right-padded (masked) to {n} text slots instead of {slots}",
            spec={"pad_prompts_to": n},
            expect={"cuda": PeerExpect(verdict="drift", why=_STUDY),
                    "cpu": PeerExpect(verdict="observed", why=_SIMD)}))
    out += [
        PeerProbe(name="sdpa_math", factor="SDPA backend", kind="drifting",
                  change="sdpa_kernel([MATH]) instead of torch's default selection",
                  call=PeerCall(sdpa=("MATH",)),
                  expect={"cuda": PeerExpect(verdict="drift", **attn, why=_STUDY),
                          "cpu": PeerExpect(verdict="observed", why=_SIMD)}),
        PeerProbe(name="sdpa_efficient", factor="SDPA backend", kind="drifting",
                  change="sdpa_kernel([EFFICIENT_ATTENTION]) instead of torch's default selection",
                  call=PeerCall(sdpa=("EFFICIENT_ATTENTION",)),
                  expect={"cuda": PeerExpect(verdict="drift", **attn, why=_STUDY)},
                  pending={"cpu": "torch has no EFFICIENT_ATTENTION SDPA kernel on the CPU"}),
        PeerProbe(name="ulp_norm_q_gain", factor="sensitivity (planted weight ULP)",
                  kind="sensitivity",
                  change=f"{PLANT[0]}[{PLANT[1]}] raised by one bf16 ULP",
                  plant=PLANT,
                  expect={d: PeerExpect(verdict="drift", op="qk_rmsnorm", stream="img", block=0,
                                        step=0, why="a planted change must be located")
                          for d in ("cuda", "cpu")}),
    ]
    names = [p.name for p in out]
    if len(set(names)) != len(names):  # pragma: no cover - a declaration bug
        raise ValueError(f"duplicate peer probe names in {names}")
    return out


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


def select(probes: list[PeerProbe], only: str | None) -> list[PeerProbe]:
    """The probes named in the comma-separated ``only`` (all when ``None``).

    Raises:
        DriftToolError: an unknown name (the message lists the known ones).
    """
    if not only:
        return probes
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - {p.name for p in probes})
    if unknown:
        raise DriftToolError(f"unknown peer probe(s) {unknown}; known: {[p.name for p in probes]}")
    return [p for p in probes if p.name in names]


def describe(p: PeerProbe) -> str:
    """One listing line: name, kind, factor and the expectation per device type."""
    exp = "; ".join(f"{d}: {p.expect[d].describe() if d in p.expect else 'pending (' + p.pending.get(d, 'none declared') + ')'}"
                    for d in ("cuda", "cpu"))
    return f"{p.name:22} {p.kind:11} {p.factor:34} {exp}"


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
