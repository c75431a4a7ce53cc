"""The rich consoles every subcommand prints to.

On a terminal rich uses the terminal's width. When output goes to a pipe or file, rich would
assume 80 columns and cut numbers such as ``1.19e-…``; those consoles get 160 columns instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

PIPE_WIDTH = 160


class _Console(Console):
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


def progress(on: Console | None = None) -> Progress:
    """The step progress bar of ``run``, ``replay`` and ``recompute``: description, bar,
    ``steps done/total``, what one step runs (samples × CFG branches), elapsed and remaining
    time. Drawn on a terminal only (rich's non-interactive Progress would print an empty line on
    stdout when it stops); ``on`` replaces the console (tests)."""
    target = on or console
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("steps · {task.fields[per_step]}"), TimeElapsedColumn(),
                    TextColumn("left"), TimeRemainingColumn(), console=target, transient=True,
                    disable=not target.is_interactive)


def per_step(samples: int, branches: int) -> str:
    """What one denoising step runs: ``"3 samples × 2 CFG branches"``."""
    return (f"{samples} sample{'s' if samples != 1 else ''} × {branches} CFG "
            f"branch{'es' if branches != 1 else ''}")


def step_task(bar: Progress, description: str, steps: int, samples: int, branches: int) -> TaskID:
    """Add the task of one trajectory (``steps`` denoising steps of ``samples`` samples with
    ``branches`` CFG branches each) to a ``progress()`` bar."""
    return bar.add_task(description, total=steps, per_step=per_step(samples, branches))
