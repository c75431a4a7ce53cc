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
- An output file (``report -o``, ``overlay -o``, every ``--junit``) replaces only an earlier
  file of its kind (``KINDS``: a drifttool report, a figure of the format its name gives, a
  JUnit XML report); any other existing file is refused, as a run directory is refused a user's
  folder. So is a path inside a sealed fixture (a file there would break its seal, as ``run -o``
  refuses its ``expected/``) and a place the user cannot write (a read-only folder or file),
  all before any work: a command writing two files never leaves one written and one refused.

Input paths (a run directory, a fixture directory, ``--checkpoint``) refuse an empty path too
(``input_path``). One input path has its own rule: every ``--lora`` (``run``, ``replay``, ``recompute``,
``experiment train-rollout``) is checked where it is parsed (``adapter``), with the words the
adapter reader refuses it with (``drifttool.model.lora_paths``), before any model loads.
"""

from __future__ import annotations

import os
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


def _starts_with(*marks: bytes, within: int = 0):
    """A test of a file's first bytes: one of ``marks`` at the start (``within`` 0) or in the
    first ``within`` bytes."""
    def test(head: bytes) -> bool:
        return any(head.startswith(m) if not within else m in head[:within] for m in marks)
    return test


KINDS = {
    "report": ("an earlier drifttool report", _starts_with(b"<title>drifttool report", within=512)),
    "junit": ("an earlier JUnit XML report", _starts_with(b"<testsuites", b"<testsuite ", b"<testsuite>",
                                                          within=4096)),
    ".png": ("a PNG image", _starts_with(b"\x89PNG\r\n\x1a\n")),
    ".pdf": ("a PDF document", _starts_with(b"%PDF-")),
    ".svg": ("an SVG image", _starts_with(b"<svg", within=4096)),
}
"""What an existing output file must be for ``output_file`` to replace it: kind → (its words,
a test of the file's first 4 KiB). ``figure``: the kind of the name's suffix."""


def _placed(out: Path, option: str) -> None:
    """Refuse an output path under a regular file, inside a sealed fixture or where the user
    cannot write (its nearest existing folder, or the file itself)."""
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise DriftToolError(f"{option} {out}: {above} is not a directory")
    from drifttool.fixture import SEAL  # lazy: the commands' start-up needs none of it

    sealed = next((p for p in out.resolve().parents if (p / SEAL).is_file()), None)
    if sealed is not None:
        raise DriftToolError(f"{option} {out}: inside the sealed fixture {sealed}, whose seal a new file "
                             "would break; give a path outside it")
    if not _writable(out if out.exists() else above):
        raise DriftToolError(f"{option} {out}: cannot be written here (permission denied or a read-only "
                             "file system); give another path")


def _writable(p: Path | None) -> bool:
    return p is None or os.access(p, os.W_OK | (os.X_OK if p.is_dir() else 0))


def output_file(out: Path, option: str, kind: str | None = None) -> Path:
    """Check, before any work, that ``out`` can be written as a file: not an existing folder,
    not under a regular file, not inside a sealed fixture, in a place the user can write; and,
    given ``kind`` (a key of ``KINDS``, or ``"figure"``: the kind of ``out``'s suffix), an
    existing regular file ``out`` only if it is an earlier file of that kind. Missing parent
    folders are left to the writer to create (``parent_made``,
    ``drifttool.reports.junit.write_junit``). Returns ``out``.

    Raises:
        DriftToolError: naming ``option``, ``out`` and what is in the way.
    """
    if out.is_dir():
        raise DriftToolError(f"{option} {out}: is a directory; give a file name")
    _placed(out, option)
    if kind is not None and out.is_file():  # a regular file: a device (/dev/stdout) is written as ever
        words, test = KINDS[out.suffix.lower() if kind == "figure" else kind]
        try:
            with open(out, "rb") as f:
                head = f.read(4096)
        except OSError as e:
            raise DriftToolError(f"{option} {out}: exists and cannot be read ({e.strerror})") from None
        if not test(head.lstrip()):
            raise DriftToolError(f"{option} {out}: exists and is not {words}, which alone this replaces; "
                                 "give another file name, or remove it first")
    return out


def output_dir(out: Path, option: str) -> Path:
    """Check, before any work, that ``out`` can be a folder to write into: not an existing file,
    not under one, not inside a sealed fixture, in a place the user can write. Returns ``out``.

    Raises:
        DriftToolError: naming ``option``, ``out`` and what is in the way.
    """
    if out.exists() and not out.is_dir():
        raise DriftToolError(f"{option} {out}: exists and is not a directory; give a folder")
    _placed(out, option)
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
