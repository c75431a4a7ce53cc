"""The directory of one artifact writer: created, held by one writer at a time, cleared of an
earlier run, and written with atomic file replacement (``drifttool.artifact.writer``'s rank 0).

    lock = claim(Path("runs/a"), overwrite=False)    # created, locked, empty
    atomic_write(Path("runs/a/manifest.json"), b"{...}")
    release(lock)                                    # when the writer closes

One writer per directory: ``claim`` takes an exclusive ``flock`` on the directory itself before
it checks that it is empty (or removes an earlier run under ``overwrite``), and the lock is held
until ``release`` (the OS drops it when the process dies). A second run given the same
directory meanwhile fails at once with an ``ArtifactError`` that says another run holds it. An
earlier run is removed only when everything in the directory is drifttool's own
(``remove_artifact``): user files are never deleted. Without ``fcntl`` (not POSIX) there is no
lock; one writer is then the user's care.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock (one writer is then the user's care)
    fcntl = None
from pathlib import Path

from drifttool.artifact import schema as S
from drifttool.errors import ArtifactError, writing
from drifttool.fixture import sealed_above
from drifttool.launch_env import launched_ranks

LEGACY_NAMES = frozenset({"steps.arrow", "trace.arrow"})
"""Files of schema version 2 artifacts (one steps and trace file per run), removed on overwrite
like the current names."""


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: written to ``<name>.tmp``, flushed, fsync'ed, renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with writing(path), open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _writes(p: Path) -> bool:
    """``p`` is a regular file of a name some artifact writer gives (a ``.tmp`` of one too)."""
    name = p.name.removesuffix(".tmp")
    return p.is_file() and (name in {S.MANIFEST, S.INPUTS, *LEGACY_NAMES}
                            or S.RANK_FILE.fullmatch(name) is not None)


def foreign_files(path: Path) -> list[str]:
    """The names in the directory ``path`` that no artifact writer gives (a user's files, folders
    or links), sorted."""
    return sorted(p.name for p in path.iterdir() if not _writes(p))


def holds_run(path: Path) -> bool:
    """Whether the directory ``path`` holds a drifttool artifact: a ``manifest.json`` with a
    schema version and a file list (complete or not). An unreadable manifest is no run."""
    try:
        manifest = json.loads((path / S.MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "schema_version" in manifest and "files" in manifest


def run_above(path: Path) -> Path | None:
    """The nearest existing folder above ``path`` (its parents, made absolute, ``..`` folded)
    that holds a drifttool artifact (``holds_run``), else None: an output written there would
    make that run unreadable (a run directory holds only its artifact's files)."""
    absolute = Path(os.path.abspath(path))
    return next((p for p in absolute.parents if p.is_dir() and holds_run(p)), None)


IMAGE_SECTIONS = ("chain", "edit")
"""Manifest sections whose ``images`` list the PNGs a run wrote beside its directory."""


_IMAGE_NAME = re.compile(r"(?:-\d+)?\.png")
"""What follows the directory's name in the name of an image a run writes beside it
(``<out>.png``, ``<out>-<sample>.png``: ``drifttool.chain.image_paths``)."""


def run_images(path: Path) -> dict[Path, str]:
    """The images the run at ``path`` wrote beside its directory (its manifest's ``chain`` or
    ``edit`` ``images``): resolved path → recorded SHA-256; empty when it holds no run or none.
    Only paths a run at ``path`` writes count (beside it, named after it): a manifest naming
    any other file names no image of this run."""
    if not holds_run(path):
        return {}
    manifest = json.loads((path / S.MANIFEST).read_text())
    here = path.resolve()
    found = {}
    for key in IMAGE_SECTIONS:
        section = manifest.get(key)
        for rec in (section.get("images") or []) if isinstance(section, dict) else []:
            if isinstance(rec, dict) and isinstance(rec.get("path"), str) and isinstance(rec.get("sha256"), str):
                image = Path(rec["path"]).resolve()
                tail = image.name.removeprefix(here.name) if image.name.startswith(here.name) else ""
                if image.parent == here.parent and _IMAGE_NAME.fullmatch(tail):
                    found[image] = rec["sha256"]
    return found


def _remove_images(path: Path) -> None:
    """Delete the images the earlier run at ``path`` wrote beside it, each only while its bytes
    are still the recorded ones (a file the user replaced since is kept): an overwriting run
    that writes no image (a run without --prompt, a stopped one) leaves no stale one behind."""
    for image, sha in run_images(path).items():
        try:
            if image.is_file() and hashlib.sha256(image.read_bytes()).hexdigest() == sha:
                image.unlink()
        except OSError:
            pass  # not ours to fail on: the new run's own check names an image in its way


def remove_artifact(path: Path) -> None:
    """Delete an earlier artifact at ``path`` — only if everything there is drifttool's own —
    with the images it wrote beside it that still hold their recorded bytes (``_remove_images``).

    Raises:
        ArtifactError: no drifttool manifest there, or files that no artifact writes (user
            files are never deleted). A run inside a sealed fixture (its expected run) is refused
            before this, by ``claim``.
    """
    if not holds_run(path):
        raise ArtifactError(f"{path} is not empty and holds no drifttool run; refusing to "
                            "overwrite")
    foreign = foreign_files(path)
    if foreign:
        raise ArtifactError(f"{path}: refusing to overwrite: it also holds {', '.join(foreign[:5])}"
                            " (not written by drifttool)")
    _remove_images(path)
    for p in path.iterdir():
        p.unlink()


_HELD: dict[int, Path] = {}
"""The directories this process writes (``claim``'s locks, by descriptor), which it may read."""


def claim(path: Path, overwrite: bool) -> int | None:
    """Create ``path`` (and its parents), lock it, and make sure it is empty: an earlier artifact
    there is removed under ``overwrite`` (``remove_artifact``). Returns the lock's descriptor, to
    ``release`` when the writer is done (None without ``fcntl``).

    Raises:
        ArtifactError: ``path`` or a parent is a file; ``path`` is inside a sealed fixture
            (``sealed_above``: a file written there breaks its seal); another process holds the
            lock; ``path`` is not empty and not ``overwrite``, or holds what ``remove_artifact``
            refuses.
        OSError: the directory cannot be created or read (the lock is released first).
    """
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():  # the path itself or a parent
        raise ArtifactError(f"{existing} exists and is not a directory"
                            + ("" if existing == path else f" (creating {path})"))
    sealed = sealed_above(path)
    if sealed is not None:  # a run there breaks the seal; a fixture's own run is rebuilt elsewhere
        raise ArtifactError(f"{path}: inside the sealed fixture {sealed}, whose seal a run there "
                            f"would break; give a path outside it (`drifttool fixture seal {sealed} "
                            "--rebuild` re-makes its expected run)")
    path.mkdir(parents=True, exist_ok=True)
    lock = _lock(path)  # before the emptiness check: the check and the writes are one writer's
    if lock is not None:
        _HELD[lock] = path.resolve()
    try:
        if any(path.iterdir()):
            if not overwrite:
                raise ArtifactError(f"{path} is not empty (use --overwrite to replace an "
                                    "earlier drifttool run there)" if holds_run(path) else
                                    f"{path} is not empty and holds no drifttool run (choose an "
                                    "empty or new directory)")
            remove_artifact(path)
    except BaseException:
        release(lock)
        raise
    return lock


def _lock(path: Path) -> int | None:
    """An exclusive ``flock`` on the directory ``path``: its descriptor (None without ``fcntl``).

    Raises:
        ArtifactError: another process holds it.
    """
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ArtifactError(f"{path}: another drifttool run holds it (it is writing "
                            "there now); wait for it to finish or choose another -o") from None
    return fd


def release(lock: int | None) -> None:
    """Release a ``claim``'s lock (closing the descriptor releases the flock); None: nothing."""
    if lock is not None:
        _HELD.pop(lock, None)
        os.close(lock)


def being_written(path: str | os.PathLike) -> bool:
    """Whether another process holds ``path``'s writer lock (``claim``): a run writing there now,
    whose streams end mid-record and whose manifest says ``complete: false`` until it finishes.
    False without ``fcntl``, for a path that is no readable directory, for a directory this
    process writes itself, and under a multi-rank launch (``launched_ranks``: rank 0 holds the lock
    of the directories the launch writes, which its other ranks read)."""
    if fcntl is None or launched_ranks()[1] > 1:
        return False
    try:
        p = Path(path).resolve()
        if p in _HELD.values() or not p.is_dir():
            return False
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while a writer holds LOCK_EX
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # and with it the shared lock
    return False
