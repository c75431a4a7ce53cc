"""``drifttool trace``: the operator trace of a run (``qwenimage_operator_trace``)."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from rich.table import Table

from drifttool.cli import _json, _paths
from drifttool.cli._console import console, err
from drifttool.cli._summary import shown


def trace(
    run_dir: Path = typer.Argument(..., parser=_paths.input_path, help="Artifact directory."),
    fallbacks_only: bool = typer.Option(False, "--fallbacks", help="Show only call sites that fell back."),
    as_json: bool = _json.option(),
) -> None:
    """Show every call site of every rank: rank, device, component, block, stream, op,
    requested and actual backend, kernel, contract, fallback (sites in program order: blocks
    before, in and after the model, then the sampler)."""
    from drifttool.artifact import schema as S  # lazy: `drifttool --help` needs no pyarrow
    from drifttool.artifact.reader import open_run  # lazy: likewise

    run = open_run(run_dir)
    run.check()  # every file read and checked, as diff does: a damaged rank file is refused
    every = run.trace_rows()
    if not (run.manifest.get("files") or {}).get("trace"):
        # a run writes its trace when it ends: none means it never got there
        from drifttool.errors import ArtifactError  # lazy: likewise

        state = ("the run is incomplete (complete: false; stopped before it wrote its trace)"
                 if not run.complete else "the run wrote none")
        raise ArtifactError(f"{run_dir}: no operator trace: {state}")
    last = 1 << 30

    def order(r: dict) -> tuple:
        block = last if r["block"] == S.SAMPLER_BLOCK else r["block"]
        return (r["rank"], r["component"], block, r["stream"], r["op"], r["call"])

    rows = sorted(every, key=order)
    if fallbacks_only:
        rows = [r for r in rows if r["fallback"]]
    n_fb = sum(1 for r in every if r["fallback"])
    ranks = sorted({r["rank"] for r in every})
    if as_json:  # every column as stored; the block as a number (schema.SAMPLER_BLOCK: the sampler;
        # blocks[component]: the model's block count, the block of its records after the last block)
        counts = {c: S.model_blocks(run.manifest, c) for c in sorted({r["component"] for r in every})}
        _json.emit("trace", {"run": str(run_dir), "mode": run.manifest.get("settings", {}).get("mode"),
                             "complete": run.complete, "call_sites": len(every), "fallbacks": n_fb,
                             "ranks": ranks, "blocks": {c: n for c, n in counts.items() if n is not None},
                             "sites": rows})
        return
    mode = run.manifest.get("settings", {}).get("mode")
    cols = ["rank", "device", "component", "block", "stream", "op", "call", "requested", "actual",
            "kernel", "contract", "fallback", "reason", "calls"]
    blocks = {c: S.model_blocks(run.manifest, c) for c in {r["component"] for r in rows}}  # after the last
    cells = [{c: S.block_name(r[c], blocks[r["component"]]) if c == "block" else S.label(r[c]) if c == "stream"
              else "" if r[c] is None else shown(r[c]) for c in cols}
             | {"site": S.short_site(r["block"], r["stream"], r["op"], r["call"], blocks[r["component"]])}
             for r in rows]
    fitted = console.is_terminal and len(cells) > 1
    widths: dict[str, int] = {}
    kernels: list[str] = []
    listed = False  # a terminal too narrow for the table's columns whole-worded: one entry per site
    if fitted:  # a terminal's width: what every row shares goes under the table, long cells fold
        cells, cols, shared = _fit_to_terminal(cells, cols)
        widths, kernels = _column_widths(cells, cols, console.width)
        if kernels:
            cols = [c for c in cols if c != "kernel"]
        listed = _table_width(widths, cols) > console.width
    title = f"operator trace — {run_dir} (mode {mode})"
    if listed and rows:
        console.print(_fold(title, console.width), highlight=False, markup=False)
        for c in cells:
            _print_site(c, cols, console.width)
    table = Table(title=title)
    for col in cols:  # identifiers whole; a kernel or a reason folds onto lines of its own
        fold = col in ("kernel", "reason")  # (on a terminal any cell after a space or punctuation)
        table.add_column(col, overflow="fold", no_wrap=not fold, width=widths.get(col),
                         min_width=None if fold else max([len(col), *(len(c[col]) for c in cells)]))
    for c in cells:
        table.add_row(*(_fold(c[col], widths[col]) if col in widths else c[col] for col in cols))
    if (rows or not fallbacks_only) and not listed:  # --fallbacks with none: the count line says it
        console.print(table)
    under: list[str] = []  # a terminal's width: lines under the table, folded as its cells are
    if fitted and shared and rows:
        under.append("every call site: " + ", ".join(f"{col} {v or '(none)'}" for col, v in shared.items()))
    under += kernels
    if fitted and "reason" not in shared:  # reasons under the table, once each
        reasons = dict.fromkeys((c["op"], c["reason"]) for c in cells if c["reason"])
        under += [f"reason, {op}: {reason}" for op, reason in reasons]
    for line in under:
        console.print(_fold(line, console.width), highlight=False, markup=False)
    per = f" on {len(ranks)} ranks" if len(ranks) > 1 else ""
    console.print(f"{len(every)} call sites{per}, {n_fb} with fallback")
    if not run.complete:
        err.print("[bold yellow]note:[/] the run is incomplete (complete: false): its trace covers "
                  "the steps it ran", highlight=False)


def _fit_to_terminal(cells: list[dict[str, str]], cols: list[str]) -> tuple[list[dict[str, str]], list[str], dict[str, str]]:
    """The trace's table for a terminal's width: a column whose cell is the same in every row
    leaves the table for a line below it (``rank 0, device cpu, …``), the reasons are listed
    under it once per operator, and a contract that is the row's operator's own
    (``qwenimage.<op>.v2``) shows as its version (``v2``).

    Returns the rows' cells, the columns kept and the shared cells (column → value)."""
    shared = {c: cells[0][c] for c in cols if c not in ("op", "kernel") and len({r[c] for r in cells}) == 1}
    kept = [c for c in cols if c not in shared and c != "reason"]
    if "contract" in kept:
        for r in cells:
            own = f"qwenimage.{r['op']}."
            if r["contract"].startswith(own):
                r["contract"] = r["contract"][len(own):]
    return cells, kept, shared


