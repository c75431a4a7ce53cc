"""``drifttool trace``: the operator trace of a run (``qwenimage_operator_trace``)."""

from __future__ import annotations

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
    if as_json:  # every column as stored; the block as a number (schema.SAMPLER_BLOCK: the sampler)
        _json.emit("trace", {"run": str(run_dir), "mode": run.manifest.get("settings", {}).get("mode"),
                             "complete": run.complete, "call_sites": len(every), "fallbacks": n_fb,
                             "ranks": ranks, "sites": rows})
        return
    mode = run.manifest.get("settings", {}).get("mode")
    cols = ["rank", "device", "component", "block", "stream", "op", "call", "requested", "actual",
            "kernel", "contract", "fallback", "reason", "calls"]
    cells = [{c: S.block_name(r[c]) if c == "block" else "" if r[c] is None else shown(r[c]) for c in cols}
             for r in rows]
    fitted = console.is_terminal and len(cells) > 1
    if fitted:  # a terminal's width: what every row shares goes under the table, long cells fold
        cells, cols, shared = _fit_to_terminal(cells, cols)
    table = Table(title=f"operator trace — {run_dir} (mode {mode})")
    for col in cols:  # identifiers whole; a kernel or a reason folds onto lines of its own
        fold = col in ("kernel", "reason")
        table.add_column(col, overflow="fold", no_wrap=not fold,
                         min_width=None if fold else max([len(col), *(len(c[col]) for c in cells)]))
    for c in cells:
        table.add_row(*(c[col] for col in cols))
    if rows or not fallbacks_only:  # --fallbacks with none: the count line says it, no empty table
        console.print(table)
    if fitted and shared and rows:
        console.print("every call site: " + ", ".join(f"{col} {v or '(none)'}" for col, v in shared.items()),
                      highlight=False, markup=False)
    if fitted and "reason" not in shared:  # a terminal's width: reasons under the table, once each
        for op, reason in dict.fromkeys((c["op"], c["reason"]) for c in cells if c["reason"]):
            console.print(f"reason, {op}: {reason}", highlight=False, markup=False)
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
