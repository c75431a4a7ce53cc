"""A probe's result and the matrix of them: statuses, ``ProbeResult`` (one row), ``Matrix``.

    >>> report = diff_runs(open_run(baseline), open_run(run), clip_range=1e-4)
    >>> r = _from_report(p, report, judge(p, report), seconds, run)
    >>> r.status, r.first_op, r.clip_verdict
    ('PASS', 'latent_proj_gemm', 'above')

Statuses: ``PASS``; ``FINDING`` (a failed expectation) and ``ERROR`` (a probe that raised), both
findings; ``PENDING`` (never run, never a pass); ``OBSERVED`` (run and reported, not judged);
``NOT APPLICABLE`` (the change moved no byte: evidence of nothing). With a clip range
(``drifttool probe --clip-range``), each result also carries the log-prob drift of its diff
against it (``drifttool.diff.clip``: the worst step's max |exp(Δlogp_t) − 1| and its share of the
clip range, below or above the clip noise floor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from drifttool.diff.clip import clip_summary
from drifttool.diff.report import DiffReport, Verdict

PASS, FINDING, PENDING, ERROR = "PASS", "FINDING", "PENDING", "ERROR"
NOT_APPLICABLE = "NOT APPLICABLE"
"""A probe whose one change moves no byte on the baseline's weights and inputs
(``drifttool.probes.noop``): neither a pass nor a finding, reported with the reason."""
OBSERVED = "OBSERVED"
"""A probe run and reported but not judged (its expectation is ``observed``: the peer matrix's
machine-dependent production arithmetic, ``drifttool.probes.peer``); never a finding."""


# -- results ------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ProbeResult:
    """One row of the matrix. Drift columns are the worst over steps, samples and branches of
    the per-step drift the diff reports (max |Δ|; ``None`` when the quantity never differs or
    was not compared; KL of the SDE transition). ``first_rank``: the first drift's owning rank
    in the probe run (``FirstDrift.owner_b``); ``first_blocks``: its component's number of blocks
    (``FirstDrift.blocks``: a block after the last is shown so; not in ``matrix.arrow``);
    ``layout``: a distributed probe's layout.
    ``clip_*``: with a clip range (``clip_range``), the log-prob drift of the diff against it
    (``drifttool.diff.clip.ClipDrift``): ``clip_verdict`` (``below`` | ``above`` | ``no logp``),
    the worst (phase, step, branch)'s max |exp(Δlogp_t) − 1| (``clip_ratio_dev_max``), its share
    of the clip range (``clip_fraction``), its max |Δlogp_t| (``clip_max_abs``) and where it is
    (``clip_worst``, e.g. ``rollout step 2 cfg``); all ``None`` without a clip range."""

    name: str
    factor: str
    kind: str
    change: str
    expected: str
    expected_op: str | None
    status: str
    verdict: str | None = None
    first_drift: str | None = None
    first_op: str | None = None
    first_step: int | None = None
    first_block: int | None = None
    first_blocks: int | None = None
    first_stream: str | None = None
    first_branch: str | None = None
    first_sample: int | None = None
    first_rows: str | None = None
    first_rank: int | None = None
    origin: bool | None = None
    differing_records: int | None = None
    v_t: float | None = None
    x_t: float | None = None
    logp_t: float | None = None
    kl: float | None = None
    seconds: float = 0.0
    reasons: list[str] = field(default_factory=list)
    run_dir: str | None = None
    compare: str = "all"
    layout: str | None = None
    reference: str | None = None  # the run the probe run was diffed against (None: not run)
    clip_range: float | None = None
    clip_verdict: str | None = None
    clip_ratio_dev_max: float | None = None
    clip_fraction: float | None = None
    clip_max_abs: float | None = None
    clip_worst: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in (PASS, PENDING, OBSERVED, NOT_APPLICABLE)


def _worst(report: DiffReport, quantities: tuple[str, ...]) -> float | None:
    vals = [q.max_abs for s in report.steps for q in s.quantities
            if q.quantity in quantities and q.identical is False and q.max_abs is not None]
    return max(vals) if vals else None


def _worst_kl(report: DiffReport) -> float | None:
    vals = [k.kl for s in report.steps for k in s.kl if k.kl is not None and not math.isnan(k.kl)]
    return max(vals) if vals and max(vals) > 0 else None


def _result(p: Probe, status: str, **kw: Any) -> ProbeResult:
    return ProbeResult(name=p.name, factor=p.factor, kind=p.kind, change=p.change,
                       expected=p.expect.describe(), expected_op=p.expect.op, status=status,
                       compare=p.compare, layout=getattr(p, "layout", "") or None, **kw)


def _from_report(p: Probe, report: DiffReport, reasons: list[str], seconds: float,
                 run_dir: Path, reference: Path | None = None,
                 noop: str | None = None) -> ProbeResult:
    fd = report.first_drift
    kw: dict[str, Any] = dict(
        verdict=report.verdict.value, seconds=seconds, reasons=reasons, run_dir=str(run_dir),
        reference=None if reference is None else str(reference),
        differing_records=sum(c.differ for c in report.counts.values()),
        v_t=_worst(report, ("v_t",)), x_t=_worst(report, ("x_t", "x_next")),
        logp_t=_worst(report, ("logp_t",)), kl=_worst_kl(report),
    )
    kw.update(clip_summary(report.clip))
    if fd is not None:
        kw.update(first_drift=fd.where(), first_op=fd.op, first_step=fd.step,
                  first_block=fd.block, first_blocks=fd.blocks, first_stream=fd.stream, first_branch=fd.branch,
                  first_sample=fd.sample, origin=fd.origin, first_rank=fd.owner_b,
                  first_rows=None if fd.rows is None else
                  f"{fd.rows.n_differ}/{fd.rows.n_rows}: " + ", ".join(map(str, fd.rows.first)))
    if noop is not None:  # the change moved no byte: the verdict is evidence of nothing
        if report.verdict is Verdict.IDENTICAL:
            return _result(p, NOT_APPLICABLE, **{**kw, "reasons": [noop]})
        reasons = [*reasons, f"{noop}, yet the run is {report.verdict.value} "
                   "(not deterministic?)"]
    if getattr(p.expect, "verdict", None) == "observed" and not reasons:
        return _result(p, OBSERVED, **kw)
    return _result(p, FINDING if reasons else PASS, **kw)


@dataclass(kw_only=True)
class Matrix:
    """The matrix: the baseline it ran against, its settings and every probe's result."""

    out: str
    baseline: str
    settings: dict[str, Any]
    results: list[ProbeResult]
    seconds: float
    baseline_seconds: float

    @property
    def findings(self) -> list[ProbeResult]:
        return [r for r in self.results if not r.ok]

    @property
    def exit_code(self) -> int:
        """0 when no probe is a finding (pending and not-applicable probes are neither passes
        nor findings), else 1."""
        return 1 if self.findings else 0


