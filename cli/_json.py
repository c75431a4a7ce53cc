"""``--json`` for every command that reports: one JSON document on stdout and nothing else.

    $ drifttool trace runs/a --json | jq '.sites[0].op'

The document is ``drifttool.jsondata.document``: ``schema_version``, ``command``, then
the command's data (``tests/cli/test_json_shapes.py`` pins each shape). Warnings and notes stay
on stderr and are also part of the data.
"""

from __future__ import annotations

import json
from typing import Any

import typer

from drifttool.cli._console import tolerate_closed_stdout

JSON_HELP = ("Print one JSON document on stdout (schema_version and command, then the command's "
             "own keys beside them; non-finite numbers as null beside a <key>_nonfinite key) "
             "instead of tables.")


def option() -> Any:
    """The ``--json`` option of a command."""
    return typer.Option(False, "--json", help=JSON_HELP)


def emit(command: str, data: dict[str, Any]) -> None:
    """Print ``data`` as the command's JSON document (strict JSON, indent 2) on stdout."""
    from drifttool.jsondata import document  # lazy: only --json needs it

    with tolerate_closed_stdout():
        typer.echo(json.dumps(document(command, data), indent=2, allow_nan=False))
