"""The rich consoles every subcommand prints to.

On a terminal rich uses the terminal's width. When output goes to a pipe or file, rich would
assume 80 columns and cut numbers such as ``1.19e-…``; those consoles get 160 columns instead,
and a table wider than that prints at its natural width, so that a program reading the pipe
never sees an operator name or a path cut (``latent_proj_…``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

from typing import TYPE_CHECKING, Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

if TYPE_CHECKING:  # pragma: no cover
    from rich.progress import Progress, TaskID

PIPE_WIDTH = 160
_UNBOUNDED = 1 << 16
"""The width a table is measured against on a pipe: wide enough for any table's natural width."""


class _Console(Console):
    def print(self, *objects: Any, **kwargs: Any) -> None:
        """``Console.print``; on a pipe or file a table wider than the console prints at its
        natural width (its columns never shrink, so no identifier is cut)."""
        tables = [o for o in objects if isinstance(o, Table)]
        if self.is_terminal or not tables:
            return super().print(*objects, **kwargs)
        wide = self.options.update(max_width=_UNBOUNDED)
        need = max(Measurement.get(self, wide, t).maximum for t in tables)
        if need <= self.width:
            return super().print(*objects, **kwargs)
        kept = self._width
        self.width = need
        try:
            super().print(*objects, **kwargs)
        finally:
            self._width = kept

    def on_broken_pipe(self) -> None:
        """rich's default exits with status 1 (which means "drift" here) when the reader of a pipe
        goes away (``| head``); instead, drop the rest of the output and let the command exit
        with its own code."""
        silence_stdout()
        self.quiet = True


def _make(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return _Console(stderr=stderr, width=None if tty or os.environ.get("COLUMNS") else PIPE_WIDTH)


def silence_stdout() -> None:
    """After the reader of our stdout went away, send the rest to /dev/null (no second error)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError:
        pass


@contextlib.contextmanager
def tolerate_closed_stdout() -> Iterator[None]:
    """Let ``drifttool diff … | head`` keep the command's exit code when the reader closes the
    pipe early: the rest of the output goes to /dev/null."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()


console = _make()
err = _make(stderr=True)


def one_line(message: str) -> str:
    """``message`` on one line: its lines joined by "; " (by a space after a ':'), each line's
    runs of whitespace folded to one space."""
    text = ""
    for line in (" ".join(part.split()) for part in str(message).splitlines()):
        if line:
            text += line if not text else (" " if text.endswith(":") else "; ") + line
    return text


def error_line(message: str) -> None:
    """Print ``error: MESSAGE`` to stderr as one plain line (``one_line``; rich markup in paths
    is shown as typed)."""
    err.print(f"[bold red]error:[/] {escape(one_line(message))}", highlight=False, soft_wrap=True)


def progress(on: Console | None = None) -> "Progress":
    """The progress bars of ``run``, ``replay`` and ``recompute``: the checkpoint load
    (``load_task``: MiB read/total) above the steps (``step_task``: steps done/total, what one
    step runs — samples × CFG branches), each with elapsed and remaining time. Drawn on a terminal only (rich's non-interactive Progress would print an empty line on
    stdout when it stops); ``on`` replaces the console (tests)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,  # lazy: run only
                               TimeElapsedColumn, TimeRemainingColumn)

    target = on or console
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[unit]}"), TimeElapsedColumn(),
                    TextColumn("left"), TimeRemainingColumn(), console=target, transient=True,
                    disable=not target.is_interactive)


def matrix_progress(total: int, label: str, on: Console | None = None) -> "Progress":
    """The probe matrix's progress bar: ``label``, bar, ``probes done/total``, elapsed and
    remaining time, the last probe judged. Drawn on a terminal only, as ``progress``; ``on``
    replaces the console (stderr under ``--json``, tests). Advance it with ``advance(bar, r)``
    for each ``ProbeResult`` ``r``."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,  # lazy: probe only
                               TimeElapsedColumn, TimeRemainingColumn)

    target = on or console
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("probes"), TimeElapsedColumn(), TextColumn("left"),
                   TimeRemainingColumn(), TextColumn("{task.fields[last]}"), console=target,
                   transient=True, disable=not target.is_interactive)
    bar.add_task(label, total=total, last="")
    return bar


def advance(bar: "Progress", result: object) -> None:
    """Count one judged probe on a ``matrix_progress`` bar and name it."""
    task = bar.task_ids[0]
    bar.update(task, advance=1, last=f"{getattr(result, 'name', '')} {getattr(result, 'status', '')}")


def per_step(samples: int, branches: int) -> str:
    """What one denoising step runs: ``"3 samples × 2 CFG branches"``."""
    return (f"{samples} sample{'s' if samples != 1 else ''} × {branches} CFG "
            f"branch{'es' if branches != 1 else ''}")


def step_task(bar: "Progress", description: str, steps: int, samples: int, branches: int) -> "TaskID":
    """Add the task of one trajectory (``steps`` denoising steps of ``samples`` samples with
    ``branches`` CFG branches each) to a ``progress()`` bar."""
    return bar.add_task(description, total=steps, unit=f"steps · {per_step(samples, branches)}")


def load_reporter(bar: "Progress") -> Callable[[int, int], None]:
    """A ``model.checkpoint.load_progress`` callback drawing the checkpoint load on ``bar`` as
    its own task (``MiB`` read of the weights' total). Call it before ``step_task``: the load's
    line stays above the steps' and shows from the load's first report (a run given a model
    loads nothing and shows none)."""
    task = bar.add_task("load checkpoint", total=1, unit="MiB of weights", visible=False)

    def report(done: int, total: int) -> None:
        bar.update(task, total=max(1, total >> 20), completed=done >> 20, visible=True)

    return report
