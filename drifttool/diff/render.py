"""Rich rendering of a ``DiffReport`` for people (``report.to_json()`` is for machines).

    DRIFT  first drift at rollout step 1 cond block 1 joint joint_attn#0 sample 1 (owning rank 0); origin
    (every earlier record matches); 21 differing records; compared at L2: step records, operator
    outputs and their row digests
    records: steps 48 paired (37 equal, 11 differ), 0 only A, 0 only B; ops 72 paired ...
    first drift (A | B)
    │ owning rank│ 0 (run A), 0 (run B)                │
    │ step       │ 1                                   │
    │ block      │ 1                                   │
    │ op         │ joint_attn                          │
    │ digest     │ 9dc0ba1a2ff32497 | 207d5bad1a69f481 │
    │ rows       │ 1 of 11 differ: img (1, 1)          │  ...
    per step (worst sample and branch; '=' bitwise identical; x_t is the input)
                         x_t        v_t        v_t     x_next   logp_t              ops
     step   sigma     max|Δ|     max|Δ|     rel L2     max|Δ|   max|Δ|         KL     ≠
        0       1          =          =          =          =        =          0     0
        1   0.667          =      0.001    0.00103   0.000333        =   3.54e-09     2
        2   0.333   0.000333   3.57e-05   4.74e-05    0.00033        =   6.96e-09     8
    first differing op per step
     phase     step   x_t   branch   block   stream   op             sample
     rollout      1     =   cond         1   joint    joint_attn#0        1
     rollout      2     ≠   cond         0   img      img_mlp#0           1

When a run is laid out with SP and names the rank that computed the first differing row
(``FirstDrift.row_rank_a/row_rank_b``), ``owning rank`` shows that rank per run and a ``written
by`` row the record's writer (TP/SP coordinate 0); where a TP/SP run's ranks disagree on the
record (``disagree_a/disagree_b``) or the rank whose part differs is known, that rank is the
owner and a ``ranks disagree`` row names them. Sampler operators show block ``sampler``
(``schema.SAMPLER_BLOCK``). Per-step cells show the
worst sample and branch of the step (largest max|Δ|; "*": see the notes under the table, e.g.
the dtypes differ); a non-'=' x_t means the drift was carried into the step; "ops ≠ 3+2?" means
3 differing op records and 2 present in one run only. A legend under the table explains a step
-1 row and an ``N+M?`` cell where the table shows one (``steps_legend``).
"""

from __future__ import annotations

import math

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from drifttool.artifact.schema import BEFORE_STEPS, DEFAULT_COMPONENT, block_name, label, step_name
from drifttool.diff.clip import percent
from drifttool.diff.context import shown_context
from drifttool.diff.report import DiffReport, StepDrift, Verdict

_STYLE = {Verdict.IDENTICAL: "bold green", Verdict.DRIFT: "bold red",
          Verdict.INCOMPARABLE: "bold magenta", Verdict.INCONCLUSIVE: "bold yellow"}


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return "0" if x == 0 else f"{x:.3g}"


def _pair(a, b) -> str:
    return str(a) if a == b else f"{a} | {b}"


