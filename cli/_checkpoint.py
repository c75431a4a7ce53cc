"""``--checkpoint``: a model folder or a Hugging Face hub id, resolved as the command line is read.

    drifttool run --checkpoint Qwen-Image -o runs/a          # a transformer or pipeline folder
    drifttool run --checkpoint Qwen/Qwen-Image -o runs/a     # its snapshot in the local HF cache

The value means what diffusers' ``from_pretrained`` takes (``drifttool.model.checkpoint_hub.
resolve_checkpoint``: an existing folder, else a hub id found in the local cache, offline); the
command receives the folder. A hub id not in the cache, a file, a folder that is no model folder
or whose transformer holds pickle weights only: one ``error:`` line naming the option, exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from drifttool.cli._paths import input_path  # an empty --checkpoint names no model

FORMS = ("a diffusers transformer folder, a pipeline folder (model_index.json + transformer/), "
         "or a Hugging Face hub id in the local cache (e.g. Qwen/Qwen-Image)")
"""What ``--checkpoint`` takes, in every command's help."""


def _resolve(value: Optional[Path]) -> Optional[Path]:
    if value is None:
        return None
    from drifttool.errors import CheckpointError  # lazy: with the resolver, only when given
    from drifttool.model.checkpoint_hub import resolve_checkpoint  # lazy: torch, only when given

    try:
        return resolve_checkpoint(str(value))
    except CheckpointError as e:
        raise typer.BadParameter(str(e), param_hint="--checkpoint") from None


def option(help: str) -> Any:
    """The ``--checkpoint`` option of a command: ``help`` says what it replaces, ``FORMS`` what
    it takes."""
    return typer.Option(None, "--checkpoint", help=f"{help} Model: {FORMS}.", parser=input_path,
                        callback=_resolve)
