"""``drifttool probe``: the probe matrix (mismatch probes, invariant and sensitivity controls),
the distributed group (``--distributed``) and the peer matrix (``--peer``).

    drifttool probe -o probes/
    torchrun --standalone --nproc-per-node 2 -m drifttool probe --tp 2 -o probes-tp2/

Under torchrun the probe matrix runs in the launch's layout (``--tp/--sp/--sp-attention/
--cfg-parallel``, checked against the baseline before any rank starts, ``cli._layout``; without
them sample-parallel): every run of the matrix on every rank, rank 0 judging and reporting
(``probes.runner.run_matrix``). The distributed group and the peer matrix run in one process.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.table import Table

from drifttool.cli import _checkpoint, _completion, _json, _layout, _paths
from drifttool.cli._console import advance, console, err, matrix_progress
from drifttool.cli._errors import alike_on_every_rank
from drifttool.errors import DriftToolError


PRESETS = {"tiny": "tiny-t2i"}
MODES = {"strict": "strict", "auto": "production"}
"""``--mode``: the baseline's runtime mode → the backend family whose expectations are judged."""


def probe(
    out: Optional[Path] = typer.Option(None, "-o", "--out", parser=_paths.path,
                                       help="Output directory (runs, diffs, "
                                       "matrix, heatmaps); required unless --list."),
    only: Optional[str] = typer.Option(None, help="Comma-separated probe names to run."),
    preset: Optional[str] = typer.Option(None, help="Baseline preset: tiny (the embedded default)."),
    checkpoint: Optional[Path] = _checkpoint.option("Replaces the preset's model."),
    list_only: bool = typer.Option(False, "--list", help="Print the probe catalog and exit."),
    heatmaps: bool = typer.Option(True, help="Draw a step x block heatmap per drifting probe."),
    overwrite: bool = typer.Option(False, help="Replace an earlier probe matrix in OUT."),
    peer: Optional[str] = typer.Option(None, help="Run the peer matrix against another "
                                       "implementation instead: diffusers (its "
                                       "QwenImageTransformer2DModel, docs/probes.md)."),
    device: Optional[str] = typer.Option(None, autocompletion=_completion.devices, help="cpu (default) | cuda | cuda:N: where every "
                                         "run of the matrix runs (strict on CUDA: the Triton family, its backward for the training controls)."),
    height: Optional[int] = typer.Option(None, help="Image height in pixels, a multiple of 16 "
                                         "(default: the preset's grid)."),
    width: Optional[int] = typer.Option(None, help="Image width in pixels, a multiple of 16."),
    distributed: bool = typer.Option(False, "--distributed", help="Run the distributed probes "
                                     "instead: planted TP/SP/CFG-parallel faults and layout "
                                     "controls, each layout on spawned gloo CPU ranks against "
                                     "one process (docs/probes.md)."),
    tp: int = _layout.tp_option(),
    sp: int = _layout.sp_option(),
    sp_attention: Optional[str] = _layout.sp_attention_option(),
    cfg_parallel: int = _layout.cfg_parallel_option(),
    mode: str = typer.Option("strict", help="strict (default): the strict matrix | auto: the "
                             "production family's matrix of the suspects users report, each "
                             "with its production expectation on --device (docs/probes.md)."),
    clip_range: Optional[float] = typer.Option(
        None, "--clip-range", metavar="EPS",
        help="Also report each probe's log-prob drift against a PPO clip range (e.g. 1e-4), as "
             "`drifttool diff --clip-range` does: the worst step's max |exp(Δlogp_t) − 1| as a "
             "share of EPS, below or above the clip noise floor (a column, and clip_* fields in "
             "matrix.json, matrix.arrow and --json). Statuses and the exit code are unchanged."),
    as_json: bool = _json.option(),
    junit: Optional[Path] = typer.Option(
        None, "--junit", metavar="FILE", parser=_paths.path,
        help="Also write the matrix as JUnit XML (one test case per probe; a finding fails with "
             "its reasons and first drift) for CI."),
) -> None:
    """Run the baseline and every probe, diff each against the baseline, judge the expectation.

    Prints the matrix (a progress bar with probes done/total and the time left while it runs),
    writes OUT/matrix.arrow and OUT/matrix.json, and OUT/heatmaps/<probe>.png for each drifting
    probe; --junit FILE also writes JUnit XML. Exit 0 when every expectation holds (pending probes
    are listed), 1 when any probe is a finding (a failed expectation or an error), 2 on a usage
    error.
    With --mode auto the baseline runs the production family and the matrix is the suspects
    users report, each judged on its production expectation for --device (PENDING where none is
    declared). With --clip-range EPS each probe's log-prob drift is also reported against EPS.
    With --peer diffusers the matrix is the peer matrix (``drifttool.probes.peer``): the same
    outputs and exit codes; OBSERVED probes are reported, never judged. With --distributed the
    matrix is the distributed group (``drifttool.probes.distributed``): the same outputs, plus
    each probe's layout and the first drift's owning rank. Under torchrun every run of the
    matrix runs in the launch's layout (--tp/--sp/--cfg-parallel, or sample-parallel); a probe
    the layout refuses is PENDING with the refusal.
    """
    from drifttool.distributed import launch_env  # lazy: keeps torch out of `drifttool --help`
    from drifttool.probes.catalog import catalog, distributed_catalog  # lazy: likewise
    from drifttool.probes.runner import baseline_settings  # lazy: likewise
    from drifttool.probes.spec import select  # lazy: likewise
    from drifttool.setting_checks import device_type  # lazy: likewise
    from drifttool.settings import RunSpec, resolve  # lazy: likewise

    if not console.is_terminal:  # logs and CI: one line per probe rather than a squeezed table
        console.width = max(console.width, 200)
    launch = launch_env()
    with alike_on_every_rank():  # the command line and the files it names: one line for the launch
        dims = _layout.layout_dims(tp, sp, sp_attention, cfg_parallel)
        if (launch is not None or dims.parallel) and (distributed or peer is not None):
            why = ("its layouts spawn ranks of their own" if distributed
                   else "it runs another implementation, diffusers'")
            raise DriftToolError(f"--{'distributed' if distributed else 'peer'} runs in one process "
                                 f"({why}): launch it without torchrun and --tp/--sp/--cfg-parallel")
        if distributed and peer is not None:
            raise DriftToolError("give --peer or --distributed, not both")
        if distributed and device not in (None, "cpu", "CPU"):
            raise DriftToolError(f"--distributed runs its layouts on gloo CPU ranks; --device {device} "
                                 "is not supported there")
        mode = mode.lower() if isinstance(mode, str) else mode  # any case, as run's --mode
        if mode not in MODES:
            raise DriftToolError(f"unknown --mode {mode!r} (one of {', '.join(MODES)})")
        if mode != "strict" and (distributed or peer is not None):
            raise DriftToolError(f"--mode {mode} runs the production matrix; --peer and "
                                 "--distributed take no --mode")
        if clip_range is not None:
            from drifttool.diff.clip import check_clip_range  # lazy: keeps torch out of `--help`

            check_clip_range(clip_range)
        if junit is not None:
            _paths.output_file(junit, "--junit", "junit")
            if out is not None and junit.resolve() == out.resolve():
                raise DriftToolError(f"--junit {junit}: is the -o/--out folder the matrix writes; "
                                     "give a file name")
        report = _Report(heatmaps=heatmaps, as_json=as_json, junit=junit)
        if preset is not None and preset.lower() in PRESETS:  # in any case, as --mode
            preset = preset.lower()
        if peer is not None:
            return _peer(peer, out=out, only=only, preset=preset, checkpoint=checkpoint, device=device,
                         grid=(height, width), list_only=list_only, report=report,
                         overwrite=overwrite, clip_range=clip_range)
        if preset is not None and preset not in PRESETS:
            raise DriftToolError(f"unknown preset {preset!r} (one of {', '.join(sorted(PRESETS))})")
        if preset is not None and checkpoint is not None:
            raise DriftToolError("give --preset or --checkpoint, not both")
        base = RunSpec(fixture=PRESETS[preset or "tiny"], checkpoint=checkpoint, mode=mode,
                       device=device or "cpu", height=height, width=width)
        if list_only:  # runs nothing: the catalog for --device's type, also on a machine without it
            dev = device_type(base.device)
            settings, depth, _ = baseline_settings(dataclasses.replace(base, device="cpu"))
            settings["device"] = base.device
        else:
            settings, depth, _ = baseline_settings(base)
            dev = resolve(base)[1].device.split(":")[0]
        if distributed:
            probes = distributed_catalog(settings, depth)
        else:
            probes = catalog(settings, depth, family=MODES[mode], device=dev)
        probes = select(probes, only)
        if list_only:
            if (launch is None or launch.rank == 0) and as_json:
                _json.emit("probe list", {"probes": [_listed(p, distributed) for p in probes]})
            elif launch is None or launch.rank == 0:
                heads = ("probe", "kind", *(("layout",) if distributed else ()), "factor", "expected", "pending")
                console.print(_catalog_table(heads, [
                    (p.name, p.kind, *((p.layout,) if distributed else ()), p.factor, p.expect.describe(),
                     p.pending or "") for p in probes]))
            return
        if out is None:
            raise DriftToolError("give -o/--out: the directory for the runs, diffs and matrix "
                                 "(only --list runs without one)")
        _check_out(out, overwrite)
        if dims.sp > 1 and dims.sp_attention == "ring":
            raise DriftToolError(
                "--sp-attention ring cannot run the probe matrix: its baseline captures L2 (the "
                "attention internals and row digests the expectations are judged on), which a ring "
                "rank never holds; use --sp-attention agrs or ulysses")
        _layout.check_layout(dims, **_layout.settings_layout(*resolve(base)))
        _layout.check_launch(dims, launch, "probe")
    if launch is None:
        _clear_out(out)
        report(_matrix(probes, out, base, quiet=as_json, clip_range=clip_range), out)
    else:
        _launched(dims, probes, out, base, report, clip_range)


