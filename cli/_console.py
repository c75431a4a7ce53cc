"""The rich consoles every subcommand prints to.

On a terminal rich uses the terminal's width. On a pipe or file (logs, CI, ``| grep``, ``| head``)
a program reads the output line by line, so whatever ``COLUMNS`` says:

- no line of plain text is wrapped or cut: a path, a verdict line, an operator name or a kernel
  string (``strict_linear.v2[seg8.k64.seq|exact if N*K<=65536 …]``) stays on one line;
- a table prints at its natural width (its columns never shrink, so no identifier is cut to
  ``latent_proj_…``), its title on a line of its own above it, left-aligned;
- no line ends in spaces (the padding rich adds to fill a table's width).

On a terminal too narrow for a table's values whole (each column as wide as its longest cell, or
its longest word where cells wrap at spaces) the table prints as a listing instead: a row's
first cell on a line, each other cell under it as ``  header: value``. rich would otherwise
shrink the columns and cut the values (``1.19e-…``, ``timestep_embed_m…``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:  # pragma: no cover
    from rich.progress import Progress, TaskID

PIPE_WIDTH = 160
"""The width of a console on a pipe or file: what a table is fitted into when it is narrower."""
_UNBOUNDED = 1 << 16
"""The width a table is measured against on a pipe: wide enough for any table's natural width."""
_TRAILING_SPACES = re.compile(r" +((?:\x1b\[[0-9;]*m)*)\n")
"""Spaces at the end of a line (before any closing style codes)."""


class _Console(Console):
    def print(self, *objects: Any, **kwargs: Any) -> None:
        """``Console.print``; on a pipe or file plain text is never wrapped or cut (soft wrap);
        a table's cells, title and caption are plain text (no rich markup: a kernel string's
        ``[…]`` or a path's brackets show as written); each table prints as ``_print_table``
        does (on a terminal only one whose title is wider than the table, so that the title is
        not wrapped to the table's width)."""
        pipe = not self.is_terminal
        if pipe:
            kwargs["soft_wrap"] = True
        tables = [o for o in objects if isinstance(o, Table)]
        for t in tables:  # cells and titles as written: a kernel's "[seg8.k64 …]", a path's "[x]"
            kwargs["markup"] = False
            for name in ("title", "caption"):
                if isinstance(getattr(t, name), str):
                    setattr(t, name, Text(getattr(t, name)))
        listed = [] if pipe else [t for t in tables if not _fits(self, t)]
        if not tables or not (pipe or listed or any(self._title_wider(t) for t in tables)):
            return super().print(*objects, **kwargs)
        for o in objects:
            if isinstance(o, Table) and any(o is t for t in listed):
                self._print_listing(o)
            elif isinstance(o, Table):
                self._print_table(o, pipe, **kwargs)
            else:
                super().print(o, **kwargs)

    def _print_listing(self, table: Table) -> None:
        """``table`` on a terminal too narrow for it (``_fits``): its title, then each row as its
        first column's header and cell on a line (``step 0``) and every other non-empty cell
        under it, ``  header: value`` (a table without headers: ``key: value`` a row); the
        terminal wraps a long line at its spaces, so no value is cut."""
        if table.title:
            super().print(table.title, style=table.title_style or "table.title", highlight=False)
        columns = table.columns
        for i in range(table.row_count):
            cells = [_plain(c._cells[i]) if i < len(c._cells) else "" for c in columns]
            if not table.show_header:
                super().print(Text(": ".join(x for x in cells if x)), highlight=False)
                continue
            super().print(Text(f"{_plain(columns[0].header).replace(chr(10), ' ')} {cells[0] or '-'}"),
                          highlight=False)
            for col, cell in zip(columns[1:], cells[1:]):
                if cell:
                    super().print(Text(f"  {_plain(col.header).replace(chr(10), ' ')}: {cell}"),
                                  highlight=False)
        if table.caption:
            super().print(table.caption, style=table.caption_style or "table.caption", highlight=False)

    def _title_wider(self, table: Table) -> bool:
        """Whether ``table``'s title is wider than the table (rich would wrap it)."""
        title = table.title
        if not title:
            return False
        text = self.render_str(title) if isinstance(title, str) else title
        return text.cell_len > Measurement.get(self, self.options.update(markup=False), table).maximum

    def _print_table(self, table: Table, pipe: bool, **kwargs: Any) -> None:
        """A table with its title (and caption) as lines of their own, left-aligned; on a pipe or
        file they are never wrapped, and the table prints at its natural width even where that
        is wider than the console (its columns never shrink, so no identifier is cut)."""
        title, caption = table.title, table.caption
        table.title = table.caption = None
        kwargs["soft_wrap"] = False  # the table's own layout; its cells never wrap below
        kept = self._width
        try:
            if title:
                super().print(title, style=table.title_style or "table.title", highlight=False,
                              soft_wrap=pipe)
            if pipe:
                wide = self.options.update(max_width=_UNBOUNDED, markup=False)
                self.width = max(self.width, Measurement.get(self, wide, table).maximum)
            super().print(table, **kwargs)
            if caption:
                super().print(caption, style=table.caption_style or "table.caption",
                              highlight=False, soft_wrap=pipe)
        finally:
            self._width = kept
            table.title, table.caption = title, caption

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        """rich's rendering; on a pipe or file without the spaces at the end of each line."""
        text = super()._render_buffer(buffer)
        return text if self.is_terminal else _TRAILING_SPACES.sub(r"\1\n", text)

    def on_broken_pipe(self) -> None:
        """rich's default exits with status 1 (which means "drift" here) when the reader of a pipe
        goes away (``| head``); instead, drop the rest of the output and let the command exit
        with its own code."""
        silence_stdout()
        self.quiet = True


