"""The click command class of every ``drifttool`` command (``app.command(..., cls=Command)``).

    Usage: drifttool diff [OPTIONS] RUN_A RUN_B

typer (0.28) writes an argument in a usage line as ``{run_a}`` and names it ``run_a`` in a
missing-argument error; ``Command`` names each argument in capitals (its parameter name, or the
``metavar`` it declares), as the README's Commands section and click write them. In the group's
list of commands typer keeps the line breaks of a docstring's first paragraph; ``Command``
gives that list the paragraph on one line.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand


class Command(TyperCommand):
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
