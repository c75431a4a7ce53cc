"""The adapter forms of ``tests/model/test_lora_forms.py`` on a CUDA device, raw bytes; skipped
without a GPU. Run on the GPU machine with ``python -m pytest tests/gpu``.

Adapters on the modulation, embedders and final Linears, ``all-linear`` + rsLoRA and DoRA, made
by peft / diffusers, loaded by the libraries on the GPU the way each LoRA mode reproduces
(``test_lora_modes_cuda._theirs_cuda``), against drifttool's production forward on the GPU. And
the strict CUDA family runs the new targets merged (FP32 W' into operators whose output stays in
the model dtype).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("diffusers")

from drifttool.model.checkpoint import load_checkpoint  # noqa: E402
from drifttool.model.lora_io import load_lora  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402
from tests.conftest import assert_same_bytes, bits  # noqa: E402
from tests.gpu.test_lora_modes_cuda import _cuda, _theirs_cuda  # noqa: E402
from tests.model.test_lora_forms import FORMS, _modes, adapters, base  # noqa: E402,F401
from tests.model.test_lora_modes import DTYPES, _inputs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _ours_cuda(base, adapter, w, mode, rt_mode="auto"):
    model = load_checkpoint(base, dtype=w, device="cuda")
    load_lora(model, adapter, mode=mode)
    x, txt, mask, tau, grid = (_cuda(t) for t in _inputs(w))
    with torch.no_grad():
        return model(x, txt, mask, tau, grid, Runtime(mode=rt_mode))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("form,mode", [(f, m) for f in FORMS for m in _modes(f)])
def test_form_is_byte_equal_to_the_library_on_cuda(base, adapters, form, mode, dtype):
    w = DTYPES[dtype]
    got = _ours_cuda(base, adapters[form], w, mode)
    tr = _theirs_cuda(base, adapters[form], w, mode)
    x, txt, mask, tau, grid = (_cuda(t) for t in _inputs(w))
    with torch.no_grad():
        ref = tr(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                 timestep=tau, img_shapes=[(1, *grid)] * 2, return_dict=False)[0]
    assert got.device.type == "cuda"
    assert_same_bytes(got.cpu(), ref.cpu(), f"{form} {mode} {dtype} on cuda")


def test_new_targets_run_strict_merged_on_cuda(base, adapters):
    v = _ours_cuda(base, adapters["embedders_modulation_out"], torch.bfloat16, "merged", "strict")
    plain = load_checkpoint(base, dtype=torch.bfloat16, device="cuda")
    x, txt, mask, tau, grid = (_cuda(t) for t in _inputs(torch.bfloat16))
    with torch.no_grad():
        ref = plain(x, txt, mask, tau, grid, Runtime(mode="strict"))
    assert v.dtype == torch.bfloat16 and not torch.equal(bits(v.cpu()), bits(ref.cpu()))
