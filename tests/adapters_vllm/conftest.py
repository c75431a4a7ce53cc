"""vllm-omni's Qwen-Image transformer on the CPU for the capture adapter's tests.

These tests need the separate test environment (vllm 0.30 and vllm-omni 0.30 installed without
their CUDA dependencies, diffusers 0.40.0: ``tests/adapters_vllm/build_env.sh``); they carry the
``vllm_omni`` marker, which the default run deselects, and each test module skips where
vllm-omni is absent.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

logging.getLogger("vllm_omni").setLevel(logging.ERROR)
logging.getLogger("vllm").setLevel(logging.ERROR)



def fixture_model() -> Path:
    """The embedded default fixture's transformer folder (diffusers format)."""
    from drifttool.settings import RunSpec, resolve

    return Path(resolve(RunSpec())[0].model_dir)


@pytest.fixture(scope="session")
def omni():
    """The CPU runtime (platform, gloo group), set up before anything else imports vllm-omni."""
    from drifttool.adapters.vllm_omni_cpu import cpu_runtime

    return cpu_runtime()


@pytest.fixture(scope="session")
def model_folder() -> Path:
    return fixture_model()


@pytest.fixture(scope="session")
def load(omni):
    """``load(dtype)``: the tiny fixture's transformer through vllm-omni, wrapped."""
    from drifttool.adapters.vllm_omni_qwenimage import load_transformer

    cache = {}

    def make(dtype):
        if dtype not in cache:
            cache[dtype] = load_transformer(fixture_model(), dtype)
        return cache[dtype]

    return make
