"""Rich rendering of a ``LocalizeResult`` (``drifttool diff --localize``), printed under the diff.

    localize: step 1 re-executed at L2
    │ status          │ localized                                                          │
    │ step            │ 1 (step 1 is the first differing step; its x_t matches in both runs) │
    │ first drift     │ rollout step 1 cond before block 0 timestep_embed_mlp#0 sample 0 ... │
    │ block / branch  │ before 0 / cond                                                     │
    │ rows            │ 1 of 24 differ: img (0, 1)                                          │
    │ reproduced      │ A yes, B yes (the stored step records of both runs)                 │
    │ time            │ 2.76 s (model load 1.02 s, shared; steps A 0.18 s, B 0.17 s)        │
    │ L2 pair of runs │ ≈ 10.1 s (estimate, not measured: ...)                              │

``result.to_dict()`` is the machine form (``--json`` puts it under ``"localize"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from drifttool.artifact.schema import block_name, label

if TYPE_CHECKING:  # pragma: no cover
    from drifttool.training.localize import LocalizeResult

_STYLE = {"localized": "bold red", "already_localized": "bold red", "unconfirmed": "bold yellow",
          "no_drift_in_reexecution": "bold yellow", "before_transformer": "bold yellow",
          "after_transformer": "bold yellow",
          "nothing_to_localize": "bold green"}


def _seconds(result: "LocalizeResult") -> str:
    if not result.step_seconds:
        return f"{result.seconds:.2f} s (nothing re-executed)"
    load = (f"model load {result.load_seconds['A']:.2f} s, shared" if result.shared_model else
            f"model loads A {result.load_seconds['A']:.2f} s, B {result.load_seconds['B']:.2f} s")
    return (f"{result.seconds:.2f} s ({load}; steps A {result.step_seconds['A']:.2f} s, "
            f"B {result.step_seconds['B']:.2f} s; the rest: reading and diffing)")


def localize_rows(result: "LocalizeResult") -> list[tuple[str, str]]:
    """The (field, value) rows of the localize table, in order."""
    rows = [("status", result.status.replace("_", " ")), ("reason", result.reason)]
    if result.boundary and result.step is not None:  # else the reason says it
        rows.append(("earlier drift", result.boundary))
    if result.step is not None:
        rows.append(("step", f"{result.step} ({result.why_step})"))
    fd = result.first_drift
    if fd is not None:
        rows.append(("first drift", fd.where()))
        if fd.kind == "op":
            out = "" if fd.index == 0 else f" out{fd.index}"
            rows += [("operator", f"{fd.op}#{fd.call}{out} ({fd.role})"),
                     ("block / branch", f"{block_name(fd.block, fd.blocks)} / {label(fd.branch)}"
                                        + ("" if label(fd.stream) == "-" else f" (stream {label(fd.stream)})"))]
        else:
            rows.append(("quantity", f"{fd.op} ({label(fd.branch)})"))
        rows.append(("sample", label(fd.sample)))
        if fd.rows is not None:
            more = "" if fd.rows.n_differ <= len(fd.rows.first) else ", ..."
            rows.append(("rows", f"{fd.rows.n_differ} of {fd.rows.n_rows} differ: "
                                 + ", ".join(map(str, fd.rows.first)) + more))
    if result.reproduced:
        words = ", ".join(f"{s} {'yes' if ok else 'no'}" for s, ok in result.reproduced.items())
        bad = [f"{s}: {'; '.join(m[:3])}" for s, m in result.mismatches.items() if m]
        rows.append(("reproduced", f"{words} (the stored step records)" +
                     (f"; differing: {' | '.join(bad)}" if bad else "")))
    if result.reexecuted:
        rows.append(("artifacts", ", ".join(result.artifacts) if result.artifacts else
                     "temporary, removed (keep them with --localize-dir DIR)"))
    rows.append(("time", _seconds(result)))
    if result.estimate_l2_pair_seconds is not None:
        rows.append(("L2 pair of runs", f"≈ {result.estimate_l2_pair_seconds:.2f} s "
                                         f"({result.estimate_basis})"))
    return rows


def render_localize(result: "LocalizeResult", console: Console | None = None) -> None:
    """Print ``result`` as one table, titled with the step and level re-executed."""
    console = console or Console()
    title = (f"localize: step {result.step} re-executed at {result.level}"
             if result.reexecuted else "localize")
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("field", style="bold")
    t.add_column("value")
    for k, v in localize_rows(result):
        t.add_row(k, Text(v, style=_STYLE.get(result.status, "") if k == "status" else ""))
    console.print(t)
