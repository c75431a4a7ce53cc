"""Registers the training-side commands on the ``drifttool`` app (called from ``cli/app.py``):
``replay``, ``recompute`` and the ``experiment`` group (``train-rollout``, ``grpo``)."""

from __future__ import annotations

from typing import Any, Callable

import typer


def register(app: typer.Typer, user_errors: Callable[..., Any]) -> None:
    from drifttool.cli import experiment, replay

    app.command("replay")(user_errors(replay.replay))
    app.command("recompute")(user_errors(replay.recompute))
    app.add_typer(experiment.app, name="experiment")
