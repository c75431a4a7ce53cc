"""The probe matrix as data: a rich table for people, Arrow and JSON for machines.

    probe                      factor             kind      verdict  first drift                      expected op        v_t      x_t    logp_t   KL     time  result
    latent_pack_channels_last  latent layout/...  mismatch  drift    s0 before b0 img latent_proj_gemm#0 latent_proj_gemm   0.41     0.93   0.012    3e-3   0.6s  PASS
    repeat                     repeated exec.     invariant identical                                 -                  =        =      =        =      0.5s  PASS

``write_matrix`` writes ``matrix.json`` (settings, timings, every ``ProbeResult``) and
``matrix.arrow`` (one row per probe, Arrow IPC stream, readable with
``pa.ipc.open_stream(open(path, "rb")).read_all()``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from drifttool.artifact.schema import names_one, short_block
from drifttool.diff.clip import percent
from drifttool.probes.results import (ERROR, FINDING, NOT_APPLICABLE, OBSERVED, PASS, PENDING, Matrix,
                                      ProbeResult)

MATRIX_VERSION = 3
"""2: status ``NOT APPLICABLE`` (a probe whose change is a no-op on the baseline's bytes);
3: the ``clip_*`` columns (``--clip-range``: log-prob drift against a PPO clip range)."""

STATUSES = (PASS, FINDING, ERROR, PENDING, OBSERVED, NOT_APPLICABLE)
"""Every status, in the order the counts list them."""

MATRIX_SCHEMA = pa.schema([
    pa.field("name", pa.utf8(), nullable=False),
    pa.field("factor", pa.utf8(), nullable=False),
    pa.field("kind", pa.utf8(), nullable=False),
    pa.field("change", pa.utf8(), nullable=False),
    pa.field("expected", pa.utf8(), nullable=False),
    pa.field("expected_op", pa.utf8()),
    pa.field("status", pa.utf8(), nullable=False),  # PASS | FINDING | ERROR | PENDING | OBSERVED | NOT APPLICABLE
    pa.field("verdict", pa.utf8()),
    pa.field("first_drift", pa.utf8()),
    pa.field("first_op", pa.utf8()),
    pa.field("first_step", pa.int32()),
    pa.field("first_block", pa.int32()),
    pa.field("first_stream", pa.utf8()),
    pa.field("first_branch", pa.utf8()),
    pa.field("first_sample", pa.int32()),
    pa.field("first_rows", pa.utf8()),
    pa.field("first_rank", pa.int32()),  # owning rank in the probe run (SP: the row's rank)
    pa.field("origin", pa.bool_()),
    pa.field("differing_records", pa.int64()),
    pa.field("v_t", pa.float64()),  # worst max|Δ| over steps, samples, branches
    pa.field("x_t", pa.float64()),  # x_t and x_next
    pa.field("logp_t", pa.float64()),
    pa.field("kl", pa.float64()),  # worst SDE-transition KL
    pa.field("seconds", pa.float64(), nullable=False),
    pa.field("reasons", pa.list_(pa.utf8()), nullable=False),
    pa.field("run_dir", pa.utf8()),
    pa.field("compare", pa.utf8(), nullable=False),  # all | common_samples
    pa.field("layout", pa.utf8()),  # distributed probes: "TP2", "SP2 agrs", ...
    pa.field("reference", pa.utf8()),  # the run diffed against (the baseline, or the probe's own)
    pa.field("clip_range", pa.float64()),  # --clip-range ε; null without one (clip_* null too)
    pa.field("clip_verdict", pa.utf8()),  # below | above | no logp
    pa.field("clip_ratio_dev_max", pa.float64()),  # worst step's max |exp(Δlogp_t) − 1|
    pa.field("clip_fraction", pa.float64()),  # clip_ratio_dev_max / clip_range
    pa.field("clip_max_abs", pa.float64()),  # worst step's max |Δlogp_t|
    pa.field("clip_worst", pa.utf8()),  # "rollout step 2 cfg"
], metadata={b"drifttool.table": b"probe_matrix", b"matrix_version": str(MATRIX_VERSION).encode()})


def _plain(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def matrix_data(m: Matrix) -> dict[str, Any]:
    """Settings, timings, counts per status and every result, as Python data (floats as they
    are: ``drifttool probe --json`` encodes them with ``drifttool.jsondata``)."""
    counts = {s: sum(r.status == s for r in m.results)
              for s in STATUSES}
    return {
        "matrix_version": MATRIX_VERSION, "out": m.out, "baseline": m.baseline,
        "settings": m.settings, "seconds": m.seconds, "baseline_seconds": m.baseline_seconds,
        "counts": counts, "exit_code": m.exit_code,
        "results": [dataclasses.asdict(r) for r in m.results],
    }


def to_dict(m: Matrix) -> dict[str, Any]:
    """JSON-ready ``matrix_data`` as ``matrix.json`` holds it (a non-finite float as the string
    ``"nan"``, ``"inf"`` or ``"-inf"``)."""
    return _plain(matrix_data(m))


def to_arrow(results: list[ProbeResult]) -> pa.Table:
    rows = [dataclasses.asdict(r) for r in results]
    cols = {f.name: [row[f.name] for row in rows] for f in MATRIX_SCHEMA}
    return pa.Table.from_pydict(cols, schema=MATRIX_SCHEMA)


def write_matrix(m: Matrix, out: str | Path) -> tuple[Path, Path]:
    """Write ``matrix.json`` and ``matrix.arrow`` under ``out``; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jpath, apath = out / "matrix.json", out / "matrix.arrow"
    jpath.write_text(json.dumps(to_dict(m), indent=2, allow_nan=False))
    table = to_arrow(m.results)
    with pa.OSFile(str(apath), "wb") as f, pa.ipc.new_stream(f, MATRIX_SCHEMA) as w:
        w.write_table(table)
    return jpath, apath


def read_matrix(path: str | Path) -> pa.Table:
    """The ``matrix.arrow`` table."""
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_stream(src).read_all()


# -- rendering -----------------------------------------------------------------------------------
_STATUS_STYLE = {PASS: "bold green", FINDING: "bold red", ERROR: "bold red", PENDING: "yellow",
                 OBSERVED: "cyan", NOT_APPLICABLE: "magenta"}


def _num(x: float | None, verdict: str | None) -> str:
    if x is None:
        return "-" if verdict in (None, "") else "="
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.2g}"


