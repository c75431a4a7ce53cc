"""Figures: drift by step × block (one heatmap per drifting probe) and per-step drift overlays.

    >>> grid = drift_grid(open_run("runs/baseline"), open_run("runs/gelu_exact"))
    >>> grid.columns[:4], grid.steps
    (['in', 'b0', 'b1', 'out'], [-1, 0, 1, 2, 3])
    >>> heatmap(grid, "heatmaps/gelu_exact.png", title="gelu_exact")
    >>> overlay("runs/baseline", ["runs/gelu_exact", "runs/latents_bf16"], "overlay.png")

Heatmap cell (step, column) = the fraction of the op records of that step and column whose digest
differs; the first drift is boxed. Columns: ``in`` (block −1: timestep, text and image input
projections), ``b0`` … ``b{L−1}`` (the blocks), ``out`` (final AdaLN and output projection),
``sampler`` (sigma table, CFG combine, SDE step). The overlay (RFC ``qwenimage_ablation_overlay``)
draws, for each run against the baseline, the per-step worst max |Δ| of ``v_t``, of the latent
after the step (``x_next``), of ``logp_t``, and the SDE-transition KL, on log axes, one colour per
run in every panel; steps where a quantity is bitwise equal are left out of its curve. Each panel
lists, below its curves (``panel_notes``), the runs it has no curve for: ``identical`` (the
quantity was compared at every step and never differs), ``not compared`` (the diff holds no value
of it), ``incomparable`` / ``inconclusive`` (the diff's verdict, with its reason: such a run is
never drawn as identical). (A sampled step's ``logp_t``
depends only on its noise, so a drifting velocity leaves it identical; the KL shows it.) matplotlib is imported lazily with the Agg backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from drifttool.artifact.reader import Run, open_run
from drifttool.diff.align import compare_table
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import DiffReport, Verdict
from drifttool.artifact import schema as S
from drifttool.errors import writing

SAMPLER_OPS = ("flow_sigma_table", "cfg_combine_renorm", "flow_sde_step_logp")

FIGURE_CREATOR = "drifttool figure"
"""The mark every figure drifttool writes carries (``_saved``), in the metadata of its format
(``FIGURE_KEYS``): ``drifttool overlay -o`` replaces only a file carrying it
(``drifttool.cli._paths``), never a user's image of the same format."""

FIGURE_KEYS = {".png": "Software", ".pdf": "Creator", ".svg": "Creator"}
"""The metadata key ``FIGURE_CREATOR`` is written under, by format: a PNG ``tEXt`` chunk before the
image data, the PDF's Info dictionary (at its end), the SVG's ``<metadata>`` (``dc:creator``)."""


@dataclass(kw_only=True)
class DriftGrid:
    """Differing / compared op records per (step, column)."""

    steps: list[int]
    columns: list[str]
    differ: np.ndarray  # [steps, columns] int
    total: np.ndarray  # [steps, columns] int
    first: tuple[int, str] | None  # (step, column) of the first drift

    @property
    def fraction(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.total > 0, self.differ / np.maximum(self.total, 1), np.nan)


def _column(op: str, block: int, depth: int) -> str:
    if op in SAMPLER_OPS:
        return "sampler"
    if block < 0:
        return "in"
    return "out" if block >= depth else f"b{block}"


