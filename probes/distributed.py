"""Distributed probes: a TP/SP/CFG-parallel layout run on gloo ranks against the one-process run
of the same settings (``drifttool probe --distributed``).

    >>> probes = distributed_probes(TINY_SETTINGS, 2)
    >>> [(p.name, p.layout, p.kind) for p in probes][:2]
    [('tp_bias_every_rank', 'TP2', 'mismatch'), ('sp_rope_no_offset', 'SP2 agrs', 'mismatch')]

Each probe's execution is a ``LayoutRun`` (``Probe.execute``): the reference is the one-process
run of the probe's settings (the matrix baseline itself when the probe keeps the baseline's
settings; otherwise run once under ``<out>/work/references/`` and shared by the probes of the
same settings), the probe run is the layout over ``dims.world_size`` spawned gloo ranks
(``drifttool.launch.run_parallel``), with at most one planted fault
(``drifttool.distributed.plan.FAULTS``). The probe run is run B of the diff, so the owning rank
a probe declares (``Expectation.rank``) is the layout run's: the rank that computed the first
differing row under SP (``FirstDrift.row_rank_b``), else the rank that wrote the record.

Settings: probes of TP and CFG-parallel layouts keep the baseline's (the tiny preset: 2 samples,
24 image tokens, 4 steps). The fixture's 4×6 grid is one 64-row image block, so under SP rank 1
would hold no image row; SP probes run ``SP_SETTINGS`` instead: 160×560 px (10×35 patches = 350
image tokens, 6 blocks; SP2 shards rows [0, 192) and [192, 350)), the baseline's first sample,
2 steps. Ring attention records no L2 internals (a rank never holds a whole row of scores), so
the ring control and its reference run at L1.

``tp_allreduce`` is declared an invariant at TP2: a plain all-reduce of two partials computes
p0 + p1 or p1 + p0, which IEEE addition makes the same bytes as the contract's tree (one add),
so the fault cannot change a byte at two ranks; the ranks check it at every call
(``plan.fault_effects``) and the probe is reported NOT APPLICABLE. At four ranks the all-reduce's association
differs from the tree's; that needs a model of at least 4 heads (the fixture has 2), and the
4-rank mismatch is declared in the slow tests only (tests/probes/test_distributed_probes.py,
on their 8-head model through ``LayoutRun(model=...)``), see docs/probes.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from drifttool.artifact.reader import open_run
from drifttool.distributed.plan import FAULTS, ParallelDims
from drifttool.launch import run_parallel
from drifttool.errors import UnsupportedConfigError
from drifttool.probes.spec import Expectation, Probe, ProbeContext
from drifttool.runner import execute

SP_IMAGE = {"height": 16 * 10, "width": 16 * 35}
"""350 image tokens: 6 blocks of 64 rows, SP2 shards of 192 and 158 rows (rank 1 holds rows)."""

SP_STEPS = 2

ModelFactory = Callable[[ProbeContext], Path]
"""Writes the probe's own checkpoint folder (under ``ctx.work``) and returns it: for layouts the
baseline's model does not divide (TP4 on a 2-head model)."""


def layout_name(dims: ParallelDims) -> str:
    """``"TP2"``, ``"SP2 ulysses"``, ``"TP2×SP2 agrs"``, ``"CFG2"``: the layout in short."""
    parts = [f"{k}{v}" for k, v in (("TP", dims.tp), ("SP", dims.sp), ("CFG", dims.cfg)) if v > 1]
    return "×".join(parts) + (f" {dims.sp_attention}" if dims.sp > 1 else "")


_REFERENCES: set[str] = set()  # reference runs this process wrote (reused only then)