_BREAK = " /,_.+|:;=*[(-"
"""Characters a terminal's cell or line may break after (never inside a word)."""
_PIECES = re.compile(f"(?<=[{re.escape(_BREAK)}])(?![{re.escape(_BREAK)}])")


def _pieces(text: str) -> list[str]:
    """``text`` cut after each run of ``_BREAK`` characters: ``strict_linear.v2`` → ``strict_``,
    ``linear.``, ``v2``."""
    return [p for p in _PIECES.split(text) if p]


def _least(text: str) -> int:
    """The narrowest width ``text`` folds into without cutting a word: its longest piece."""
    return max((len(p.rstrip()) for p in _pieces(text)), default=0)


def _fold(text: str, width: int) -> str:
    """``text`` on lines of at most ``width`` characters (joined by newlines), broken after a
    space or punctuation (``_BREAK``), spaces at a break dropped; a piece wider than ``width``
    is cut (only where nothing else fits)."""
    lines, line = [], ""
    for piece in _pieces(text):
        if line and len(line + piece.rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        line += piece
        while len(line.rstrip()) > width:
            lines.append(line[:width])
            line = line[width:]
    return "\n".join([*lines, line.rstrip()])


def _table_width(widths: dict[str, int], cols: list[str]) -> int:
    """The terminal columns a table of ``cols`` at ``widths`` takes: its cells, a space of
    padding each side of each, and the borders between and around them."""
    return sum(widths[c] for c in cols) + 3 * len(cols) + 1


def _print_site(cells: dict[str, str], cols: list[str], width: int) -> None:
    """One call site where the table cannot fit the terminal: its site (``b0 img
    adaln_modulation#1``) on a line of its own, then its other columns (``contract v2, calls
    4``) indented by two, each line folded as ``_fold`` folds (never inside a word)."""
    rest = ", ".join(f"{col} {cells[col]}" for col in cols
                     if col not in ("block", "stream", "op", "call") and cells[col])
    site = [""]  # broken at its spaces first: an operator name folds only wider than the line
    for word in cells["site"].split(" "):
        site[-1:] = [f"{site[-1]} {word}"] if site[-1] and len(site[-1]) + 1 + len(word) <= width \
            else [site[-1], word] if site[-1] else [word]
    console.print("\n".join(_fold(line, width) for line in site), highlight=False, markup=False)
    if rest:
        console.print("\n".join("  " + line for line in _fold(rest, width - 2).splitlines()),
                      highlight=False, markup=False)


def _column_widths(cells: list[dict[str, str]], cols: list[str], width: int) -> tuple[dict[str, int], list[str]]:
    """Column widths that fit the table into ``width`` terminal columns where they can: the
    kernel column folds, only after a space or punctuation (``_fold``), as narrow as its longest
    piece; where the other columns leave it less than that, the kernels leave the table for
    lines under it (``kernel, <op>: …``, or per call site for an operator of several kernels).
    Every other column keeps its cells whole (an operator name folded over two lines reads as
    two names): a table still wider than ``width`` prints as a listing (the caller).

    Returns the widths (column → characters, without padding) and the kernel lines (empty
    while the kernels stay in the table)."""
    natural = {c: max(len(c), *(len(r[c]) for r in cells)) for c in cols}
    least_kernel = max(len("kernel"), *(_least(r["kernel"]) for r in cells)) if "kernel" in cols else 0

    def room(kept: list[str]) -> int:  # what the columns leave of the width (padding: a space each side)
        return width - 3 * len(kept) - 1 - sum(natural[c] for c in kept)

    if "kernel" in cols and room(cols) + natural["kernel"] >= least_kernel:
        return {**natural, "kernel": min(natural["kernel"], room(cols) + natural["kernel"])}, []
    widths = dict(natural)  # identifiers (operators, blocks, contracts) whole: too wide, a listing
    if "kernel" not in cols:
        return widths, []
    per_op: dict[str, set[str]] = {}
    for r in cells:
        per_op.setdefault(r["op"], set()).add(r["kernel"])
    lines = [f"kernel, {r['op']}: {r['kernel']}" if len(per_op[r["op"]]) == 1 else
             f"kernel, {'' if 'rank' not in cols else 'rank ' + r['rank'] + ' '}{r['site']}: {r['kernel']}"
             for r in cells]
    return widths, list(dict.fromkeys(lines))
