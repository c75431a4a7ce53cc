"""Sealed fixtures: a model, replay inputs, settings and the expected trajectory artifact, with a
content digest over every file so that anyone can re-verify them.

    fixtures/tiny-t2i/
      fixture.json              name, description, settings (grid, steps, CFG, SDE, seed, samples…)
      transformer/              diffusers-format checkpoint (config.json + safetensors, bf16)
      prompts.safetensors       prompt embeddings [P, L, D] + lengths, negative prompt [1, Ln, D]
      expected/                 the reference artifact of a strict run with the fixture settings
      seal.json                 xxh3_128 of every other file + one content digest over them

``verify`` checks the seal (a tampered file fails before anything runs), re-runs the fixture in
strict mode and diffs the new artifact against ``expected/`` (identical, or the first drift).
Archives (``.tar``, ``.tar.gz``) are extracted with tarfile's ``data`` filter: no member may
land outside the target directory, no links out, no devices.
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash
from safetensors import SafetensorError

from drifttool.errors import FixtureError

if TYPE_CHECKING:
    import torch

DEFAULT_FIXTURE = "tiny-t2i"
SEAL = "seal.json"
SEAL_ALGORITHM = "xxh3_128"


def packaged_fixtures() -> Path:
    """The directory of fixtures shipped with drifttool (``fixtures/`` in the repo)."""
    return Path(str(resources.files("drifttool.fixtures")))


def _extract(archive: Path) -> Path:
    target = Path(tempfile.mkdtemp(prefix="drifttool-fixture-"))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(target, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise FixtureError(f"{archive}: cannot extract fixture archive safely: {e}") from None
    dirs = [p for p in target.iterdir() if p.is_dir()]
    return dirs[0] if len(dirs) == 1 and not (target / "fixture.json").exists() else target


def locate(name_or_path: str | Path) -> Path:
    """A fixture directory from a packaged name, a directory, or a .tar/.tar.gz archive.

    Raises:
        FixtureError: nothing of that name or path.
    """
    p = Path(name_or_path)
    if p.is_dir():
        return p
    if p.is_file() and tarfile.is_tarfile(p):
        return _extract(p)
    q = packaged_fixtures() / str(name_or_path)
    if q.is_dir() and str(name_or_path) not in (".", ".."):
        return q
    names = sorted(d.name for d in packaged_fixtures().iterdir() if (d / "fixture.json").exists())
    raise FixtureError(f"no fixture {str(name_or_path)!r} (a directory, an archive, or one of {names})")


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

    def prompts(self, joint_dim: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(txt [P, L, D] fp32 zero-padded, lengths [P] int64, neg [1, Ln, D], neg length).

        When ``joint_dim`` differs from the stored embeddings (an external checkpoint), seeded
        N(0, 1) embeddings of the same lengths are drawn instead (recorded by the caller).
        """
        import torch  # here, not at the top: the seal check runs without torch
        from safetensors.torch import load_file

        try:
            t = load_file(str(self.path / "prompts.safetensors"))
        except (SafetensorError, OSError) as e:
            raise FixtureError(f"{self.path}: unreadable prompts.safetensors: {e}") from None
        txt, lens, neg = t["txt"], t["txt_len"], t["neg_txt"]
        if txt.shape[-1] != joint_dim:
            g = torch.Generator().manual_seed(int(seed))
            txt = torch.randn(txt.shape[0], txt.shape[1], joint_dim, generator=g)
            txt = txt * (torch.arange(txt.shape[1])[None, :, None] < lens[:, None, None])
            neg = torch.randn(1, neg.shape[1], joint_dim, generator=g)
        return txt.float(), lens.long(), neg.float(), int(t["neg_len"].item())


def load_fixture(name_or_path: str | Path) -> Fixture:
    """Read ``fixture.json`` (does not check the seal; see ``check_seal``).

    Raises:
        FixtureError: missing or malformed fixture.json.
    """
    path = locate(name_or_path)
    try:
        meta = json.loads((path / "fixture.json").read_text())
        settings = dict(meta["settings"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FixtureError(f"{path}: missing or malformed fixture.json: {e}") from None
    return Fixture(path=path, name=str(meta.get("name", path.name)), settings=settings, meta=meta)


# ----------------------------------------------------------------------------- seal


def _files(path: Path) -> list[str]:
    return sorted(
        p.relative_to(path).as_posix()
        for p in path.rglob("*")
        if p.is_file() and p.name != SEAL and "__pycache__" not in p.parts and p.suffix != ".py"
    )


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


def seal(path: str | Path) -> str:
    """Write ``seal.json`` for the fixture at ``path``; return its content digest."""
    path = Path(path)
    files = {rel: _digest_file(path / rel) for rel in _files(path)}
    digest = content_digest(files)
    body = {"algorithm": SEAL_ALGORITHM, "content_digest": digest, "files": files}
    (path / SEAL).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return digest


def check_seal(path: str | Path) -> str:
    """Verify every file against ``seal.json``; return the content digest.

    Raises:
        FixtureError: no seal, or files changed, missing or added (all listed).
    """
    path = Path(path)
    try:
        body = json.loads((path / SEAL).read_text())
        sealed: dict[str, str] = body["files"]
        if body.get("algorithm") != SEAL_ALGORITHM:
            raise FixtureError(f"{path}: unknown seal algorithm {body.get('algorithm')!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FixtureError(f"{path}: missing or malformed {SEAL}: {e}") from None
    present = _files(path)
    problems = [f"missing {r}" for r in sorted(set(sealed) - set(present))]
    problems += [f"unsealed extra file {r}" for r in sorted(set(present) - set(sealed))]
    problems += [f"modified {r}" for r in sorted(set(sealed) & set(present)) if _digest_file(path / r) != sealed[r]]
    if content_digest(sealed) != body.get("content_digest"):
        problems.append("seal.json content_digest does not match its file list")
    if problems:
        raise FixtureError(f"{path}: seal check failed: " + "; ".join(problems))
    return body["content_digest"]