def _short_where(r: ProbeResult) -> str:
    if r.first_op is None:
        return ""
    blk = "" if r.first_block is None else f" {short_block(r.first_block, r.first_blocks)}"
    stream = f" {r.first_stream}" if names_one(r.first_stream) else ""
    branch = f" {r.first_branch}" if names_one(r.first_branch) else ""
    rank = "" if r.layout is None or r.first_rank is None else f" rank {r.first_rank}"
    step = "before s0" if r.first_step is not None and r.first_step < 0 else f"s{r.first_step}"
    return f"{step}{blk}{branch}{stream} {r.first_op}{rank}"


def _clip_cell(r: ProbeResult) -> "str | Text":
    """The worst step's max |exp(Δlogp_t) − 1| as a share of the clip range (``diff.clip``),
    red when it reaches it; ``=`` when logp_t is identical, ``-`` without logp_t records."""
    if r.clip_fraction is None:
        return "-"
    if r.clip_ratio_dev_max == 0:
        return "="
    text = percent(r.clip_fraction)
    return Text(text, style="red") if r.clip_verdict == "above" else text


def matrix_table(m: Matrix) -> Table:
    """The matrix as a rich table (one row per probe); a ``layout`` column after ``kind`` when
    any probe ran a parallel layout (the distributed matrix, whose first drift also names the
    owning rank)."""
    launch = m.settings.get("launch")
    where = f", every run {launch}" if launch else ""
    n = len(m.results)
    t = Table(title=f"probe matrix ({n} probe{'' if n == 1 else 's'}{where}, {m.seconds:.1f} s)",
              box=box.SIMPLE_HEAD, title_justify="left")
    right = {"justify": "right", "no_wrap": True}
    layouts = any(r.layout for r in m.results)
    clip = m.settings.get("clip_range")
    for col, kw in (("probe", {"no_wrap": True}), ("factor", {}), ("kind", {"no_wrap": True}),
                    *((("layout", {"no_wrap": True}),) if layouts else ()),
                    ("verdict", {"no_wrap": True}), ("first drift", {}), ("expected op", {}),
                    ("v_t", right), ("x_t", right), ("logp_t", right), ("KL", right),
                    *(((f"of clip\n{clip:g}", right),) if clip is not None else ()),
                    ("time", right), ("result", {"no_wrap": True})):
        t.add_column(col, **kw)
    for r in m.results:
        layout = [r.layout or "-"] if layouts else []
        t.add_row(
            r.name, r.factor, r.kind, *layout, r.verdict or "-", _short_where(r),
            r.expected_op or "-",
            _num(r.v_t, r.verdict), _num(r.x_t, r.verdict), _num(r.logp_t, r.verdict),
            _num(r.kl, r.verdict), *([_clip_cell(r)] if clip is not None else []),
            f"{r.seconds:.1f}s",
            Text(r.status, style=_STATUS_STYLE[r.status]),  # styled text: cells are not markup
        )
    return t


def render_matrix(m: Matrix, console: Console) -> None:
    """The table, then each finding with its reasons, then one summary line."""
    console.print(matrix_table(m))
    for r in m.results:
        if r.status in (FINDING, ERROR):
            console.print(f"[bold red]{r.status}[/] {r.name} ({r.factor}): expected {r.expected}",
                          highlight=False)
            for why in r.reasons:
                console.print(f"  - {why}", highlight=False, soft_wrap=True)
        elif r.status == PENDING and m.settings.get("launch"):  # refused by the launch's layout
            console.print(f"{PENDING} {r.name}: " + "; ".join(r.reasons), highlight=False,
                          soft_wrap=True, markup=False)
        elif r.status == NOT_APPLICABLE:  # the change moved no byte: say why, never a pass
            console.print(f"{NOT_APPLICABLE} {r.name} ({r.factor}): " + "; ".join(r.reasons),
                          highlight=False, soft_wrap=True, markup=False)
    counts = {s: sum(r.status == s for r in m.results)
              for s in STATUSES}
    pending = [r.name for r in m.results if r.status == PENDING]
    line = ", ".join(f"{n} {s.lower()}" for s, n in counts.items() if n)
    console.print(f"{line}; baseline {m.baseline_seconds:.1f} s, total {m.seconds:.1f} s"
                  + (f"; pending: {', '.join(pending)}" if pending else ""), highlight=False)