def drift_grid(run_a: Run, run_b: Run, report: DiffReport | None = None) -> DriftGrid:
    """Count differing op records per (step, column) between two runs (aligned by identity)."""
    cols = list(dict.fromkeys([*S.OPS_KEY, *S.OP_ORDER, "digest"]))
    t = compare_table(run_a.ops_table().select(cols), run_b.ops_table().select(cols), S.OPS_KEY)
    depth = int((run_a.manifest.get("fingerprint") or {}).get("arch", {}).get("num_layers", 0))
    step = t.a.column("step").to_numpy()
    block = t.a.column("block").to_numpy()
    op = t.a.column("op").to_pylist()
    col = [_column(o, int(b), depth) for o, b in zip(op, block)]
    columns = ["in", *[f"b{i}" for i in range(depth)], "out", "sampler"]
    steps = sorted({int(s) for s in step})
    si = {s: i for i, s in enumerate(steps)}
    ci = {c: i for i, c in enumerate(columns)}
    total = np.zeros((len(steps), len(columns)), np.int64)
    differ = np.zeros_like(total)
    for i in t.al.ia:
        total[si[int(step[i])], ci[col[i]]] += 1
    for i in t.da:
        differ[si[int(step[i])], ci[col[i]]] += 1
    first = None
    fd = report.first_drift if report is not None else None
    if fd is not None and fd.kind == "op":
        first = (fd.step, _column(fd.op, fd.block, depth))
    elif t.da.size:
        k = int(t.da[np.argmin(t.pos_a[t.da])])
        first = (int(step[k]), col[k])
    return DriftGrid(steps=steps, columns=columns, differ=differ, total=total, first=first)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def heatmap(grid: DriftGrid, path: str | Path, *, title: str = "") -> Path:
    """Draw ``grid`` (fraction of differing records) as a step × column heatmap PNG."""
    return _saved(heatmap_figure(grid, title=title), path)


