"""``--checkpoint`` takes what diffusers' ``from_pretrained`` takes: a folder, or a Hugging Face
hub id resolved offline from the local cache (huggingface_hub's own layout, built here in a
temporary ``HF_HUB_CACHE`` from the sealed tiny transformer's files: ``blobs/<sha256>``,
``refs/main``, ``snapshots/<commit>/…`` symlinks). A hub id not in the cache, a file and a
pickle-only folder are each refused in one ``error:`` line, exit 2; the pickle refusal's
conversion call, run as printed, gives a folder that loads."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from drifttool.exit_codes import ExitCode
from drifttool.fixture import locate

huggingface_hub = pytest.importorskip("huggingface_hub")
hf_constants = pytest.importorskip("huggingface_hub.constants")

REPO = "drifttool-tests/tiny-qwen-image"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_cache(cache: Path, repo: str = REPO, files: dict[str, Path] | None = None) -> Path:
    """A model repo in huggingface_hub's cache layout; returns its snapshot folder."""
    files = files or {f"transformer/{p.name}": p
                      for p in sorted((locate("tiny-t2i") / "transformer").iterdir())}
    files = {"model_index.json": None, **files}
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    for rel, src in files.items():
        data = (json.dumps({"_class_name": "QwenImagePipeline",
                            "transformer": ["diffusers", "QwenImageTransformer2DModel"]}).encode()
                if src is None else src.read_bytes())
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline ``HF_HUB_CACHE`` holding ``REPO`` (read by huggingface_hub at call time)."""
    cache = tmp_path / "hf-cache"
    snap = build_cache(cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return cache, snap


def _one_line(code, out, *needles):
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == ExitCode.USAGE, out
    assert "Traceback" not in out and "internal error" not in out, out
    assert len(lines) == 1 and lines[0].startswith("error:") and "--checkpoint" in lines[0], out
    for n in needles:
        assert n in lines[0], out


def test_the_fake_cache_is_what_huggingface_hub_reads(hub_cache):
    cache, snap = hub_cache
    info = huggingface_hub.scan_cache_dir(cache)
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    assert {r.commit_hash for r in repo.revisions} == {COMMIT}
    assert {str(f.file_path.relative_to(snap)) for r in repo.revisions for f in r.files} == {
        "model_index.json", "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors"}


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache):
    from drifttool.model.checkpoint_hub import resolve_checkpoint

    _, snap = hub_cache
    assert resolve_checkpoint(REPO) == snap
    assert resolve_checkpoint(str(snap)) == snap  # a folder stays itself


def test_run_from_a_hub_id_equals_the_run_from_its_folder(cli, hub_cache, tmp_path):
    _, snap = hub_cache
    fixture_dir = locate("tiny-t2i") / "transformer"
    a, b = tmp_path / "a", tmp_path / "b"
    for out, ckpt in ((a, REPO), (b, fixture_dir)):
        code, text = cli("run", "--checkpoint", ckpt, "--steps", "2", "--capture", "L0", "-o", out)
        assert code == 0, text
    m = json.loads((a / "manifest.json").read_text())
    assert m["settings"]["checkpoint"] == str(snap.resolve())
    code, text = cli("diff", a, b)
    assert code == ExitCode.OK, text


def test_refusals_are_one_line(cli, hub_cache, tmp_path):
    cache, _ = hub_cache
    _one_line(*cli("run", "--checkpoint", "drifttool-tests/not-cached", "-o", tmp_path / "x"),
              "not in the local Hugging Face cache", str(cache), "hf download drifttool-tests/not-cached")
    _one_line(*cli("run", "--checkpoint", "not a/hub id!", "-o", tmp_path / "x"),
              "not a Hugging Face hub id")
    (tmp_path / "f").write_text("x")
    _one_line(*cli("replay", tmp_path / "run", "--checkpoint", tmp_path / "f", "-o", tmp_path / "x"),
              "a file, not a model folder")
    _one_line(*cli("run", "--checkpoint", "./missing-folder", "-o", tmp_path / "x"), "no such folder")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # the conversion and two runs (about 9 s)
def test_a_pickle_only_folder_is_refused_with_a_conversion_that_works(cli, tmp_path):
    """The folder and a hub id of it, refused before anything loads; the printed diffusers call
    writes a safetensors folder that runs identical to the original weights."""
    pytest.importorskip("diffusers")
    from diffusers import QwenImageTransformer2DModel

    src = locate("tiny-t2i") / "transformer"
    pickled = tmp_path / "tiny-bin"
    QwenImageTransformer2DModel.from_pretrained(src).save_pretrained(pickled, safe_serialization=False)
    assert sorted(p.name for p in pickled.iterdir()) == ["config.json", "diffusion_pytorch_model.bin"]
    code, out = cli("run", "--checkpoint", pickled, "-o", tmp_path / "x")
    _one_line(code, out, f"{pickled}: pickle weights only (diffusion_pytorch_model.bin)",
              "convert it once to safetensors")
    call = re.search(r'python -c "([^"]+)"', out).group(1)
    subprocess.run([sys.executable, "-c", call], check=True, timeout=300)
    converted = Path(re.search(r"and pass (\S+) \(see 'drifttool run --help'\)$", out.strip()).group(1))
    assert (converted / "diffusion_pytorch_model.safetensors").is_file()
    for out_dir, ckpt in ((tmp_path / "a", converted), (tmp_path / "b", src)):
        code, text = cli("run", "--checkpoint", ckpt, "--steps", "2", "--capture", "L0", "-o", out_dir)
        assert code == 0, text
    code, text = cli("diff", tmp_path / "a", tmp_path / "b")
    assert code == ExitCode.OK, text


def test_the_cache_is_read_from_the_environment_in_a_fresh_process(tmp_path):
    """``HF_HUB_CACHE`` as a user sets it, huggingface_hub imported fresh, offline."""
    cache = tmp_path / "hf-cache"
    snap = build_cache(cache)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    code = ("from drifttool.model.checkpoint_hub import resolve_checkpoint; "
            f"print(resolve_checkpoint({REPO!r}))")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(snap)
