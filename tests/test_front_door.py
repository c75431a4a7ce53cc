"""The Python API: ``import drifttool`` stays torch-free, and each front-door name is the real
function or class of its home module, imported on first use (``drifttool/__init__.py``)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

import drifttool

HOMES = {
    "execute": "drifttool.runner",
    "RunSpec": "drifttool.settings",
    "Runtime": "drifttool.runtime",
    "open_run": "drifttool.artifact.reader",
    "diff_runs": "drifttool.diff.compare",
    "capture_pipeline": "drifttool.adapters.diffusers_pipeline",
    "verify_fixture": "drifttool.verify",
}

_IMPORT_ONLY = """
import json, sys
import drifttool
print(json.dumps({"torch": "torch" in sys.modules, "pyarrow": "pyarrow" in sys.modules,
                  "all": drifttool.__all__, "dir": dir(drifttool)}))
"""


def test_import_drifttool_loads_neither_torch_nor_pyarrow():
    r = subprocess.run([sys.executable, "-c", _IMPORT_ONLY], capture_output=True, text=True,
                       timeout=120, check=True)
    got = json.loads(r.stdout)
    assert not got["torch"] and not got["pyarrow"], got
    assert set(HOMES) <= set(got["all"]) and set(got["all"]) <= set(got["dir"]), got


def test_all_lists_exactly_the_front_door():
    assert drifttool.__all__ == ["__version__", *HOMES]
    assert set(HOMES) <= set(dir(drifttool))


@pytest.mark.parametrize("name", sorted(HOMES))
def test_each_name_is_the_real_object_of_its_home(name):
    if name == "capture_pipeline":
        pytest.importorskip("diffusers")
    assert getattr(drifttool, name) is getattr(importlib.import_module(HOMES[name]), name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'open_runs'"):
        drifttool.open_runs  # noqa: B018
    assert not hasattr(drifttool, "nope")


def test_capture_pipeline_without_diffusers_says_what_to_install():
    code = ("import sys; sys.modules['diffusers'] = None\n"  # as if diffusers were not installed
            "import drifttool\n"
            "try:\n    drifttool.capture_pipeline\nexcept ImportError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       check=True)
    assert r.stdout.strip() == ("drifttool.capture_pipeline needs diffusers: "
                                "pip install 'diffusers>=0.42,<0.43'"), r.stdout + r.stderr