def _saved(fig, path: str | Path) -> Path:
    """Write ``fig`` at ``path`` in the format its suffix names (its folder made), marked as
    drifttool's (``FIGURE_CREATOR``) where the format is PNG, PDF or SVG, then close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = FIGURE_KEYS.get(path.suffix.lower())
    try:
        with writing(path):
            fig.savefig(path, dpi=110, metadata={key: FIGURE_CREATOR} if key else None)
    finally:
        _pyplot().close(fig)
    return path


def heatmap_figure(grid: DriftGrid, *, title: str = ""):
    """``heatmap``'s matplotlib figure (the caller closes it): steps in rows (the records made
    before the first step as ``before 0``), ``DriftGrid.columns`` in columns."""
    plt = _pyplot()
    frac = grid.fraction
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 + 0.7 * len(grid.columns)),
                                    1.8 + 0.45 * len(grid.steps)))
    im = ax.imshow(np.ma.masked_invalid(frac), cmap="magma_r", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(grid.columns)), grid.columns)
    ax.set_yticks(range(len(grid.steps)), [S.step_name(s) for s in grid.steps])
    ax.set_xlabel("block: in = before block 0, b<i>, out = after the last; sampler = sigma/CFG/SDE",
                  fontsize=8)
    ax.set_ylabel("step (before 0: records made before the first step)", fontsize=8)
    for (r, c), n in np.ndenumerate(grid.differ):
        if grid.total[r, c]:
            ax.text(c, r, f"{n}/{grid.total[r, c]}", ha="center", va="center", fontsize=7,
                    color="white" if frac[r, c] > 0.5 else "black")
    if grid.first is not None and grid.first[0] in grid.steps:
        r, c = grid.steps.index(grid.first[0]), grid.columns.index(grid.first[1])
        ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, lw=2.5, ec="tab:cyan"))
    fig.colorbar(im, ax=ax, label="fraction of op records that differ")
    ax.set_title(title or "drift by step x block", fontsize=10)
    fig.tight_layout()
    return fig


# -- overlay -------------------------------------------------------------------------------------
QUANTITIES = (("v_t", "v_t max|Δ|"), ("x_next", "x_next max|Δ|"), ("logp_t", "logp_t max|Δ|"),
              ("kl", "KL of the SDE transition"))


def step_curves(report: DiffReport) -> dict[str, tuple[list[int], list[float]]]:
    """Per quantity: (steps, worst value per step); 0 where the quantity is identical."""
    curves: dict[str, tuple[list[int], list[float]]] = {q: ([], []) for q, _ in QUANTITIES}
    for s in report.steps:
        if s.step < 0:
            continue
        for q, _ in QUANTITIES:
            if q == "kl":
                vals = [k.kl for k in s.kl if k.kl is not None and np.isfinite(k.kl)]
                val = max(vals) if vals else None
            else:
                w = s.worst(q)
                val = None if w is None else (0.0 if w.identical else w.max_abs)
            if val is not None:
                curves[q][0].append(s.step)
                curves[q][1].append(float(val))
    return curves


def panel_notes(labels: Sequence[str], reports: Sequence[DiffReport]) -> dict[str, list[str]]:
    """Per quantity, the lines a panel shows for the runs without a curve in it, e.g.
    ``["identical: a, b", "incomparable: c (cannot align: fingerprint.arch.depth: 2 != 3)"]``.

    A run whose diff is incomparable or inconclusive is named with its verdict and reason in every
    panel (an inconclusive run's curve, if any, is still drawn); of the others, a run whose
    quantity has a value at some step and never differs is ``identical``, one without any value
    ``not compared``.
    """
    notes: dict[str, list[str]] = {q: [] for q, _ in QUANTITIES}
    for q, _ in QUANTITIES:
        same, absent, verdicts = [], [], []
        for lab, rep in zip(labels, reports):
            if rep.verdict in (Verdict.INCOMPARABLE, Verdict.INCONCLUSIVE):
                verdicts.append(f"{rep.verdict.value}: {lab} ({rep.reason})")
                continue
            ys = step_curves(rep)[q][1]
            if not ys:
                absent.append(lab)
            elif not any(y > 0 for y in ys):
                same.append(lab)
        notes[q] = ([f"identical: {', '.join(same)}"] if same else []) + \
            ([f"not compared: {', '.join(absent)}"] if absent else []) + verdicts
    return notes


def overlay_figure(baseline: str | Path, runs: Sequence[str | Path], *,
                   labels: Sequence[str] | None = None, title: str = ""):
    """The overlay as a matplotlib figure (four panels) and the diff reports (in ``runs``
    order); ``overlay`` saves it. The caller closes the figure.

    Raises:
        ArtifactError: an artifact cannot be read.
    """
    plt = _pyplot()
    labels = list(labels) if labels else [Path(r).name for r in runs]
    base = open_run(baseline)
    reports = [diff_runs(base, open_run(r)) for r in runs]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    steps: set[int] = set()
    for k, (lab, rep) in enumerate(zip(labels, reports)):
        if rep.verdict is Verdict.INCOMPARABLE:
            continue  # nothing aligned: no curve
        curves = step_curves(rep)
        for ax, (q, _) in zip(axes.flat, QUANTITIES):
            xs, ys = curves[q]
            steps.update(xs)
            ys = np.array(ys, dtype=float)
            if ys.size == 0 or not np.any(ys > 0):
                continue
            ax.plot(xs, np.where(ys > 0, ys, np.nan), marker="o", color=f"C{k % 10}",
                    label=f"{lab} ({rep.verdict.value})")
    notes = panel_notes(labels, reports)
    for ax, (q, name) in zip(axes.flat, QUANTITIES):
        ax.set_title(name, fontsize=10)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("step")
        if steps:
            ax.set_xticks(sorted(steps))
        if notes[q]:
            ax.text(0.01, 0.01, "\n".join(notes[q]), transform=ax.transAxes, fontsize=7,
                    va="bottom", wrap=True)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title or f"drift per step against {Path(baseline).name}", fontsize=11)
    fig.tight_layout()
    return fig, reports


def overlay(baseline: str | Path, runs: Sequence[str | Path], path: str | Path, *,
            labels: Sequence[str] | None = None, title: str = "") -> tuple[Path, list[DiffReport]]:
    """Per-step drift curves of ``runs`` against ``baseline`` on one figure (four panels),
    written to ``path`` (``overlay_figure``).

    Returns the figure path and the diff reports (in ``runs`` order).

    Raises:
        ArtifactError: an artifact cannot be read.
    """
    fig, reports = overlay_figure(baseline, runs, labels=labels, title=title)
    return _saved(fig, path), reports
