"""The strict CUDA family's Triton kernels, run by Triton's interpreter on CPU tensors.

``TRITON_INTERPRET=1`` must be set before Triton decorates a kernel, so it is set here, when this
directory is collected, and only on a machine without CUDA: there the kernels' logic (masks, the
fixed reduction order, row/batch/padding invariance, FP32 accuracy) is tested on the CPU. With a
GPU, these tests skip and ``tests/gpu`` tests the same kernels for real (bytes and speed).
The interpreter computes ``tl.dot`` with numpy, so its bytes are not the GPU's: tests here compare
against the FP64 references within a tolerance and compare rows with rows of the same run.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

_WHY = None
if torch.cuda.is_available():
    _WHY = "a CUDA device is present: tests/gpu runs these kernels on it"
elif importlib.util.find_spec("triton") is None:
    _WHY = "Triton is not installed (pip install triton==3.6.0)"
else:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if _WHY is None:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=_WHY))
