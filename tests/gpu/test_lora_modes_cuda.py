"""The four LoRA modes on a CUDA device, raw bytes; skipped without a GPU. Run on the GPU
machine with ``python -m pytest tests/gpu``.

As ``tests/model/test_lora_modes.py`` on the GPU: drifttool's production forward in each mode
equals the diffusers transformer with the adapter loaded the library's way (bf16 and fp32); on
CUDA peft's merge of bf16 factors is a bf16 matmul (no FP32 detour), which ``lora_fuse``
reproduces. And as ``tests/adapters/test_pipeline_lora.py``: a captured LoRA pipeline on the GPU
diffs IDENTICAL against ``drifttool run --device cuda --lora ... --lora-mode <its mode>``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("diffusers")

from drifttool.artifact.reader import open_run  # noqa: E402
from drifttool.diff.compare import diff_runs  # noqa: E402
from drifttool.diff.report import Verdict  # noqa: E402
from drifttool.model.checkpoint import load_checkpoint  # noqa: E402
from drifttool.model.lora import LORA_MODES  # noqa: E402
from drifttool.model.lora_io import load_lora  # noqa: E402
from drifttool.runner import execute  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402
from drifttool.settings import RunSpec  # noqa: E402
from tests.adapters.test_pipeline_lora import FIXTURE_MODEL, adapter, capture, prompt_files  # noqa: E402,F401
from tests.conftest import assert_same_bytes  # noqa: E402
from tests.model.test_lora_modes import DTYPES, _inputs, setup  # noqa: E402,F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cuda(t):
    return t.to("cuda") if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", LORA_MODES)
def test_mode_is_byte_equal_to_the_library_on_cuda(setup, mode, dtype):
    base, adapter = setup
    w = DTYPES[dtype]
    model = load_checkpoint(base, dtype=w, device="cuda")
    load_lora(model, adapter, mode=mode)
    x, txt, mask, tau, grid = (_cuda(t) for t in _inputs(w))
    with torch.no_grad():
        got = model(x, txt, mask, tau, grid, Runtime(mode="auto"))
    tr = _theirs_cuda(base, adapter, w, mode)
    with torch.no_grad():
        ref = tr(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                 timestep=tau, img_shapes=[(1, *grid)] * 2, return_dict=False)[0]
    assert got.device.type == "cuda"
    assert_same_bytes(got.cpu(), ref.cpu(), f"{mode} {dtype} on cuda")


def _theirs_cuda(base, adapter, dtype, mode):
    """As ``test_lora_modes.theirs``, with the transformer moved to the GPU before the adapter
    is loaded (so peft puts the factors there and merges there)."""
    from diffusers import QwenImageTransformer2DModel
    from peft import PeftModel

    from tests.diffusers_pipeline import tiny_pipeline

    tr = QwenImageTransformer2DModel.from_pretrained(base, torch_dtype=dtype).to("cuda").eval()
    if mode in ("fused", "unfused"):
        pipe = tiny_pipeline(tr)
        pipe.load_lora_weights(adapter)
        if mode == "fused":
            pipe.fuse_lora()
        return tr
    wrapped = PeftModel.from_pretrained(tr, adapter).eval()
    return wrapped.merge_and_unload() if mode == "merged" else wrapped.base_model.model


@pytest.mark.parametrize("mode", ["unfused", "fused", "unfused-fp32"])
def test_captured_lora_pipeline_on_cuda_diffs_identical_against_run(adapter, prompt_files, mode, tmp_path):
    from drifttool.adapters.diffusers_qwenimage import load_transformer
    from tests.diffusers_pipeline import tiny_pipeline

    spec = RunSpec(mode="auto", preset="diffusers", capture="L1", batch=2, dtype="bfloat16",
                   lora=adapter, lora_mode=mode, device="cuda", prompt_embeds=prompt_files["pe"],
                   negative_prompt_embeds=prompt_files["ne"])
    execute(spec, tmp_path / "run")
    tr = load_transformer(FIXTURE_MODEL, torch.bfloat16).to("cuda")
    if mode == "unfused-fp32":
        from peft import PeftModel

        PeftModel.from_pretrained(tr, adapter).eval()
        pipe = tiny_pipeline(tr)
    else:
        pipe = tiny_pipeline(tr)
        pipe.load_lora_weights(adapter)
        if mode == "fused":
            pipe.fuse_lora()
    capture(pipe, tmp_path / "run", tmp_path / "pipe", "L1", device="cuda")
    run, cap = open_run(tmp_path / "run"), open_run(tmp_path / "pipe")
    assert cap.manifest["lora"] == run.manifest["lora"]
    rep = diff_runs(run, cap)
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    assert rep.counts["ops"].differ == 0 and rep.counts["ops"].matched > 200
