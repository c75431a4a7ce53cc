"""The click command class of every ``drifttool`` command (``app.command(..., cls=Command)``).

    Usage: drifttool diff [OPTIONS] RUN_A RUN_B

typer (0.28) writes an argument in a usage line as ``{run_a}`` and names it ``run_a`` in a
missing-argument error; ``Command`` names each argument in capitals (its parameter name, or the
``metavar`` it declares), as the README's Commands section and click write them. In the group's
list of commands typer keeps the line breaks of a docstring's first paragraph; ``Command``
gives that list the paragraph on one line.

typer draws a help page as rich tables that fill the terminal: on one narrower than a table's
natural width rich shrinks the columns and ends what no longer fits in ``…`` (at 80 columns
``--negative-prompt-embeds`` and ``--negative-prompt`` both read ``--negative-pro…``). A page
that would be cut so prints as click's plain help instead, which wraps and cuts nothing
(``FittedHelp``).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

from typer.core import TyperCommand, TyperGroup


class FittedHelp:
    """A typer command or group whose help page is typer's rich one where it fits the terminal,
    else click's plain one (module docstring)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        if not _cut(self, ctx):
            return super().format_help(ctx, formatter)  # typer's rich page
        plain = next(c for c in type(self).__mro__ if c.__module__.startswith(("click", "typer._click")))
        return plain.format_help(self, ctx, formatter)


def _cut(command: Any, ctx: Any) -> bool:
    """Whether typer's rich help page of ``command`` cuts text (with ``…``) on this terminal:
    more ``…`` than on one wide enough for every table."""
    from typer import rich_utils

    def render(width: int | None) -> str:
        buf, saved = io.StringIO(), rich_utils.MAX_WIDTH
        rich_utils.MAX_WIDTH = width
        try:
            with contextlib.redirect_stdout(buf):
                rich_utils.rich_format_help(obj=command, ctx=ctx, markup_mode=command.rich_markup_mode)
        finally:
            rich_utils.MAX_WIDTH = saved
        return buf.getvalue()

    return render(None).count("…") > render(1 << 12).count("…")


class Command(FittedHelp, TyperCommand):
    """A ``TyperCommand`` whose arguments read ``RUN_A`` in its usage line, help and errors, and
    whose short help (the group's list) is its help's first paragraph on one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.short_help is None and self.help:
            self.short_help = " ".join(self.help.strip().split("\n\n")[0].split())
        for p in self.params:
            if p.param_type_name == "argument" and p.metavar is None:
                p.metavar = (p.name or "").upper() + ("..." if p.nargs != 1 else "")

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """typer's pieces with a required argument's braces taken off (``{RUN_A}`` → ``RUN_A``)."""
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p
                for p in super().collect_usage_pieces(ctx)]


class Group(FittedHelp, TyperGroup):
    """A command group (``fixture``, ``experiment``) whose help page fits the terminal (``FittedHelp``)."""
