"""Run the probe matrix: the baseline once, then every probe, each diffed against the baseline.

    >>> m = run_matrix(catalog(), "runs/probes", base=RunSpec())
    >>> [(r.name, r.status, r.first_op) for r in m.results][:2]
    [('latent_pack_channels_last', 'PASS', 'latent_proj_gemm'), ...]

Each probe run is an ordinary ``drifttool.runner.execute`` of the baseline ``RunSpec`` with the
probe's one change (field overrides, operator variants, or a transformed copy of the
checkpoint), written to ``<out>/runs/<probe>``; the diff is ``drifttool.diff.diff_runs`` (written
to ``<out>/diffs/<probe>.json``), and ``judge`` compares it with the probe's expectation.
Distributed probes (``drifttool.probes.distributed``) bring their own execution: a TP/SP/CFG-
parallel layout on spawned gloo ranks against the one-process run of the same settings; one
that declares an owning rank is judged on it too (``Expectation.rank``).

Under torchrun (``run_matrix(dist=, parallel=)``) the whole matrix runs in the launch's layout:
every rank runs the baseline and every probe run (TP/SP/CFG-parallel, or sample-parallel
without ``parallel``), each an artifact of every rank; rank 0 writes what is not a run (the
transformed checkpoints), diffs and judges, and returns the matrix (the other ranks ``None``),
whose settings name the launch (``launch``, ``layout``).
A probe the layout refuses (``UnsupportedConfigError``, raised alike on every rank before a run
starts: e.g. CFG off under CFG-parallel, a production variant under TP) is ``PENDING``, with
the refusal as its reason; any other error ends the launch (a rank cannot go on alone).
Results are data (``ProbeResult``); a failed expectation is a ``FINDING`` with its reasons, a
probe that raised is an ``ERROR`` (also a finding), a pending one is ``PENDING`` (never run,
never a pass). A probe whose change is a no-op on the baseline's weights and inputs, checked on
the bytes in one process (``drifttool.probes.noop``: every call of its operator variant equals
the operator's own output, or its checkpoint transform leaves every tensor as it was), is
``NOT APPLICABLE`` with the reason: neither a pass nor a finding.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from drifttool.artifact.reader import Run, open_run
from drifttool.diff.clip import check_clip_range
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import DiffReport, Verdict
from drifttool.collectives import barrier
from drifttool.errors import UnsupportedConfigError
from drifttool.model.checkpoint import read_config
from drifttool.probes.noop import variants_noop, weights_unchanged, wrap_variants
from drifttool.probes.results import (ERROR, FINDING, NOT_APPLICABLE, OBSERVED, PASS,  # noqa: F401
                                      PENDING, Matrix, ProbeResult, _from_report, _result)
from drifttool.probes.spec import Probe, ProbeContext
from drifttool.probes.weights import transformed_checkpoint
from drifttool.runner import execute
from drifttool.settings import RunSpec, resolve

# -- baseline description ----------------------------------------------------------------------
def baseline_settings(base: RunSpec) -> tuple[dict[str, Any], int, Path]:
    """The resolved settings of the baseline (plus ``prompt_len``: the longest prompt of its
    batch, negative prompt included; ``rope``: the model's RoPE axis sizes and theta), the model
    depth, and its checkpoint folder."""
    fx, s = resolve(base)
    folder = Path(s.checkpoint or fx.model_dir)
    cfg = read_config(folder)
    _, lens, _, neg_len = fx.prompts(cfg.joint_attention_dim, seed=s.seed)
    rows = [i % len(lens) for i in s.samples]
    record = dict(s.record(), prompt_len=max([int(lens[r]) for r in rows] + [int(neg_len)]),
                  rope={"axes_dims": list(cfg.axes_dims_rope), "theta": cfg.rope_theta})
    return record, cfg.num_layers, folder


# -- comparing only the samples both runs hold ------------------------------------------------
class SampleView(Run):
    """An artifact seen through a set of logical samples: op and step records of other samples
    are left out (records without a sample, ``sample = -1``, are kept). Lets a batch-size
    control compare the samples two runs share: the diff still aligns by identity."""

    def __init__(self, path: str | Path, samples: set[int]) -> None:
        super().__init__(path)
        self.keep = pa.array(sorted({int(s) for s in samples} | {-1}), type=pa.int32())

    def _only(self, t: pa.Table) -> pa.Table:
        return t.filter(pc.is_in(t.column("sample"), value_set=self.keep))

    def ops_table(self, rank: int | None = None) -> pa.Table:
        return self._only(super().ops_table(rank))

    def steps_table(self, rank: int | None = None) -> pa.Table:
        return self._only(super().steps_table(rank))

    def check(self) -> list[str]:
        """Check the whole artifact (every record, every sample), not the view."""
        return open_run(self.path).check()


def _samples_of(path: Path) -> set[int]:
    return {int(i) for i in open_run(path).steps_table().column("sample").to_pylist()}


def open_pair(baseline: str | Path, run: str | Path, compare: str = "all") -> tuple[Run, Run]:
    """Both artifacts, opened as a probe compares them: whole (``"all"``) or restricted to the
    logical samples both hold (``"common_samples"``)."""
    if compare == "common_samples":
        common = _samples_of(Path(baseline)) & _samples_of(Path(run))
        return SampleView(baseline, common), SampleView(run, common)
    return open_run(baseline), open_run(run)


def diff_probe(p: Probe, baseline: Path, run: Path, clip_range: float | None = None) -> DiffReport:
    """The probe run diffed against the baseline, as the probe asks (all or common samples);
    with ``clip_range`` its log-prob drift is judged against it (``DiffReport.clip``)."""
    return diff_runs(*open_pair(baseline, run, p.compare), clip_range=clip_range)


# -- judging ------------------------------------------------------------------------------------
def judge(p: Probe, report: DiffReport) -> list[str]:
    """Why the diff does not meet the probe's expectation (empty: it does)."""
    e = p.expect
    got = report.verdict.value
    if e.verdict == "observed":
        return []
    if e.verdict == "identical":
        return [] if report.verdict is Verdict.IDENTICAL else [
            f"expected identical, got {got}: {report.reason}"]
    if report.verdict is not Verdict.DRIFT:
        return [f"expected drift at {e.op}, got {got}: {report.reason}"]
    fd = report.first_drift
    reasons = []
    if fd.kind != "op":
        reasons.append(f"first drift is step quantity {fd.op!r}, expected operator {e.op}")
    elif fd.op != e.op:
        reasons.append(f"first drift at {fd.op}, expected {e.op}")
    for k in ("step", "block", "stream", "branch", "sample"):
        want = getattr(e, k)
        if want is not None and getattr(fd, k) != want:
            reasons.append(f"first drift {k} {getattr(fd, k)!r}, expected {want!r}")
    if e.origin and not fd.origin:
        reasons.append("first drift is not an origin (records missing before it)")
    if e.rank is not None and fd.owner_b != e.rank:
        how = ("the rank that disagrees with the record's writer" if fd.disagree_b else
               "the rank whose part of it differs" if fd.part_rank_b is not None else
               "the SP rank of its first differing row" if fd.row_rank_b is not None
               else "the rank that wrote it")
        reasons.append(f"first drift owned by rank {fd.owner_b} in the probe run ({how}), "
                       f"expected rank {e.rank}")
    if e.rows is not None:
        rows = None if fd.rows is None else tuple(str(r) for r in fd.rows.first)
        if fd.rows is None:
            reasons.append("no row digests to locate the rows (capture level below L2?)")
        elif rows != tuple(e.rows) or fd.rows.n_differ != len(e.rows):
            reasons.append(f"differing rows {list(rows)} ({fd.rows.n_differ} of "
                           f"{fd.rows.n_rows}), expected exactly {list(e.rows)}")
    return reasons


def _launched(dist: Any) -> bool:
    return dist is not None and dist.world_size > 1


def _launch_name(dist: Any, parallel: Any) -> str:
    """``on 2 ranks, tp 2 × sp 1 × cfg 1`` / ``on 2 ranks, sample-parallel``: where every run of a
    launched matrix ran (its title and ``settings["launch"]``)."""
    if parallel is None or not parallel.parallel:
        return f"on {dist.world_size} ranks, sample-parallel"
    sp = f"sp {parallel.sp}" + (f" {parallel.sp_attention}" if parallel.sp > 1 else "")
    return f"on {dist.world_size} ranks, tp {parallel.tp} × {sp} × cfg {parallel.cfg}"


def probe_spec(p: Probe, base: RunSpec, workdir: Path, checkpoint: Path, dist: Any = None) -> RunSpec:
    """The baseline spec with the probe's one change (writes a transformed checkpoint if any: on
    rank 0 of a launch, which every rank then waits for)."""
    spec = dataclasses.replace(base, **dict(p.spec))
    if p.variants:
        spec = dataclasses.replace(spec, variants={**base.variants, **p.build_variants()})
    if p.weights is not None:
        _, s = resolve(base)
        folder = workdir / "transformer"
        if not _launched(dist) or dist.rank == 0:
            folder = transformed_checkpoint(checkpoint, p.weights, folder, dtype=s.torch_dtype)
        if _launched(dist):
            barrier()
        spec = dataclasses.replace(spec, checkpoint=folder)
    return spec


def run_probe(p: Probe, base: RunSpec, baseline: Path, out: Path, checkpoint: Path, *,
              dist: Any = None, parallel: Any = None,
              clip_range: float | None = None) -> ProbeResult | None:
    """Run one probe under ``out/runs/<name>`` and judge its diff against ``baseline``; under a
    launch (``dist``, ``parallel``: module docstring) on every rank, judged on rank 0 (the other
    ranks return ``None``); ``clip_range``: as ``run_matrix``."""
    if p.pending:
        return _result(p, PENDING, reasons=[p.pending])
    t0 = time.perf_counter()
    executed_noop = None
    work = out / "work" / p.name
    run_dir = out / "runs" / p.name
    root = not _launched(dist) or dist.rank == 0
    witnesses: list = []
    try:
        if p.execute is None and p.weights is not None and not _launched(dist):
            why = weights_unchanged(checkpoint, p.weights, resolve(base)[1].torch_dtype)
            if why is not None:  # proven on the bytes: no run to make
                return _result(p, NOT_APPLICABLE, seconds=time.perf_counter() - t0, reasons=[why])
        if p.execute is not None:
            work.mkdir(parents=True, exist_ok=True)
            ctx = ProbeContext(base=base, baseline=baseline, work=work, run_dir=run_dir,
                               checkpoint=checkpoint, dist=dist, parallel=parallel)
            reference, run_dir = p.execute(ctx)
            executed_noop = ctx.noop.get("reason")
        else:
            spec = probe_spec(p, base, work, checkpoint, dist)
            if p.variants and not _launched(dist):  # one process: compare each call's bytes
                wrapped, witnesses = wrap_variants({op: spec.variants[op] for op in p.variants})
                spec = dataclasses.replace(spec, variants={**spec.variants, **wrapped})
            execute(spec, run_dir, overwrite=True, dist=dist, parallel=parallel)
            reference = baseline
        if not root:
            return None
        report = diff_probe(p, reference, run_dir, clip_range)
    except UnsupportedConfigError as e:
        if not _launched(dist):
            return _error(p, e, t0)
        return _result(p, PENDING, reasons=[f"not under this launch's layout: {e}"]) if root else None
    except Exception as e:  # noqa: BLE001 - a probe that cannot run is itself a finding
        if _launched(dist):
            raise  # the other ranks may wait in a collective: end the launch
        return _error(p, e, t0)
    (out / "diffs").mkdir(parents=True, exist_ok=True)
    (out / "diffs" / f"{p.name}.json").write_text(report.to_json())
    return _from_report(p, report, judge(p, report), time.perf_counter() - t0, run_dir,
                        reference, noop=variants_noop(witnesses) or executed_noop)


def _error(p: Probe, e: Exception, t0: float) -> ProbeResult:
    return _result(p, ERROR, seconds=time.perf_counter() - t0,
                   reasons=[f"{type(e).__name__}: {e}",
                            traceback.format_exc(limit=3).strip().splitlines()[-1]])


def run_matrix(
    probes: list[Probe],
    out: str | Path,
    *,
    base: RunSpec | None = None,
    on_result: Callable[[ProbeResult], Any] | None = None,
    dist: Any = None,
    parallel: Any = None,
    clip_range: float | None = None,
) -> Matrix | None:
    """Run the baseline and every probe; see the module docstring.

    Args:
        probes: the probes to run (``catalog(...)``, possibly filtered).
        out: output directory (created; earlier probe runs in it are replaced).
        base: the baseline ``RunSpec`` (default: the embedded tiny fixture, strict).
        on_result: called with each ``ProbeResult`` as it is judged (progress display; rank 0).
        dist, parallel: this process's place in a torchrun launch and the launch's layout
            (``DistContext``, ``ParallelDims`` or None for sample-parallel), as
            ``runner.execute`` takes them; default one process.
        clip_range: a PPO clip range ε: each probe's log-prob drift is judged against it
            (``drifttool.diff.clip``; ``ProbeResult.clip_*``); verdicts and statuses unchanged.

    Returns:
        The matrix; ``None`` on ranks other than 0 of a launch.

    Raises:
        DriftToolError: the baseline itself cannot run (bad fixture, checkpoint, settings, or a
            layout the baseline does not allow).
    """
    base = base or RunSpec()
    if clip_range is not None:
        clip_range = check_clip_range(clip_range)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings, _, checkpoint = baseline_settings(base)
    t0 = time.perf_counter()
    baseline = out / "runs" / "baseline"
    execute(base, baseline, overwrite=True, dist=dist, parallel=parallel)
    t_base = time.perf_counter() - t0
    results = []
    for p in probes:
        r = run_probe(p, base, baseline, out, checkpoint, dist=dist, parallel=parallel,
                      clip_range=clip_range)
        if r is None:
            continue
        results.append(r)
        if on_result is not None:
            on_result(r)
    if _launched(dist) and dist.rank != 0:
        return None
    if clip_range is not None:
        settings = {**settings, "clip_range": clip_range}
    if _launched(dist):
        settings = {**settings, "launch": _launch_name(dist, parallel),
                    "layout": {**(parallel.layout() if parallel is not None and parallel.parallel
                                  else {"kind": "sample_parallel"}), "world_size": dist.world_size}}
    return Matrix(out=str(out), baseline=str(baseline), settings=settings, results=results,
                  seconds=time.perf_counter() - t0, baseline_seconds=t_base)
