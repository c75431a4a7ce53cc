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
