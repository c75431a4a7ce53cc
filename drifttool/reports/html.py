"""One self-contained HTML page for a diff: verdict, first drift, context, the per-step table
and the figures, embedded as ``data:`` URIs (no script, stylesheet, font or image is fetched).

    <h1>drifttool report</h1>
    <p class="verdict drift">DRIFT</p> <p>first drift at rollout step 0 cond before block 0 ...</p>
    <h2>First drift</h2> <table>...where, origin, op, block, step, sample, rows...</table>
    <h2>Per step</h2>   <table>phase | step | sigma | identical | first op | v_t | ... </table>
    <h2>Figures</h2>    <img alt="drift by step x block" src="data:image/png;base64,...">

``render_html(report, figures)`` returns the page; ``drifttool report A B -o report.html``
writes it.
"""

from __future__ import annotations

import base64
import html
from typing import Any, Iterable

from drifttool.artifact.schema import block_name, label, step_name

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { border: 1px solid #ccc; padding: .2em .5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, td.id { font-family: ui-monospace, monospace; white-space: nowrap; }
.verdict { display: inline-block; font-weight: bold; padding: .2em .7em; border-radius: .3em; }
.identical { background: #d9f2d9; } .drift { background: #f8d3d3; }
.incomparable, .inconclusive { background: #fbeccb; }
tr.differs td { background: #fff0f0; } img { max-width: 100%; border: 1px solid #ddd; }
"""

_FIGURES = (("heatmap", "Drift by step × block (fraction of differing operator records; the "
             "first drift boxed)"),
            ("overlay", "Per-step drift of B against A (max |Δ| of v_t, x_next, logp_t; SDE KL)"))


NO_HEATMAP = ("No drift heatmap: it counts the differing operator records of each step and block, "
              "and a run here was captured at L0, which records step boundaries only; capture both "
              "runs at L1 or L2 to get one (drifttool run --capture L1, or drifttool replay RUN "
              "--capture L1 -o OUT for a stored run).")
"""Said where the heatmap would be, for a drifting pair without operator records to count."""


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _num(x: Any) -> str:
    if x is None:
        return "–"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _table(header: Iterable[str], rows: Iterable[tuple[str, Iterable[str]]]) -> str:
    """A table: ``rows`` are (tr class, cells already escaped; a cell ``(cls, text)`` sets a td class)."""
    out = ["<table><thead><tr>", *(f"<th>{_e(h)}</th>" for h in header), "</tr></thead><tbody>"]
    for cls, cells in rows:
        out.append(f'<tr class="{cls}">' if cls else "<tr>")
        for cell in cells:
            kind, text = cell if isinstance(cell, tuple) else ("", cell)
            out.append(f'<td class="{kind}">{text}</td>' if kind else f"<td>{text}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _first_drift(report: Any) -> str:
    fd = report.first_drift
    if fd is None:
        return "<p>No record differs.</p>"
    rows = [("where", fd.where()), ("origin", fd.origin_words()), ("kind", fd.kind),
            ("phase / step", f"{fd.phase} / {step_name(fd.step)}"), ("branch", label(fd.branch)),
            ("block", "-" if fd.block is None else block_name(fd.block, fd.blocks)), ("stream", label(fd.stream)),
            ("operator", fd.op), ("sample", label(fd.sample)),
            ("dtype A / B", " / ".join(fd.dtype)), ("max |x| A / B", " / ".join(map(_num, fd.maxabs))),
            ("owning rank", fd.owning_rank())]
    if fd.rows is not None:
        first = ", ".join(str(r) for r in fd.rows.first)
        rows.append(("rows", f"{fd.rows.n_differ} of {fd.rows.n_rows} differ; first: {first}"))
    return _table(("", ""), [("", (f"<b>{_e(k)}</b>", ("id", _e(v)))) for k, v in rows])


def _steps(report: Any) -> str:
    if not report.steps:
        return "<p>No step compared.</p>"
    header = ("phase", "step", "sigma", "identical", "x_t carried in", "first differing op",
              "ops differ", "missing", "v_t max|Δ|", "x_next max|Δ|", "logp_t max|Δ|", "KL")
    rows = []
    ops = not report.counts or "ops" in report.counts  # an L0 pair holds no op records to count
    for s in report.steps:
        worst = {q: s.worst(q) for q in ("v_t", "x_next", "logp_t")}
        kl = max((k.kl for k in s.kl if k.kl is not None), default=None)
        cells = (_e(s.phase), ("num", _e(step_name(s.step))), ("num", "–" if s.step < 0 else _num(s.sigma)),
                 "yes" if s.identical else "<b>no</b>", {None: "", True: "yes", False: "no"}[s.carried_in],
                 ("id", _e(s.first_op)), ("num", _e(s.ops_differ) if ops else "–"), ("num", _e(s.missing)),
                 *(("num", _num(w.max_abs if w is not None else None)) for w in worst.values()),
                 ("num", _num(kl)))
        rows.append(("" if s.identical else "differs", cells))
    return _table(header, rows)


def _list(title: str, lines: list[str]) -> str:
    """Every line, folded under its title when there are more than ten."""
    if not lines:
        return ""
    items = "<ul>" + "".join(f"<li><code>{_e(x)}</code></li>" for x in lines) + "</ul>"
    if len(lines) <= 10:
        return f"<h3>{_e(title)}</h3>{items}"
    return f"<details><summary><b>{_e(title)}</b> ({len(lines)} lines)</summary>{items}</details>"


def render_html(report: Any, figures: dict[str, bytes] | None = None) -> str:
    """The page for a ``DiffReport`` and its figures (``reports.figures.diff_figures``: name →
    PNG bytes), as one string."""
    verdict = report.verdict.value
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>drifttool report: {_e(verdict)}</title><style>{_CSS}</style></head><body>",
        "<h1>drifttool report</h1>",
        f'<p><span class="verdict {_e(verdict)}">{_e(verdict.upper())}</span> {_e(report.reason)}</p>',
        _table(("", ""), [("", ("<b>A</b>", ("id", _e(report.run_a)))),
                          ("", ("<b>B</b>", ("id", _e(report.run_b)))),
                          ("", ("<b>level</b>", _e(f"{report.level}: {report.covers}")))]),
    ]
    if report.tolerance is not None:
        parts.append(f"<p><b>{_e(report.tolerance.verdict)}</b> {_e(report.tolerance.words())}</p>")
    semantic = getattr(report, "semantic", None)
    if semantic is not None and semantic.mismatch:
        parts.append(f'<p><span class="verdict drift">SEMANTIC MISMATCH</span> {_e(semantic.words())}</p>')
    clip = getattr(report, "clip", None)
    if clip is not None:
        parts.append(f"<p><b>clip range:</b> {_e(clip.words())}</p>")
    parts.append("<h2>First drift</h2>" + _first_drift(report))
    parts.append(_list("Cannot align", report.incomparable) + _list("Differences in context", report.context)
                 + _list("Notes", report.notes))
    if report.counts:
        parts.append("<h2>Records</h2>" + _table(
            ("table", "run A", "run B", "paired", "equal", "differ", "only A", "only B"),
            [("", (_e(k), *(("num", _e(v)) for v in (c.a, c.b, c.matched, c.matched - c.differ, c.differ,
                                                      c.only_a, c.only_b))))
             for k, c in report.counts.items()]))
    parts.append("<h2>Per step</h2>" + _steps(report))
    shown = [(k, cap) for k, cap in _FIGURES if figures and k in figures]
    unmapped = verdict == "drift" and "ops" not in report.counts  # an L0 run: no op records
    if shown or unmapped:
        parts.append("<h2>Figures</h2>")
    if unmapped:
        parts.append(f"<p>{_e(NO_HEATMAP)}</p>")
    for key, caption in shown:
        data = base64.b64encode(figures[key]).decode("ascii")
        parts.append(f'<figure><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
                     f"<figcaption>{_e(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
