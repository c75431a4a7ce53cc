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
  file of its kind that drifttool wrote (``KINDS``: a drifttool report; a drifttool figure of
  the format its name gives, which carries drifttool's mark in its metadata,
  ``drifttool.probes.plots.FIGURE_CREATOR``; a JUnit XML report whose root is drifttool's
  ``<testsuites name="drifttool">``) or an empty file; any other existing file is refused, a
  user's photo or paper of the same format or another tool's JUnit XML (pytest's) included, as
  a run directory is refused a user's folder. So is a path inside a sealed fixture (a file
  there would break its seal, as ``run -o`` refuses its ``expected/``; an output folder too,
  the fixture's own included), a place the user cannot write (a read-only folder or file) and a
  dangling link, all before any work: a command writing two files never leaves one written and
  one refused.
  A device or descriptor (``/dev/stdout``, ``/dev/null``) is written as ever.

Input paths (a run directory, a fixture directory, ``--checkpoint``) refuse an empty path too
(``input_path``). One input path has its own rule: every ``--lora`` (``run``, ``replay``, ``recompute``,
``experiment train-rollout``) is checked where it is parsed (``adapter``), with the words the
adapter reader refuses it with (``drifttool.model.lora_paths``), before any model loads.
"""

from __future__ import annotations

import os
import re
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


def _body(head: bytes) -> bytes:
    """A file's first bytes without a byte-order mark and leading white space."""
    return head.removeprefix(b"\xef\xbb\xbf").lstrip()


_PROLOG = ((b"<?xml", b"?>"), (b"<!--", b"-->"), (b"<!DOCTYPE", b">"))
"""What may come before an XML document's root element: (start, end) of each item."""

_START_TAG = re.compile(rb"""<([^\s/>!?"'=<]+)((?:\s+[^\s/>"'=<]+\s*=\s*(?:"[^"]*"|'[^']*'))*)\s*/?>""")
_ATTRIBUTE = re.compile(rb"""([^\s/>"'=<]+)\s*=\s*(?:"([^"]*)"|'([^']*)')""")


def _root(head: bytes) -> tuple[bytes, dict[bytes, bytes], bytes] | None:
    """An XML document's root start tag, from a file's first bytes: (the element's name, its
    attributes as written, the bytes after the tag); after a byte-order mark, white space and the
    prolog (declaration, comments, document type). None when no start tag comes there."""
    head = _body(head)
    while item := next(((start, end) for start, end in _PROLOG if head.startswith(start)), None):
        head = _body(head.partition(item[1])[2])
    tag = _START_TAG.match(head)
    if tag is None:
        return None
    attributes = {m[1]: m[2] if m[2] is not None else m[3] for m in _ATTRIBUTE.finditer(tag[2])}
    return tag[1], attributes, head[tag.end():]


def _junit(head: bytes) -> bool:
    """Whether a file's first bytes are those of drifttool's JUnit XML (``drifttool.reports.junit``:
    the root ``<testsuites name="drifttool" ...>``); pytest's and other tools' are not."""
    from drifttool.reports.junit import ROOT_NAME  # lazy: only --junit asks

    root = _root(head)
    return root is not None and root[0] == b"testsuites" and root[1].get(b"name") == ROOT_NAME.encode()


def _report(head: bytes) -> bool:
    """Whether a file's first bytes are those of a drifttool report (``reports.html``)."""
    head = _body(head)
    return head[:15].lower() == b"<!doctype html>" and b"<title>drifttool report" in head[:512]


def _creator() -> bytes:
    from drifttool.probes.plots import FIGURE_CREATOR  # lazy: only `overlay -o` asks, and has it loaded

    return FIGURE_CREATOR.encode()


def _png(data: bytes) -> bool:
    """A PNG whose ``tEXt`` chunk ``Software`` (before the image data) is ``FIGURE_CREATOR``: the
    chunks walked by their lengths, so bytes inside the image data never count."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return False
    mark, at = b"Software\x00" + _creator(), 8
    while at + 8 <= len(data):
        size, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
        if kind in (b"IDAT", b"IEND"):
            return False
        if kind == b"tEXt" and data[at + 8:at + 8 + size] == mark:
            return True
        at += 12 + size
    return False


def _pdf(data: bytes) -> bool:
    """A PDF whose Info dictionary (written at the end, as matplotlib does) has
    ``/Creator (FIGURE_CREATOR)``."""
    return data.startswith(b"%PDF-") and b"/Creator (" + _creator() + b")" in data[-65536:]


_SVG_CREATOR = rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>%s</dc:title>"


def _svg(data: bytes) -> bool:
    """An SVG whose root's first child is matplotlib's ``<metadata>``, naming ``FIGURE_CREATOR`` as
    its ``dc:creator``."""
    root = _root(data)
    after = _body(root[2]) if root is not None and root[0] == b"svg" else b""
    if not after.startswith(b"<metadata>"):
        return False
    metadata = after.partition(b"</metadata>")[0]
    return re.search(_SVG_CREATOR % re.escape(_creator()), metadata) is not None


HEAD = 4096
"""How much of an existing report or JUnit file ``output_file`` reads: its first 4 KiB."""

FIGURE_CAP = 64 << 20
"""How much of an existing figure ``output_file`` reads: all of it (a PDF's mark is at its end),
up to 64 MiB; a larger file is no figure of drifttool's."""

KINDS = {
    "report": ("an earlier drifttool report", _report, HEAD),
    "junit": ("an earlier drifttool JUnit report", _junit, HEAD),
    ".png": ("an earlier drifttool figure (.png)", _png, FIGURE_CAP),
    ".pdf": ("an earlier drifttool figure (.pdf)", _pdf, FIGURE_CAP),
    ".svg": ("an earlier drifttool figure (.svg)", _svg, FIGURE_CAP),
}
"""What an existing output file must be for ``output_file`` to replace it: kind → (its words,
a test of the file's bytes, how many bytes the test reads). ``figure``: the kind of the name's
suffix; a figure carries drifttool's mark (``drifttool.probes.plots.FIGURE_CREATOR``), so a
user's image of the same format is refused; a file larger than the bytes read is not a figure.
An empty file is replaced whatever its kind (a CI script's ``mktemp``)."""


def _placed(out: Path, option: str) -> None:
    """Refuse an output path under a regular file, inside a sealed fixture or where the user
    cannot write (its nearest existing folder, or the file itself)."""
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise DriftToolError(f"{option} {out}: {above} is not a directory")
    from drifttool.fixture import sealed_above  # lazy: the commands' start-up needs none of it

    sealed = sealed_above(out)
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
    if out.is_symlink() and not out.exists():
        raise DriftToolError(f"{option} {out}: a symbolic link to {os.readlink(out)}, which does not exist")
    if _device(out):  # /dev/stdout, /dev/null: written as ever, wherever the shell points them
        return out
    _placed(out, option)
    if kind is not None and out.is_file() and out.stat().st_size:
        words, test, reads = KINDS[out.suffix.lower() if kind == "figure" else kind]
        try:
            with open(out, "rb") as f:
                head = f.read(reads + 1)  # a figure's one byte more: larger than any of ours
        except OSError as e:
            raise DriftToolError(f"{option} {out}: exists and cannot be read ({e.strerror})") from None
        if (kind == "figure" and len(head) > reads) or not test(head):
            raise DriftToolError(f"{option} {out}: exists and is not {words}, which alone this replaces; "
                                 "give another file name, or remove it first")
    return out


def _device(out: Path) -> bool:
    """Whether ``out`` names a device or a descriptor (``/dev/...``, ``/proc/self/fd/...``) rather
    than a file of the user's."""
    return out.absolute().parts[1:2] in (("dev",), ("proc",))


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