def _first_drift_table(report: DiffReport) -> Table:
    fd = report.first_drift
    t = Table(title="first drift (A | B)", show_header=False, title_justify="left")
    t.add_column("field", style="bold")
    t.add_column("value")
    if fd.disagree_a or fd.disagree_b or fd.part_rank_a is not None:
        # a TP/SP run: the rank that disagrees (or whose part differs), then the writer
        ranks = [("owning rank", f"{fd.owner_a} (run A), {fd.owner_b} (run B)"),
                 ("written by", f"{fd.rank_a} (run A), {fd.rank_b} (run B)")]
        ranks += [(f"ranks disagree ({s})", f"{', '.join(map(str, d))} ≠ rank {w}")
                  for s, d, w in (("A", fd.disagree_a, fd.rank_a), ("B", fd.disagree_b, fd.rank_b))
                  if d]
    elif fd.row_rank_a is None and fd.row_rank_b is None:
        ranks = [("owning rank", f"{fd.rank_a} (run A), {fd.rank_b} (run B)")]
    else:  # an SP run: the row's shard computed it, TP/SP coordinate 0 wrote the gathered tensor
        ranks = [("owning rank", ", ".join(
                     f"{o} (run {s}{'' if r is None else ': SP rank of the first differing row'})"
                     for s, o, r in (("A", fd.owner_a, fd.row_rank_a),
                                     ("B", fd.owner_b, fd.row_rank_b)))),
                 ("written by", f"{fd.rank_a} (run A), {fd.rank_b} (run B)")]
    rows = [("kind", fd.kind), *ranks,
            ("component", fd.component), ("phase", fd.phase),
            ("step", ("before step 0 (the sigma table)" if fd.component == DEFAULT_COMPONENT else
                      "before step 0 (an early stage)") if fd.step < 0 else fd.step),
            ("sigma", "-" if fd.step < 0 else _num(fd.sigma)), ("branch", label(fd.branch))]
    if fd.kind == "op":
        rows += [("block", block_name(fd.block, fd.blocks)), ("op position", fd.op_pos),
                 ("stream", label(fd.stream)), ("op", fd.op), ("call", fd.call),
                 ("output", f"{fd.index} ({fd.role})")]
    else:
        rows += [("quantity", fd.op)]
    rows += [("sample", label(fd.sample)), ("dtype", _pair(*fd.dtype)),
             ("shape", _pair(*map(tuple, fd.shape))), ("digest", _pair(*fd.digest)),
             ("non-finite", _pair(*fd.nonfinite)),
             ("max |x|", _pair(*(_num(x) for x in fd.maxabs))),
             ("origin", "yes (every earlier record matches)" if fd.origin_kind == "record"
              else fd.origin_words())]
    if fd.rows is not None:
        first = ", ".join(map(str, fd.rows.first))
        more = "" if fd.rows.n_differ <= len(fd.rows.first) else ", ..."
        rows.append(("rows", f"{fd.rows.n_differ} of {fd.rows.n_rows} differ: {first}{more}"))
    for k, v in rows:
        t.add_row(k, str(v))
    return t


_STEP_COLUMNS = ("x_t", "v_t", "x_next", "logp_t")
"""The step quantities the per-step table shows (the worst sample and branch of each)."""


def _cell(s: StepDrift, quantity: str, attr: str) -> str:
    q = s.worst(quantity)
    if q is None:
        return ""
    if q.identical is None:
        return "missing"
    if q.identical:
        return "="
    return _num(getattr(q, attr)) + ("*" if q.note else "")


def _steps_table(report: DiffReport) -> Table:
    phases = len({s.phase for s in report.steps}) > 1
    t = Table(title="per step (worst sample and branch; '=' bitwise identical; x_t is the input)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("step", "sigma", "x_t\nmax|Δ|", "v_t\nmax|Δ|", "v_t\nrel L2", "x_next\nmax|Δ|",
                "logp_t\nmax|Δ|", "KL", "ops\n≠"):
        t.add_column(col, justify="right")
    ops = not report.counts or "ops" in report.counts  # an L0 pair holds no op records to count
    for s in report.steps:
        kls = [k.kl for k in s.kl if k.kl is not None]
        t.add_row(
            f"{s.phase} {step_name(s.step)}" if phases else step_name(s.step),
            "-" if s.step < 0 else _num(s.sigma),
            _cell(s, "x_t", "max_abs"), _cell(s, "v_t", "max_abs"), _cell(s, "v_t", "rel_l2"),
            _cell(s, "x_next", "max_abs"), _cell(s, "logp_t", "max_abs"),
            _num(max(kls)) if kls else "-",
            (str(s.ops_differ) if ops else "-") + (f"+{s.missing}?" if s.missing else ""),
            style=None if s.identical else "red",
        )
    return t


def steps_legend(steps: list[StepDrift]) -> list[str]:
    """The per-step table's legend lines for the cells that need one: a step -1 row (records
    made before the first step: the sigma table, no sigma of its own) and an ``N+M?`` ops cell
    (records in one run only). Empty when the table shows neither."""
    out = []
    if any(s.step < 0 for s in steps):
        out.append(f"step {BEFORE_STEPS}: records made before the first step (the sigma table, and "
                   "a prompt or edit run's text encoder and VAE encode; no sigma of their own)")
    if any(s.missing for s in steps):
        out.append("ops ≠ N+M?: N differing operator records, and M records (steps or "
                   "operators) that only one run holds")
    return out


