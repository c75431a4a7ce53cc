"""Helpers for the scripting tests: run a command in-process and keep stdout apart from stderr."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any


def invoke(*args: Any, env: dict | None = None):
    """``drifttool ARGS`` in-process (typer's CliRunner): the result, stdout and stderr apart."""
    from typer.testing import CliRunner

    from drifttool.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], env=env, catch_exceptions=False)


def console_script() -> str:
    """The installed ``drifttool`` console script: beside this Python (its virtual environment),
    else on ``PATH``."""
    beside = Path(sys.executable).with_name("drifttool")
    found = str(beside) if beside.is_file() else shutil.which("drifttool")
    assert found, "no drifttool console script: install the package (pip install -e .)"
    return found


def json_out(*args: Any) -> tuple[int, dict]:
    """(exit code, the one JSON document on stdout) of ``drifttool ARGS --json``."""
    res = invoke(*args, "--json")
    return res.exit_code, json.loads(res.stdout)  # stdout holds nothing else


def shape(data: Any) -> Any:
    """The shape of JSON data: a dict's keys with their values' shapes, a list's first item's
    shape, else the value's type name (``None``'s is ``"null"``)."""
    if isinstance(data, dict):
        return {k: shape(v) for k, v in data.items()}
    if isinstance(data, list):
        return [shape(data[0])] if data else []
    return "null" if data is None else type(data).__name__
