"""Every GPU test asks only for fixtures that exist. The GPU tests skip without a CUDA device
before their fixtures are set up, so on CPU CI a misspelled or removed fixture would show only on
the GPU machine; a collection of ``tests/gpu`` with ``tests/fixture_check_plugin.py`` refuses such
a test (it also fails on a GPU test module that does not import)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collect(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=",
                           "-p", "tests.fixture_check_plugin", "-p", "no:cacheprovider", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_gpu_test_resolves_its_fixtures():
    res = _collect(ROOT / "tests" / "gpu")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert " collected" in res.stdout


def test_a_gpu_test_with_a_fixture_nothing_defines_is_refused(tmp_path):
    probe = tmp_path / "test_probe_cuda.py"
    probe.write_text("import pytest\n\npytestmark = pytest.mark.skipif(True, reason='no GPU here')\n\n\n"
                     "def test_probe(tmp_path, no_such_fixture_anywhere):\n    pass\n")
    res = _collect(probe)
    assert res.returncode != 0 and "test_probe: no_such_fixture_anywhere" in res.stdout + res.stderr
    assert "tmp_path" not in (res.stdout + res.stderr).split("nothing defines")[-1]
