"""Sealed fixtures: a model, replay inputs, settings and the expected trajectory artifact, with a
content digest over every file so that anyone can re-verify them.

    fixtures/tiny-t2i/
      fixture.json              name, description, settings (grid, steps, CFG, SDE, seed, samples…)
      transformer/              diffusers-format checkpoint (config.json + safetensors, bf16)
      prompts.safetensors       prompt embeddings [P, L, D] + lengths, negative prompt [1, Ln, D]
      expected/                 the reference artifact of a strict run with the fixture settings
      seal.json                 xxh3_128 and size of every other file + one content digest

A chain fixture (``tiny-t2i-chain``: ``fixture.json`` has ``chain`` with the prompts) is also a
pipeline folder (``model_index.json``, ``scheduler/``, ``tokenizer/``, ``text_encoder/``,
``vae/``, as ``QwenImagePipeline.from_pretrained`` loads it; no ``prompts.safetensors``); so is
an edit fixture (``tiny-edit``: ``edit`` names its condition images and its prompts,
``Fixture.edit``), whose text encoder holds the vision tower and whose ``processor/`` makes it a
whole ``QwenImageEditPipeline`` folder, the images beside. Both keep the image their expected run decoded (``expected.png``). ``drifttool.verify``
tells the kinds apart and re-runs each.

``verify`` checks the seal (a tampered file fails before anything runs), re-runs the fixture in
strict mode and diffs the new artifact against ``expected/`` (identical, or the first drift).
The seal covers regular files only: a symlink (even to identical bytes), a FIFO, a device or
a socket anywhere inside a fixture fails the seal check and is refused by ``seal``. Sizes are
compared before any file is hashed, and an archive member whose declared size differs from its
seal's is refused before anything is extracted (a sparse member declaring gigabytes of zeros
costs nothing).
Archives (``.tar``, ``.tar.gz``) are opened with ``extracted`` into a temporary directory that is
removed afterwards, on success and on failure: only regular files and directories are accepted
(no links, no devices), and tarfile's ``data`` filter keeps every member inside the target.

This module imports torch only inside ``Fixture.prompts``: the seal check runs without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import stat
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import xxhash

from drifttool.errors import FixtureError
from drifttool.fixture_prompts import read_prompts

if TYPE_CHECKING:
    import torch

DEFAULT_FIXTURE = "tiny-t2i"
SEAL = "seal.json"
SEAL_ALGORITHM = "xxh3_128"
FIXTURE_KEYS = ("name", "description", "settings", "chain", "edit")
"""The keys of a ``fixture.json`` (``settings`` required; ``chain`` for a chain fixture, ``edit``
for an edit fixture)."""
ANY_CASE = {"mode": str.lower, "capture": str.upper, "dtype": str.lower, "cfg_layout": str.lower,
            "timestep_policy": str.lower, "preset": str.lower}
"""The settings a ``fixture.json`` may name in any case, as their flags take them (``--capture
l2`` is ``L2``, ``--dtype BFloat16`` is ``bfloat16``, ``--preset Diffusers-Edit`` is
``diffusers-edit``), each with its canonical spelling."""
_SEAL_MAX_BYTES = 16 << 20
"""A seal.json read from an archive before extraction is at most this large (else it is left to
``check_seal`` after extraction)."""


def sealed_above(path: str | Path) -> Path | None:
    """The sealed fixture that holds ``path``: the nearest folder at or above it (``path``
    resolved, links followed, ``..`` folded) with a ``seal.json``, else None. A file written or
    removed anywhere inside one would break its seal (``check_seal``)."""
    resolved = Path(path).resolve()
    return next((p for p in (resolved, *resolved.parents) if (p / SEAL).is_file()), None)


def packaged_fixtures() -> Path:
    """The directory of fixtures shipped with drifttool (``fixtures/`` in the repo)."""
    return Path(str(resources.files("drifttool.fixtures")))


def _extract(archive: Path, target: Path) -> Path:
    """Extract ``archive`` into the empty directory ``target``; return the fixture directory in it
    (``target`` itself, or its single top-level folder).

    Raises:
        FixtureError: unreadable or truncated archive; a member that is not a regular file or
            directory (symlink, hard link, device, FIFO) or would land outside ``target``; no
            ``fixture.json`` in what it holds.
    """
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            odd = [m.name for m in members if not (m.isfile() or m.isdir())]
            if odd:
                raise FixtureError(f"{archive}: fixture archive holds links or special files, "
                                   f"which are refused: {', '.join(odd[:5])}")
            _check_member_sizes(archive, tar, members)
            tar.extractall(target, members=members, filter="data")
    except tarfile.ReadError as e:  # every compression tried: name the last (plain tar) reason
        reason = str(e).rsplit("ReadError(", 1)[-1].strip("')") if "method tar" in str(e) else str(e)
        raise FixtureError(f"{archive}: not a fixture directory or a readable .tar/.tar.gz "
                           f"archive ({reason})") from None
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise FixtureError(f"{archive}: not a readable fixture archive (truncated or corrupt?): "
                           f"{e}") from None
    dirs = [p for p in target.iterdir() if p.is_dir()]
    found = dirs[0] if len(dirs) == 1 and not (target / "fixture.json").exists() else target
    if not (found / "fixture.json").is_file():  # named by the archive, not the temporary folder
        raise FixtureError(f"{archive}: not a fixture archive (no fixture.json at its top or in its "
                           "one top-level folder)")
    return found


def _check_member_sizes(archive: Path, tar: tarfile.TarFile, members: list) -> None:
    """Refuse, before anything is extracted or hashed, a member whose declared size differs from
    the size its archive's own ``seal.json`` records for that file (a sealed file replaced by
    another, e.g. a sparse member declaring gigabytes of zeros). Seals without ``sizes`` (older
    ones) and unreadable seals are left to ``check_seal``.

    Raises:
        FixtureError: naming the first members whose sizes differ.
    """
    seals = [m for m in members if m.isfile() and PurePosixPath(m.name).name == SEAL
             and len(PurePosixPath(m.name).parts) <= 2 and m.size <= _SEAL_MAX_BYTES]
    if len(seals) != 1:
        return
    top = PurePosixPath(seals[0].name).parent
    try:
        sizes = json.loads(tar.extractfile(seals[0]).read()).get("sizes")
    except (ValueError, AttributeError, OSError, tarfile.TarError):
        return
    if not isinstance(sizes, dict):
        return
    bad = []
    for m in members:
        rel = PurePosixPath(m.name)
        if m.isfile() and (top == PurePosixPath(".") or top in rel.parents):
            want = sizes.get(rel.relative_to(top).as_posix())
            if isinstance(want, int) and m.size != want:
                bad.append(f"{rel.relative_to(top).as_posix()} ({m.size} bytes, sealed {want})")
    if bad:
        raise FixtureError(f"{archive}: seal check failed before extraction: size differs for "
                           + ", ".join(bad[:5]))


def _named(name_or_path: str | Path) -> str | Path:
    """``name_or_path``, unless it is empty (``Path("")`` is the current folder, which nobody named).

    Raises:
        FixtureError: an empty name.
    """
    if not str(name_or_path).strip():
        raise FixtureError("an empty fixture name names no fixture; give one (e.g. tiny-t2i) or a "
                           "fixture directory")
    return name_or_path


@contextlib.contextmanager
def extracted(name_or_path: str | Path) -> Iterator[Path]:
    """The fixture directory of a packaged name, a directory or a ``.tar``/``.tar.gz`` archive.

    An archive is extracted into a fresh directory under ``$TMPDIR`` that is removed when the
    block exits, normally or by an exception.

    Raises:
        FixtureError: as ``locate``, or an archive that cannot be extracted safely (``_extract``).
    """
    p = Path(_named(name_or_path))
    if not p.is_file():
        yield locate(p)
        return
    with tempfile.TemporaryDirectory(prefix="drifttool-fixture-") as tmp:
        yield _extract(p, Path(tmp))


def locate(name_or_path: str | Path) -> Path:
    """A fixture directory from a packaged name or a directory (archives: ``extracted``).

    Raises:
        FixtureError: nothing of that name or path, or a file (an archive needs ``extracted``).
    """
    p = Path(_named(name_or_path))
    if p.is_dir():
        return p
    if p.exists():
        raise FixtureError(f"{p}: not a fixture directory (an archive is verified with "
                           "`drifttool fixture verify ARCHIVE`)")
    q = packaged_fixtures() / str(name_or_path)
    if q.is_dir() and str(name_or_path) not in (".", ".."):
        return q
    names = sorted(d.name for d in packaged_fixtures().iterdir() if (d / "fixture.json").exists())
    raise FixtureError(f"no fixture {str(name_or_path)!r} (a directory, an archive, or one of {', '.join(names)})")


@dataclass
class Fixture:
    """A loaded fixture (files are read lazily)."""

    path: Path
    name: str
    settings: dict[str, Any]
    meta: dict[str, Any]

    @property
    def model_dir(self) -> Path:
        return self.path / "transformer"

    @property
    def expected_dir(self) -> Path:
        return self.path / "expected"

    @property
    def edit(self) -> dict[str, Any] | None:
        """The ``edit`` section of an edit fixture, checked; None for another kind.

        Keys: ``condition_images`` (files of the fixture), optionally ``vae_image_area`` (the
        resize's pixel area), ``prompts`` and ``negative_prompts`` (texts the run encodes with the
        images when it is given no prompts) and ``prompt_positions`` (the rule of their vision
        tokens' positions, a name ``drifttool.text_encoder.encode_prompts`` takes).

        Raises:
            FixtureError: a malformed entry, naming it.
        """
        edit = self.meta.get("edit")
        if edit is None:
            return None
        keys = ("condition_images", "vae_image_area", "prompts", "negative_prompts", "prompt_positions")
        unknown = sorted(set(edit) - set(keys)) if isinstance(edit, dict) else []
        if unknown:
            raise FixtureError(f"{self.path / 'fixture.json'}: unknown key edit.{unknown[0]} (one of "
                               f"{', '.join(keys)})")
        images = edit.get("condition_images") if isinstance(edit, dict) else None
        if not is_text_list(images) or any(Path(p).is_absolute() or ".." in Path(p).parts for p in images):
            raise FixtureError(f"{self.path}: fixture.json 'edit' needs 'condition_images' (files "
                               "inside the fixture)")
        area = edit.get("vae_image_area")
        if area is not None and (isinstance(area, bool) or not isinstance(area, int) or area < 1):
            raise FixtureError(f"{self.path}: fixture.json 'edit' 'vae_image_area' must be a positive integer")
        for key in ("prompts", "negative_prompts"):
            if key in edit and not is_text_list(edit[key]):
                raise FixtureError(f"{self.path}: fixture.json 'edit' '{key}' must be a list of texts")
        if "negative_prompts" in edit and "prompts" not in edit:
            raise FixtureError(f"{self.path}: fixture.json 'edit' has 'negative_prompts' without 'prompts'")
        if not isinstance(edit.get("prompt_positions", ""), str):
            raise FixtureError(f"{self.path}: fixture.json 'edit' 'prompt_positions' must be a name")
        return edit

    def prompts(self, joint_dim: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(txt [P, L, D] fp32 zero-padded, lengths [P] int64, neg [1, Ln, D], neg length).

        When ``joint_dim`` differs from the stored embeddings (an external checkpoint), seeded
        N(0, 1) embeddings of the same lengths are drawn instead (recorded by the caller).

        Raises:
            FixtureError: no ``prompts.safetensors`` (a chain or edit fixture's prompts are texts,
                encoded by its pipeline's text encoder), or one that is not a fixture's prompt
                embeddings (``fixture_prompts.read_prompts``).
        """
        import torch  # here, not at the top: the seal check runs without torch

        if not (self.path / "prompts.safetensors").exists():
            raise FixtureError(f"{self.path}: no prompt embeddings (prompts.safetensors); its prompts are "
                               "texts its pipeline encodes (`drifttool run --prompt`, or --image for an "
                               "edit fixture), or give --prompt-embeds")
        t = read_prompts(self.path / "prompts.safetensors")
        txt, neg = (torch.from_numpy(t[k].astype(np.float32)) for k in ("txt", "neg_txt"))
        lens = torch.from_numpy(t["txt_len"].astype(np.int64))
        if txt.shape[-1] != joint_dim:
            g = torch.Generator().manual_seed(int(seed))
            txt = torch.randn(txt.shape[0], txt.shape[1], joint_dim, generator=g)
            txt = txt * (torch.arange(txt.shape[1])[None, :, None] < lens[:, None, None])
            neg = torch.randn(1, neg.shape[1], joint_dim, generator=g)
        return txt, lens, neg, int(t["neg_len"])


def is_text_list(v: Any) -> bool:
    """A non-empty list of strings."""
    return isinstance(v, list) and bool(v) and all(isinstance(s, str) for s in v)


def load_fixture(name_or_path: str | Path) -> Fixture:
    """Read ``fixture.json`` (does not check the seal; see ``check_seal``). The settings' names
    of a mode, capture level, dtype, CFG layout, timestep policy or preset are read in any case and kept
    in their canonical spelling (``ANY_CASE``), as the expected artifact's manifest records them.

    Raises:
        FixtureError: missing or malformed fixture.json: not a JSON object, no ``settings``
            object, a key other than ``FIXTURE_KEYS``, a ``name`` or ``description`` not a string
            (the settings' own values: ``drifttool.fixture_settings.check_fixture_settings``).
    """
    path = locate(name_or_path)
    if not (path / "fixture.json").is_file():
        raise FixtureError(f"{path}: not a fixture (no fixture.json)")
    twice: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        twice.extend(sorted({k for k in keys if keys.count(k) > 1}))
        return dict(items)

    try:
        meta = json.loads((path / "fixture.json").read_text(), object_pairs_hook=pairs)
    except OSError as e:
        raise FixtureError(f"{path / 'fixture.json'}: unreadable ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep
        raise FixtureError(f"{path / 'fixture.json'}: not JSON ({' '.join(str(e).split())[:200]})") from None
    if twice:  # JSON keeps the last of them, silently
        raise FixtureError(f"{path / 'fixture.json'}: key {', '.join(map(repr, twice))} given more than once")
    if not isinstance(meta, dict) or not isinstance(meta.get("settings"), dict):
        raise FixtureError(f"{path / 'fixture.json'}: not a fixture's description (a JSON object "
                           f"with a 'settings' object)")
    unknown = sorted(set(meta) - set(FIXTURE_KEYS))
    if unknown:
        raise FixtureError(f"{path / 'fixture.json'}: unknown key {', '.join(map(repr, unknown))} "
                           f"(one of {', '.join(FIXTURE_KEYS)})")
    for key in ("name", "description"):
        if not isinstance(meta.get(key, ""), str):
            raise FixtureError(f"{path / 'fixture.json'}: its '{key}' is not a string")
    if "name" in meta and not meta["name"].strip():
        raise FixtureError(f"{path / 'fixture.json'}: its 'name' is empty")
    settings = {k: ANY_CASE[k](v) if k in ANY_CASE and isinstance(v, str) else v  # canonical, once
                for k, v in meta["settings"].items()}
    return Fixture(path=path, name=meta.get("name", path.name), settings=settings, meta=meta)


# ----------------------------------------------------------------------------- seal


def _files(path: Path) -> list[str]:
    """Sealed files under ``path`` (relative POSIX paths, sorted): every regular file except
    ``seal.json``, ``*.py`` and ``__pycache__/`` (a packaged fixture folder holds its build script).

    Raises:
        FixtureError: a symlink or a special file (FIFO, device, socket) anywhere under ``path``;
            the seal covers regular files only.
    """
    files, odd = [], []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in [*dirs, *names]:
            p = Path(root, name)
            mode = p.lstat().st_mode
            rel = p.relative_to(path).as_posix()
            if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                odd.append(rel)
            elif stat.S_ISREG(mode) and name != SEAL and p.suffix != ".py":
                files.append(rel)
    if odd:
        raise FixtureError(f"{path}: the seal covers regular files only; refusing symlinks or "
                           f"special files: {', '.join(sorted(odd)[:5])}")
    return sorted(files)


def _digest_file(p: Path) -> str:
    h = xxhash.xxh3_128()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def content_digest(files: dict[str, str]) -> str:
    """xxh3_128 over ``path\\0digest\\n`` lines in sorted path order."""
    h = xxhash.xxh3_128()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()


def check_sealable(path: Path) -> None:
    """Raise unless ``path`` is a directory with a regular ``fixture.json``.

    Raises:
        FixtureError: not a directory, or no fixture.json (a run directory, say, which a seal
            would break).
    """
    if not path.exists():
        raise FixtureError(f"{path}: no such directory")
    if not path.is_dir():
        raise FixtureError(f"{path}: not a fixture directory")
    if not (path / "fixture.json").is_file() or (path / "fixture.json").is_symlink():
        raise FixtureError(f"{path}: not a fixture directory (no fixture.json); nothing written")


def seal(path: str | Path) -> str:
    """Write ``seal.json`` for the fixture at ``path``; return its content digest.

    Raises:
        FixtureError: ``path`` is not a fixture directory (no regular ``fixture.json``: a run
            directory, say, which a seal would break), or holds a symlink or a special file
            (``_files``).
    """
    path = Path(path)
    check_sealable(path)
    present = _files(path)
    files = {rel: _digest_file(path / rel) for rel in present}
    digest = content_digest(files)
    sizes = {rel: (path / rel).stat().st_size for rel in present}
    body = {"algorithm": SEAL_ALGORITHM, "content_digest": digest, "files": files, "sizes": sizes}
    (path / SEAL).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return digest


def reseal_command(path: str | Path) -> str:
    """The ``drifttool fixture seal PATH --rebuild`` that re-runs and re-seals the fixture at
    ``path`` (quoted for a shell where it needs to be)."""
    return f"drifttool fixture seal {shlex.quote(str(path))} --rebuild"


def check_seal(path: str | Path, *, advice: Callable[[], str] | None = None) -> str:
    """Verify every file against ``seal.json``; return the content digest.

    ``advice`` says what to do about a fixture whose files were edited (changed, missing or
    added): it is called only then, and its words end that failure's line. By default they name
    the ``reseal_command`` that re-seals it (``drifttool.verify.reseal_advice`` also says when
    that command would refuse the fixture as it is).

    Raises:
        FixtureError: no seal, or files changed, missing or added (all listed), or a symlink or
            special file inside the fixture (``_files``).
    """
    path = Path(path)
    present = _files(path)  # first: refuses a FIFO before anything is opened
    if "fixture.json" not in present:
        raise FixtureError(f"{path}: not a fixture (no fixture.json)")
    if not (path / SEAL).is_file():
        raise FixtureError(f"{path}: not a sealed fixture (no {SEAL}; `drifttool fixture seal` writes one)")
    try:
        body = json.loads((path / SEAL).read_text())
        sealed: dict[str, str] = body["files"]
        if body.get("algorithm") != SEAL_ALGORITHM:
            raise FixtureError(f"{path}: unknown seal algorithm {body.get('algorithm')!r}")
        if not (isinstance(sealed, dict) and all(isinstance(v, str) for v in sealed.values())
                and isinstance(body.get("content_digest"), str)):
            raise ValueError("'files' must map paths to digests, 'content_digest' a string")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise FixtureError(f"{path}: missing or malformed {SEAL}: {type(e).__name__}: "
                           f"{' '.join(str(e).split())[:200]}") from None
    problems = [f"missing {r}" for r in sorted(set(sealed) - set(present))]
    problems += [f"unsealed extra file {r}" for r in sorted(set(present) - set(sealed))]
    sizes = body.get("sizes") if isinstance(body.get("sizes"), dict) else {}
    common = sorted(set(sealed) & set(present))
    resized = {r for r in common if isinstance(sizes.get(r), int)
               and (path / r).stat().st_size != sizes[r]}  # compared first: nothing hashed
    problems += [f"modified {r} (size {(path / r).stat().st_size} bytes, sealed {sizes[r]})"
                 for r in common if r in resized]
    problems += [f"modified {r}" for r in common
                 if r not in resized and _digest_file(path / r) != sealed[r]]
    if content_digest(sealed) != body.get("content_digest"):
        problems.append("seal.json content_digest does not match its file list")
    if problems:
        words = advice() if advice is not None else f"if edited on purpose, `{reseal_command(path)}` re-seals it"
        raise FixtureError(f"{path}: seal check failed: " + "; ".join(problems) + "; " + words)
    return body["content_digest"]
