"""The wheel holds what a user needs: every package of the source tree under its installed name,
every fixture file the seal lists, the references' data, and no developer tooling; installed
into a fresh venv, its packages import and the packaged fixture's seal holds.

The wheel is built offline (``pip wheel --no-deps --no-build-isolation``) from a copy of the
source tree, so that a stale ``build/`` of the checkout cannot leak into it. About 5-10 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import drifttool

ROOT = Path(__file__).resolve().parents[1]
# installed name -> folder of the source tree (setup.py's ROOTS)
ROOTS = {"drifttool": "drifttool", "drifttool.cli": "cli", "drifttool.probes": "probes",
         "drifttool.references": "references", "drifttool.fixtures": "fixtures"}
_NOT_SOURCE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".*venv*",
                                     "runs", "out", ".hypothesis", ".pytest_cache")


def source_packages() -> set[str]:
    """Installed names of every folder with an ``__init__.py`` under the mapped roots."""
    out = set()
    for name, where in ROOTS.items():
        for init in (ROOT / where).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / where).parts
            out.add(".".join((name, *rel)))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True)
    (whl,) = (tmp / "dist").glob("drifttool-*.whl")
    return whl


def test_wheel_holds_every_package_fixture_file_and_reference(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(p for p in source_packages() if f"{p.replace('.', '/')}/__init__.py" not in names)
    assert not missing, f"packages of the source tree missing from the wheel: {missing}"
    for fixture_dir in (ROOT / "fixtures").iterdir():
        seal = fixture_dir / "seal.json"
        if seal.is_file():
            files = ["seal.json", *json.loads(seal.read_text())["files"]]
            lost = [f for f in files if f"drifttool/fixtures/{fixture_dir.name}/{f}" not in names]
            assert not lost, f"fixture {fixture_dir.name}: files missing from the wheel: {lost}"
    for ref in sorted((ROOT / "references").glob("*.json")) + sorted((ROOT / "references").glob("*.md")):
        assert f"drifttool/references/{ref.name}" in names, ref.name
    assert not [n for n in names if n.startswith("tools/") or "__pycache__" in n or n.endswith(".pyc")]


def test_wheel_installs_and_imports_in_a_fresh_venv(wheel, tmp_path):
    """A venv of its own (no pip, no source tree on the path); the dependencies come from the
    test's environment through a path entry, whose ``.pth`` hooks (an editable install's finder)
    are not run."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "zz_test_deps.pth").write_text("\n".join(deps) + "\n")
    script = (
        "import importlib, sys\n"
        f"for name in {sorted(source_packages())!r}:\n"
        "    importlib.import_module(name)\n"
        "import drifttool, drifttool.ops, drifttool.cli.app\n"
        f"assert drifttool.__file__.startswith({str(venv)!r}), drifttool.__file__\n"
        "from drifttool.fixture import check_seal, packaged_fixtures\n"
        "print(check_seal(packaged_fixtures() / 'tiny-t2i'))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    r = subprocess.run([str(py), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(venv / "bin" / "drifttool"), "--version"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"drifttool {drifttool.__version__}", r.stdout + r.stderr


def test_every_packaged_fixture_is_small():
    """Fixtures ship inside the wheel: each stays under 1 MiB (the embedded default is about
    0.9 MiB; the chain and edit fixtures use L1 capture and a 4-channel VAE to stay below it)."""
    for fixture_dir in (ROOT / "fixtures").iterdir():
        if (fixture_dir / "seal.json").is_file():
            total = sum(p.stat().st_size for p in fixture_dir.rglob("*") if p.is_file()
                        and "__pycache__" not in p.parts)
            assert total < 1 << 20, f"fixture {fixture_dir.name}: {total} bytes"
