"""The shipped ``tiny-edit`` fixture is a ``QwenImageEditPipeline`` folder diffusers 0.42.1 loads
offline with ``from_pretrained``: from the fixture's prompt and condition image, diffusers' own
``encode_prompt`` gives the bytes of drifttool's production text encoder (``--prompt-positions
sequential``, what the pipeline gets from transformers 5.x) and of the fixture's sealed
embeddings, and the whole pipeline call (its resize area shrunk to the fixture's) decodes the
fixture's ``expected.png``.

The pipeline is the README's recipe, run as written: ``from_pretrained`` given a processor
assembled from the folder's own ``processor/`` files (transformers' PIL image processor, whose
resize drifttool reproduces, and the tokenizer; no video processor), every other component from
the folder: transformers builds ``Qwen2VLProcessor``'s video processor only with torchvision,
which this environment lacks. Where torchvision is installed, ``from_pretrained(folder)`` alone
loads all six components (its image processor is then torchvision's, whose resize is not
drifttool's: no bytes compared); where it is not, that call fails as the README says."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

PIL = pytest.importorskip("PIL.Image")

from drifttool.fixture import load_fixture, locate  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402
from tests.text_encoder.tiny_vision import as_tensor, torch  # noqa: E402

FX = locate("tiny-edit")
COMPONENTS = {"processor", "scheduler", "text_encoder", "tokenizer", "transformer", "vae"}


def _readme_recipe() -> str:
    """The README's Python block that loads ``tiny-edit`` with ``from_pretrained``."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    after = text.split("`tiny-edit` is also a folder diffusers loads", 1)[1]
    return re.search(r"^```python\n(.*?)^```$", after, re.S | re.M).group(1)


@pytest.fixture(scope="module")
def pipe():
    scope: dict = {}
    exec(compile(_readme_recipe(), "README.md", "exec"), scope)
    pipe = scope["pipe"]
    assert type(pipe.processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert pipe.processor.video_processor is None
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _prompt_image():
    """The condition image as ``__call__`` hands it to ``encode_prompt``: resized to the
    fixture's area (96x64), Lanczos."""
    return PIL.open(FX / "condition.png").convert("RGB").resize((96, 64), PIL.LANCZOS)


def test_the_folder_loads_as_an_edit_pipeline(pipe):
    index = json.loads((FX / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline" and set(index) - {"_class_name", "_diffusers_version"} == COMPONENTS
    assert set(pipe.components) == COMPONENTS
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert pipe.scheduler.config.shift_terminal == 0.02 and pipe.scheduler.config.use_dynamic_shifting
    assert pipe.text_encoder.model.visual.blocks[1].mlp.up_proj.weight.dtype == torch.bfloat16
    assert len(pipe.text_encoder.model.visual.blocks) == 2


def test_diffusers_encode_prompt_is_drifttools_production_text_encoder(pipe):
    from safetensors.torch import load_file

    from drifttool.environment import environment
    from drifttool.text_encoder import EDIT, PromptEncoder, encode_prompts
    from drifttool.verify import environment_note

    edit = load_fixture(FX).edit
    assert edit["prompt_positions"] == "sequential"
    encoder = PromptEncoder.load(FX, dtype=torch.bfloat16, vision=True)
    sealed = load_file(str(FX / "expected" / "inputs.safetensors"))  # the fixture's expected run's
    # production arithmetic: the sealed embeddings hold on the build's CPU (dispatch level, matrix extensions) and torch only
    off_build = environment_note(json.loads((FX / "expected" / "manifest.json").read_text()),
                                 {"environment": environment()})
    image = _prompt_image()
    with torch.no_grad():
        for key, text in (("txt", edit["prompts"][0]), ("neg_txt", edit["negative_prompts"][0])):
            want, want_mask = pipe.encode_prompt([text], image=image, device="cpu")
            got, mask = encode_prompts(encoder, [text], Runtime(mode="auto"), template=EDIT,
                                       images=[as_tensor(image)], positions="sequential")
            assert want_mask is None and mask is None
            assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape, key
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), key  # raw bytes
            if off_build is None:
                assert torch.equal(sealed[key].view(torch.int32), want.float().view(torch.int32)), key


def test_the_pipeline_call_decodes_the_fixtures_expected_image(pipe, monkeypatch):
    """``pipe(image, prompt, negative_prompt)`` with the fixture's settings (3 steps, true CFG 4,
    its generator seeded with the fixture's seed) decodes ``expected.png`` byte for byte."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_module

    from drifttool.environment import environment
    from drifttool.verify import environment_note

    if (why := environment_note(json.loads((FX / "expected" / "manifest.json").read_text()),
                                {"environment": environment()})) is not None:
        pytest.skip(why)
    fx = load_fixture(FX)
    original = edit_module.calculate_dimensions
    monkeypatch.setattr(edit_module, "calculate_dimensions",
                        lambda area, ratio: original(fx.edit["vae_image_area"], ratio))
    s = fx.settings
    out = pipe(image=PIL.open(FX / "condition.png").convert("RGB"), prompt=fx.edit["prompts"][0],
               negative_prompt=fx.edit["negative_prompts"][0], true_cfg_scale=s["cfg_scale"],
               num_inference_steps=s["steps"], generator=[torch.Generator().manual_seed(s["seed"])],
               output_type="pil").images[0]
    assert np.array_equal(np.asarray(out), np.asarray(PIL.open(FX / "expected.png")))


def test_from_pretrained_alone_loads_every_component_with_torchvision_only():
    """As the README says: ``from_pretrained(folder)`` alone needs torchvision."""
    from diffusers import QwenImageEditPipeline

    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(ImportError, match="Qwen2VLVideoProcessor requires the Torchvision library"):
            QwenImageEditPipeline.from_pretrained(FX, local_files_only=True)
        return
    pipe = QwenImageEditPipeline.from_pretrained(FX, local_files_only=True)
    assert set(pipe.components) == COMPONENTS and all(v is not None for v in pipe.components.values())
