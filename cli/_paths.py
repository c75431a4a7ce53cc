"""Output paths named on the command line (``-o``/``--out``, ``--junit``, ``--workdir``,
``--localize-dir``): one rule for every command.

    out: Path = typer.Option(..., "-o", "--out", parser=_paths.path, help=...)
    _paths.output_file(out, "-o")          # before any work: a folder, or under a file → one line

- An empty path is refused where it is parsed (``path``): ``Path("")`` is the current folder,
  which the user did not name.
- A path inside an existing run directory (``drifttool.artifact.directory.run_above``) is
  refused where it is parsed: a run directory holds only its artifact's files, so a JUnit file,
  a report or a nested run there would make the run unreadable.
- Missing parent folders are created, as ``run -o`` creates its artifact directory and its
  parents (``drifttool.artifact.directory.claim``); an output file's when it is written.
- A path under a regular file, or an output file that is an existing folder, is refused in one
  line before any work (``output_file``), as ``run -o`` refuses a directory under a file.

Input paths (a run directory, a fixture directory, ``--checkpoint``) refuse an empty path too
(``input_path``). One input path has its own rule: every ``--lora`` (``run``, ``replay``, ``recompute``,
``experiment train-rollout``) is checked where it is parsed (``adapter``), with the words the
adapter reader refuses it with (``drifttool.model.lora_paths``), before any model loads.
"""

from __future__ import annotations

from pathlib import Path

import typer

from drifttool.errors import DriftToolError


def path(text: str) -> Path:
    """typer's ``parser`` for an output path option: ``text`` as a ``Path``.

    Raises:
        typer.BadParameter: ``text`` is empty, or inside an existing run directory (one
            ``error:`` line naming the option, exit 2).
    """
    if not text:
        raise typer.BadParameter("an empty path names no file or directory; give one")
    from drifttool.artifact.directory import run_above  # lazy: `--help` needs no pyarrow

    out = Path(text)
    run = run_above(out)
    if run is not None:
        raise typer.BadParameter(
            f"{text} is inside the run directory {run}, which holds only its artifact's files "
            "(diff and replay would refuse the run); write it outside the run directory")
    return out


def input_path(text: str) -> Path:
    """typer's ``parser`` for an input path (a run directory, a fixture directory): ``text`` as a
    ``Path``.

    Raises:
        typer.BadParameter: ``text`` is empty (``Path("")`` is the current folder, which the user
            did not name).
    """
    if not text.strip():
        raise typer.BadParameter("an empty path names no file or directory; give one")
    return Path(text)


def output_file(out: Path, option: str) -> Path:
    """Check, before any work, that ``out`` can be written as a file: not an existing folder,
    not under a regular file. Missing parent folders are left to the writer to create
    (``parent_made``, ``drifttool.reports.junit.write_junit``). Returns ``out``.

    Raises:
        DriftToolError: naming ``option``, ``out`` and what is in the way.
    """
    if out.is_dir():
        raise DriftToolError(f"{option} {out}: is a directory; give a file name")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise DriftToolError(f"{option} {out}: {above} is not a directory")
    return out


def output_dir(out: Path, option: str) -> Path:
    """Check, before any work, that ``out`` can be a folder to write into: not an existing file,
    not under one. Returns ``out``.

    Raises:
        DriftToolError: naming ``option``, ``out`` and what is in the way.
    """
    if out.exists() and not out.is_dir():
        raise DriftToolError(f"{option} {out}: exists and is not a directory; give a folder")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise DriftToolError(f"{option} {out}: {above} is not a directory")
    return out


def parent_made(out: Path) -> Path:
    """Create ``out``'s missing parent folders (``output_file`` checked it); returns ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def adapter(text: str) -> Path:
    """typer's ``parser`` for a ``--lora`` option: ``text`` as a ``Path``, once it names a LoRA
    adapter (``lora_paths.adapter_location``: a peft adapter folder or a ``.safetensors`` file;
    reads no file).

    Raises:
        typer.BadParameter: ``text`` is empty, or names no adapter (one ``error:`` line naming
            the path as given and what ``--lora`` takes, exit 2).
    """
    if not text:
        raise typer.BadParameter("an empty path names no LoRA adapter; give one")
    from drifttool.model.lora_paths import adapter_location  # lazy: `--help` needs none of it

    try:
        adapter_location(text)
    except DriftToolError as e:
        raise typer.BadParameter(str(e)) from None
    return Path(text)