@dataclass(frozen=True)
class LayoutRun:
    """``Probe.execute`` of a distributed probe: (one-process reference, layout run).

    Attributes:
        dims: the layout.
        faults: planted faults (``plan.FAULTS``); empty for an invariant control.
        settings: ``RunSpec`` field overrides of the baseline spec for both runs; empty: the
            baseline's settings (the reference is then the matrix baseline itself).
        model: the probe's own checkpoint (``ModelFactory``) for both runs, or None.
    """

    dims: ParallelDims
    faults: tuple[str, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    model: ModelFactory | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown or not self.dims.parallel:
            raise ValueError(f"LayoutRun: faults {unknown} unknown or one-rank layout {self.dims}")

    def spec(self, ctx: ProbeContext) -> Any:
        """The spec both runs share: the baseline's, with ``settings`` and ``model``."""
        over = dict(self.settings)
        if self.model is not None:
            over["checkpoint"] = self.model(ctx)
        return dataclasses.replace(ctx.base, **over)

    def __call__(self, ctx: ProbeContext) -> tuple[Path, Path]:
        if ctx.launched:
            raise UnsupportedConfigError("a distributed probe spawns its own ranks: run "
                                         "`drifttool probe --distributed` without torchrun")
        spec = self.spec(ctx)
        if not self.settings and self.model is None:
            reference = ctx.baseline
        else:
            reference = reference_run(ctx, spec)
        summary = run_parallel(spec, ctx.run_dir, self.dims, faults=self.faults, overwrite=True)
        effects = summary.get("fault_effects") or {}
        if self.faults and all(effects.get(f, [0, 1])[0] > 0 and effects[f][1] == 0 for f in self.faults):
            ctx.noop["reason"] = "no-op on these weights and inputs: " + "; ".join(
                f"{f} gave the contract's bytes at all {effects[f][0]} calls (checked on the ranks)"
                for f in self.faults)
        return reference, ctx.run_dir


def reference_run(ctx: ProbeContext, spec: Any) -> Path:
    """The one-process run of ``spec`` under ``<out>/work/references/<key>``: run once per matrix
    and shared by every probe of the same spec (a run this process did not write is redone)."""
    fields = {f.name: repr(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    path = ctx.work.parent / "references" / key
    if str(path) in _REFERENCES and (path / "manifest.json").exists() and open_run(path).complete:
        return path
    execute(spec, path, overwrite=True)
    _REFERENCES.add(str(path))
    return path


def _drift(op: str, **where: Any) -> Expectation:
    return Expectation(verdict="drift", op=op, **where)


IDENTICAL = Expectation(verdict="identical")


def _probe(name: str, factor: str, kind: str, change: str, run: LayoutRun, expect: Expectation,
           source: str = "") -> Probe:
    return Probe(name=name, factor=factor, kind=kind, change=change, expect=expect,
                 source=source or "RFC WS2; drifttool.distributed.plan.FAULTS",
                 execute=run, layout=layout_name(run.dims))


def sp_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``RunSpec`` overrides of the SP probes: ``SP_IMAGE``, the baseline's first sample,
    ``SP_STEPS`` steps."""
    return {**SP_IMAGE, "samples": list(settings["samples"])[:1], "batch": None, "steps": SP_STEPS}


def distributed_probes(settings: dict[str, Any], num_layers: int) -> list[Probe]:
    """The distributed probes for a baseline of ``settings`` (the resolved run settings) and
    ``num_layers`` blocks: mismatches (one planted fault each, declared where it drifts first,
    with the owning rank) and invariant controls (layouts that must not move a byte).

    Every declaration below was observed on the tiny preset (docs/probes.md)."""
    sp = sp_settings(settings)
    cfg_on = float(settings.get("cfg_scale", 1.0)) > 1
    first = list(settings["samples"])[0]
    tp2, cfg2 = ParallelDims(tp=2), ParallelDims(cfg=2)
    sp2 = ParallelDims(sp=2)
    out = [
        _probe("tp_bias_every_rank", "TP row-parallel bias", "mismatch",
               "row-parallel GEMM bias added by each of the 2 TP ranks instead of once",
               LayoutRun(tp2, ("tp_bias_every_rank",)),
               _drift("attn_out_bias_gemm", step=0, block=0, stream="img", branch="cond",
                      sample=first, rank=0)),
        _probe("sp_rope_no_offset", "SP RoPE positions", "mismatch",
               "SP rank 1 rotates its image rows [192, 350) with RoPE positions from 0",
               LayoutRun(sp2, ("sp_rope_no_offset",), sp),
               # the first differing row is rank 1's first image row: patch (5, 17) = token 192
               _drift("multi_axis_rope", step=0, block=0, stream="img", branch="cond",
                      sample=first, rank=1)),
        _probe("sp_padding_unmasked", "SP padding mask", "mismatch",
               "agrs: the image K/V shards zero-padded to the longest shard (192 rows) for the "
               "gather and the 34 pad rows left unmasked",
               LayoutRun(sp2, ("sp_padding_unmasked",), sp),
               # every query row sees the pads: the first differing row is text row 0 (SP rank 0)
               _drift("joint_attn_qk_gemm", step=0, block=0, stream="joint", branch="cond",
                      sample=first, rank=0)),
        _probe("tp_allreduce", "TP reduction order", "invariant",
               "row-parallel partials reduced by a plain all-reduce instead of the contract's "
               "tree: at TP2 one IEEE addition, commutative, so the same bytes",
               LayoutRun(tp2, ("tp_allreduce",)), IDENTICAL),
    ]
    cfg_probes = [
        _probe("noise_per_rank", "CFG-parallel SDE noise", "mismatch",
               "each CFG rank draws its own SDE noise (seed + rank): rank 1's x_t diverges "
               "after step 0 while rank 0 records the correct step",
               LayoutRun(cfg2, ("noise_per_rank",)),
               # the CFG ranks disagree on the SDE step that drew the noise (the sampler's calls
               # are checked on every rank)
               _drift("flow_sde_step_logp", step=0, block=-2, stream="img", branch="cfg",
                      sample=first, rank=1)),
        _probe("cfg_branch_swap", "CFG-parallel branch labels", "mismatch",
               "the CFG ranks run each other's branch under their own label",
               LayoutRun(cfg2, ("cfg_branch_swap",)),
               # rank 0's 'cond' forward embeds the negative prompt
               _drift("txt_in_rmsnorm_linear", step=0, block=-1, stream="txt", branch="cond",
                      sample=first, rank=0)),
    ]
    controls = [
        _probe("layout_tp2", "TP layout", "invariant", "TP2: heads and MLP channels on 2 ranks",
               LayoutRun(tp2), IDENTICAL),
        _probe("layout_sp2_agrs", "SP layout", "invariant",
               "SP2, all-gather attention: image rows [0, 192) and [192, 350) on 2 ranks",
               LayoutRun(sp2, (), sp), IDENTICAL),
        _probe("layout_sp2_ulysses", "SP layout", "invariant",
               "SP2, Ulysses attention (rows traded for heads)",
               LayoutRun(ParallelDims(sp=2, sp_attention="ulysses"), (), sp), IDENTICAL),
        _probe("layout_sp2_ring", "SP layout", "invariant",
               "SP2, Ring attention (K/V shards around the ring), capture L1 in both runs",
               LayoutRun(ParallelDims(sp=2, sp_attention="ring"), (), {**sp, "capture": "L1"}),
               IDENTICAL),
        _probe("layout_cfg2", "CFG-parallel layout", "invariant", "CFG2: one CFG branch per rank",
               LayoutRun(cfg2), IDENTICAL),
        _probe("layout_tp2_sp2", "TP×SP layout", "invariant",
               "TP2×SP2, all-gather attention, on 4 ranks",
               LayoutRun(ParallelDims(tp=2, sp=2), (), sp), IDENTICAL),
    ]
    if not cfg_on:  # CFG-parallel runs one branch per rank: nothing to split without CFG
        why = "needs a baseline with CFG (cfg_scale > 1 and a negative prompt)"
        cfg_probes = [p.with_(pending=why) for p in cfg_probes]
        controls = [p.with_(pending=why) if p.name == "layout_cfg2" else p for p in controls]
    return out + cfg_probes + controls