def _catalog_table(heads: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    """``probe --list``: a probe a row; its name, kind and layout never wrapped, its factor and
    expectation at their spaces (a terminal too narrow for them whole: a listing, ``_console``);
    a column empty in every row is left out."""
    keep = [i for i in range(len(heads)) if any(r[i] for r in rows)] or list(range(len(heads)))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for i in keep:
        table.add_column(heads[i], no_wrap=heads[i] in ("probe", "kind", "layout"))
    for r in rows:
        table.add_row(*(r[i] for i in keep))
    return table


def _listed(p, distributed: bool) -> dict:
    """One catalog entry for ``--list --json``."""
    return {"name": p.name, "kind": p.kind, "factor": p.factor, "expected": p.expect.describe(),
            "pending": p.pending or None, "layout": p.layout if distributed else None}


def _matrix(probes, out: Path, base, *, quiet: bool = False, **where):
    """The probe matrix with a progress bar (probes done/total, time left, the last probe
    judged); on stderr when ``quiet`` (``--json``)."""
    from drifttool.probes.runner import run_matrix  # lazy: keeps torch out of `drifttool --help`

    with matrix_progress(len(probes), "probe matrix", err if quiet else None) as bar:
        return run_matrix(probes, out, base=base, on_result=lambda r: advance(bar, r), **where)


def _launched(dims, probes, out: Path, base, report: "_Report", clip_range=None) -> None:
    """The matrix on torchrun's ranks, in ``dims`` (sample-parallel when it is one process):
    rank 0 clears OUT while the others wait, every rank runs the matrix, rank 0 reports."""
    from drifttool.distributed import close_distributed  # lazy: keeps torch out of `drifttool --help`
    from drifttool.collectives import barrier  # lazy: likewise
    from drifttool.probes.runner import run_matrix  # lazy: likewise

    dist = _layout.start(dims, base.device)
    try:
        if dist.rank == 0:
            _clear_out(out)
        barrier()
        where = dict(dist=dist, parallel=dims if dims.parallel else None, clip_range=clip_range)
        matrix = _matrix(probes, out, base, quiet=report.as_json, **where) if dist.rank == 0 else \
            run_matrix(probes, out, base=base, **where)
    finally:
        close_distributed(dist)
    if dist.rank == 0:
        report(matrix, out)


def _peer(name: str, *, out: Path | None, only: str | None, preset: str | None,
          checkpoint: Path | None, device: str | None, grid: tuple, list_only: bool,
          report: "_Report", overwrite: bool, clip_range: float | None = None) -> None:
    """``drifttool probe --peer NAME``: the peer matrix (``drifttool.probes.peer``)."""
    from drifttool.probes import peer as P  # lazy: keeps torch out of `drifttool --help`
    from drifttool.probes import peer_catalog as PC  # lazy: likewise

    if name not in PC.PEERS:
        raise DriftToolError(f"unknown peer {name!r} (one of {', '.join(PC.PEERS)})")
    if preset not in (None, "tiny") or (preset is not None and checkpoint is not None):
        raise DriftToolError("--peer runs the tiny fixture's transformer or --checkpoint DIR")
    probes = PC.select(PC.peer_catalog(), only)
    if list_only and report.as_json:
        _json.emit("probe list", {"probes": [_listed(p, False) for p in probes]})
        return
    if list_only:
        console.print(_catalog_table(("probe", "kind", "factor", "cuda", "cpu"), [
            (p.name, p.kind, p.factor, *(p.expect[d].describe() if d in p.expect
                                         else f"pending ({p.pending.get(d, 'none declared')})"
                                         for d in ("cuda", "cpu"))) for p in probes]))
        return
    if out is None:
        raise DriftToolError("give -o/--out: the directory for the runs, diffs and matrix "
                             "(only --list runs without one)")
    img_grid = P.pixel_grid(*grid)
    dev = P.check_device(device)
    _check_out(out, overwrite)
    _clear_out(out)
    transformer = P.load_peer(checkpoint, device=dev)
    with tempfile.TemporaryDirectory(prefix="drifttool-peer-") as tmp, \
            matrix_progress(len(probes), "peer matrix", err if report.as_json else None) as bar:
        fixture = None if img_grid is None else P.grid_fixture(Path(tmp) / "fixture", img_grid)
        matrix = P.run_peer_matrix(
            probes, out, transformer=transformer, device=dev,
            base=P.peer_baseline(checkpoint=checkpoint, fixture=fixture),
            on_result=lambda r: advance(bar, r), clip_range=clip_range)
    report(matrix, out)


@dataclasses.dataclass(frozen=True)
class _Report:
    """How a finished matrix is reported: heatmaps, ``--json``, ``--junit FILE``."""

    heatmaps: bool
    as_json: bool
    junit: Optional[Path]

    def __call__(self, matrix, out: Path) -> None:
        """Print the matrix (or its JSON document), write OUT/matrix.arrow and .json (and the
        heatmaps, the JUnit XML), exit with its code."""
        from drifttool.probes.matrix import matrix_data, render_matrix, write_matrix  # lazy: torch

        if not self.as_json:
            render_matrix(matrix, console)
        jpath, apath = write_matrix(matrix, out)
        drawn = _heatmaps(matrix, out) if self.heatmaps else []
        if self.junit is not None:
            from drifttool.reports.junit import probe_suite, write_junit  # lazy: only --junit

            write_junit([probe_suite(matrix)], self.junit)
        if self.as_json:
            _json.emit("probe", {**matrix_data(matrix), "files": {
                "matrix_json": str(jpath), "matrix_arrow": str(apath),
                "heatmaps": [str(p) for p in drawn],
                "junit": None if self.junit is None else str(self.junit)}})
        else:
            console.print(f"wrote {apath}, {jpath}" + (f", {len(drawn)} heatmap{'' if len(drawn) == 1 else 's'} in {out / 'heatmaps'}"
                                                       if drawn else ""), highlight=False)
        raise typer.Exit(matrix.exit_code)


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty OUT unless it holds an earlier probe matrix and --overwrite is given
    (read only: every rank of a launch checks alike); and an OUT that no folder can be
    (``_paths.output_dir``: a file, under one, inside a sealed fixture, not writable)."""
    _paths.output_dir(out, "-o")
    if not out.exists() or not any(out.iterdir()):
        return
    if not (out / "matrix.json").exists():
        raise DriftToolError(f"{out} is not empty and holds no probe matrix; choose another -o")
    if not overwrite:
        raise DriftToolError(f"{out} holds an earlier probe matrix (use --overwrite to replace it)")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in _MATRIX_FILES)
    if foreign:
        raise DriftToolError(f"{out}: refusing to overwrite: it also holds {', '.join(foreign[:5])}")


_MATRIX_FILES = ("runs", "diffs", "work", "heatmaps", "matrix.json", "matrix.arrow")
"""What a probe matrix writes in OUT (and ``--overwrite`` removes)."""


def _clear_out(out: Path) -> None:
    """Remove what an earlier probe matrix wrote in OUT (``_check_out`` allowed it)."""
    if not out.is_dir():
        return
    for name in ("runs", "diffs", "work", "heatmaps"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("matrix.json", "matrix.arrow"):
        (out / name).unlink(missing_ok=True)


def _heatmaps(matrix, out: Path) -> list[Path]:
    from drifttool.probes.plots import drift_grid, heatmap  # lazy: keeps torch out of `drifttool --help`
    from drifttool.probes.runner import open_pair  # lazy: likewise

    paths = []
    for r in matrix.results:
        if r.verdict != "drift" or r.run_dir is None:
            continue
        title = f"{r.name} ({r.kind}, {r.status}): first drift {r.first_op or '-'}"
        grid = drift_grid(*open_pair(r.reference or matrix.baseline, r.run_dir, r.compare))
        paths.append(heatmap(grid, out / "heatmaps" / f"{r.name}.png", title=title))
    return paths