def _plain(cell: Any) -> str:
    """A table cell's text (a ``str`` or a ``Text``; another renderable as ``str`` gives it)."""
    return cell.plain if isinstance(cell, Text) else str(cell)


def _fits(console: Console, table: Table) -> bool:
    """Whether ``table`` fits ``console``'s width without a cell cut: each column at least as
    wide as its longest cell (a ``no_wrap`` column) or its longest word (a column whose cells
    wrap at spaces), header included. A table with a column that folds its cells by design
    (``overflow="fold"``: the trace's kernels) lays itself out and is taken as it is. Sets the
    columns' ``min_width`` to those widths, so that rich, laying the table out, cuts nothing."""
    if any(c.overflow == "fold" for c in table.columns):
        return True
    for c in table.columns:
        texts = [_plain(c.header), *(_plain(x) for x in c._cells)]
        if c.no_wrap:
            need = max(Text(line).cell_len for t in texts for line in (t.splitlines() or [""]))
        else:
            need = max((Text(w).cell_len for t in texts for w in t.split()), default=0)
        c.min_width = max(c.min_width or 0, need)
    options = console.options.update(max_width=_UNBOUNDED, markup=False)
    return Measurement.get(console, options, table).minimum <= console.width


def _make(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return _Console(stderr=stderr, width=None if tty else PIPE_WIDTH)  # a pipe ignores COLUMNS


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


def notice(kind: str, line: str) -> None:
    """Print ``KIND: LINE`` to stderr (``note``, ``warning``), the line as written (no rich
    markup: a path's brackets show)."""
    err.print(f"[bold yellow]{kind}:[/] {escape(line)}", highlight=False)


def progress(on: Console | None = None) -> "Progress":
    """The progress bars of ``run``, ``replay`` and ``recompute``: the checkpoint load
    (``load_task``: MiB read/total) above the steps (``step_task``: steps done/total, what one
    step runs — samples × CFG branches), each with elapsed and remaining time. On a terminal too
    narrow for that line, the bar shrinks, then what a step runs, the elapsed time and the bar go
    (``_fitted``): the counts and the time left stay whole. Drawn on a terminal only (rich's
    non-interactive Progress would print an empty line on stdout when it stops); ``on`` replaces
    the console (tests)."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    target = on or console
    name, count, left = TextColumn("[bold]{task.description}"), MofNCompleteColumn(), TimeRemainingColumn()
    layouts = [(name, BarColumn(bar_width=width), count, TextColumn(f"{{task.fields[{unit}]}}"),
                TimeElapsedColumn(), TextColumn("left"), left)
               for unit, width in (("unit", 40), ("unit", 10), ("short", 10))]
    layouts += [(name, count, TextColumn("{task.fields[short]}"), TextColumn("left"), left), (name, count, left)]
    return _fitted(layouts)(*layouts[0], console=target, transient=True, disable=not target.is_interactive)


def matrix_progress(total: int, label: str, on: Console | None = None) -> "Progress":
    """The probe matrix's progress bar: ``label``, bar, ``probes done/total``, elapsed and
    remaining time, the last probe judged (on a narrow terminal fewer of them, as
    ``progress``). Drawn on a terminal only, as ``progress``; ``on`` replaces the console
    (stderr under ``--json``, tests). Advance it with ``advance(bar, r)`` for each
    ``ProbeResult`` ``r``."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    target = on or console
    name, count, left = TextColumn("[bold]{task.description}"), MofNCompleteColumn(), TimeRemainingColumn()
    last = TextColumn("{task.fields[last]}")
    layouts = [(name, BarColumn(bar_width=width), count, TextColumn("probes"), TimeElapsedColumn(),
                TextColumn("left"), left, last) for width in (40, 10)]
    layouts += [(name, BarColumn(bar_width=10), count, TextColumn("probes"), TextColumn("left"), left, last),
                (name, count, TextColumn("probes"), TextColumn("left"), left), (name, count, left)]
    bar = _fitted(layouts)(*layouts[0], console=target, transient=True, disable=not target.is_interactive)
    bar.add_task(label, total=total, last="")
    return bar


def _fitted(layouts: list[tuple]) -> type:
    """A rich ``Progress`` class whose lines take the first of ``layouts`` (its columns, widest
    first) that fits the console's width at each refresh, so that rich cuts no count or time
    (it would end the line in ``…``); the last layout is taken when none fits."""
    from rich.progress import Progress

    class Fitted(Progress):
        def make_tasks_table(self, tasks):
            if not hasattr(self, "live"):  # rich's __init__ renders once, before its console is set
                return super().make_tasks_table(tasks)
            for columns in layouts:
                self.columns = columns
                table = super().make_tasks_table(tasks)
                wide = self.console.options.update(max_width=_UNBOUNDED)
                if Measurement.get(self.console, wide, table).maximum <= self.console.width:
                    return table
            return table

    return Fitted


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
    return bar.add_task(description, total=steps, unit=f"steps · {per_step(samples, branches)}", short="steps")


def load_reporter(bar: "Progress") -> Callable[[int, int], None]:
    """A ``model.checkpoint.load_progress`` callback drawing the checkpoint load on ``bar`` as
    its own task (``MiB`` read of the weights' total). Call it before ``step_task``: the load's
    line stays above the steps' and shows from the load's first report (a run given a model
    loads nothing and shows none)."""
    task = bar.add_task("load checkpoint", total=1, unit="MiB of weights", short="MiB", visible=False)

    def report(done: int, total: int) -> None:  # MiB rounded up: a finished load shows N/N, never 0/1
        bar.update(task, total=max(1, -(-total >> 20)), completed=-(-done >> 20), visible=True)

    return report