def _first_ops_table(report: DiffReport) -> Table | None:
    rows = [s for s in report.steps if s.first_op is not None]
    if not rows:
        return None
    t = Table(title="first differing op per step", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False)
    for col in ("phase", "step", "x_t", "branch", "block", "stream", "op", "sample"):
        t.add_column(col, justify="left" if col in ("phase", "branch", "stream", "op") else "right")
    for s in rows:
        o = s.first_op
        t.add_row(s.phase, step_name(s.step), {None: "", True: "≠", False: "="}[s.carried_in],
                  label(o.branch), block_name(o.block, o.blocks), label(o.stream), f"{o.op}#{o.call}", label(o.sample))
    return t


def _semantic(report: DiffReport, console: Console) -> None:
    """The semantic mismatch first: its verdict line, counting what it lists, then one line per
    program difference and per unrecorded field (nothing when the runs are the same program)."""
    sem = report.semantic
    if sem is None or not sem.mismatch:
        return
    n, u = len(sem.differences), len(sem.unrecorded)
    unrecorded = f", {u} unrecorded field{'s' if u > 1 else ''}" if u else ""
    console.print(f"[bold magenta]SEMANTIC MISMATCH[/]  {n} program difference"
                  f"{'s' if n > 1 else ''}{unrecorded}: the runs are different programs", highlight=False)
    for d in sem.differences:
        console.print(f"  - {d}", highlight=False, markup=False)
    for line in sem.unrecorded:
        console.print(f"  - unrecorded: {line}", highlight=False, markup=False)


def _clip_table(report: DiffReport) -> Table:
    clip = report.clip
    phases = len({s.phase for s in clip.steps}) > 1
    t = Table(title=f"log-prob drift against the clip range {clip.clip_range:g} (common samples)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("step", "branch", "samples", "mean\n|Δlogp|", "max\n|Δlogp|",
                "max\n|exp(Δ)−1|", "of clip\nrange"):
        t.add_column(col, justify="left" if col == "branch" else "right")
    for s in clip.steps:
        t.add_row(f"{s.phase} {s.step}" if phases else str(s.step), s.branch, str(s.samples),
                  _num(s.mean_abs), _num(s.max_abs), _num(s.ratio_dev_max), percent(s.fraction),
                  style=None if s.ratio_dev_max < clip.clip_range else "red")
    return t


def render(report: DiffReport, console: Console | None = None) -> None:
    """Print ``report`` as rich tables: semantic mismatch (if any), verdict line, clip range and
    tolerance verdicts, context, first drift, per-step drift, log-prob drift against the clip
    range."""
    console = console or Console()
    _semantic(report, console)
    console.print(f"[{_STYLE[report.verdict]}]{report.verdict.value.upper()}[/]  {escape(report.reason)}",
                  highlight=False)
    console.print(f"A: {report.run_a}\nB: {report.run_b}", highlight=False, markup=False)
    if report.tolerance is not None:
        style = "bold green" if report.tolerance.ok else "bold red"
        console.print(f"[{style}]{report.tolerance.verdict.upper()}[/]  "
                      f"{escape(report.tolerance.words())}", highlight=False)
    if report.clip is not None:
        style = {"below": "bold green", "above": "bold red"}.get(report.clip.verdict, "bold yellow")
        console.print(f"[{style}]{report.clip.verdict.upper()} CLIP NOISE FLOOR[/]  "
                      f"{escape(report.clip.words(verdict=False))}", highlight=False)
    for title, lines in (("cannot align", report.incomparable), ("differences in context",
                                                                   shown_context(report.context)),
                         ("notes", report.notes)):
        if lines:
            console.print(f"[bold]{title}[/]", highlight=False)
            for line in lines:
                console.print(f"  - {line}", highlight=False, markup=False)
    if report.counts:
        console.print("records: " + "; ".join(
            f"{k} {c.matched} paired ({c.matched - c.differ} equal, {c.differ} differ), "
            f"{c.only_a} only A, {c.only_b} only B"
            for k, c in report.counts.items()), highlight=False)
    if report.first_drift is not None:
        console.print(_first_drift_table(report))
    if report.steps:
        console.print(_steps_table(report))
        shown = (s.worst(n) for s in report.steps for n in _STEP_COLUMNS)  # the cells "*" marks
        notes = sorted({f"{q.quantity}: {q.note}" for q in shown
                        if q is not None and q.note and q.identical is False})
        for note in notes:
            console.print(f"  * {note}", highlight=False, markup=False)
        for line in steps_legend(report.steps):
            console.print(f"  {line}", highlight=False, markup=False)
    ops = _first_ops_table(report)
    if ops is not None:
        console.print(ops)
    if report.clip is not None and report.clip.steps:
        console.print(_clip_table(report))
