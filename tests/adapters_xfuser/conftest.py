"""xfuser (xDiT) 0.7.0's Qwen-Image transformer on the CPU, for the capture adapter's tests.

These tests need the separate test environment (xfuser 0.7.0 with its dependencies, diffusers
0.42.1, triton: ``tests/adapters_xfuser/build_env.sh``); they carry the ``xfuser`` marker, which
the default run deselects, and each test module skips where xfuser is absent.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

for _name in ("xfuser", "diffusers"):
    logging.getLogger(_name).setLevel(logging.ERROR)


@pytest.fixture(scope="session", autouse=True)
def xfuser_imported():
    """xfuser imported through the adapter's import shim before a test imports any of it."""
    from drifttool.adapters.xfuser_cpu import transformer_module

    return transformer_module()


def fixture_model() -> Path:
    """The embedded default fixture's transformer folder (diffusers format)."""
    from drifttool.settings import RunSpec, resolve

    return Path(resolve(RunSpec())[0].model_dir)


@pytest.fixture(scope="session")
def model_folder() -> Path:
    return fixture_model()


@pytest.fixture(scope="session")
def load():
    """``load(runtime, dtype)``: the tiny fixture's transformer loaded by ``runtime``
    (``"xfuser"`` or ``"diffusers"``), cached per process."""
    from drifttool.adapters import diffusers_qwenimage, xfuser_qwenimage

    loaders = {"xfuser": xfuser_qwenimage.load_transformer,
               "diffusers": diffusers_qwenimage.load_transformer}
    cache = {}

    def make(runtime, dtype):
        if (runtime, dtype) not in cache:
            cache[runtime, dtype] = loaders[runtime](fixture_model(), dtype)
        return cache[runtime, dtype]

    return make
