"""The shipped ``tiny-t2i-chain`` fixture is a ``QwenImagePipeline`` folder diffusers 0.42.1 loads
offline with ``from_pretrained`` alone, as docs/adapters.md and the README load it: its
``model_index.json`` names every component and its ``scheduler/`` is Qwen-Image's scheduler
config (the one ``fixtures/build_chain.py`` writes for both chain fixtures). Slow (20 s): the
text encoder's default vision tower is drawn at load; ``tests.diffusers_pipeline.chain_pipeline``
loads the same folder with a one-block tower in the default suite."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

import torch  # noqa: E402

from drifttool.fixture import locate  # noqa: E402
from drifttool.fixtures.build_chain import SCHEDULER  # noqa: E402
from tests.diffusers_pipeline import QWEN_IMAGE_SCHEDULER  # noqa: E402

FX = locate("tiny-t2i-chain")
COMPONENTS = {"scheduler", "text_encoder", "tokenizer", "transformer", "vae"}


@pytest.mark.slow
def test_from_pretrained_alone_loads_every_component():
    from diffusers import QwenImagePipeline
    from diffusers.utils import logging as dlogging
    from transformers import logging as tlogging

    dlogging.set_verbosity_error()
    tlogging.set_verbosity_error()  # the text encoder's unused default vision tower, drawn at load
    index = json.loads((FX / "model_index.json").read_text())
    assert set(index) - {"_class_name", "_diffusers_version"} == COMPONENTS
    pipe = QwenImagePipeline.from_pretrained(FX, dtype=torch.bfloat16, local_files_only=True)
    assert set(pipe.components) == COMPONENTS and all(v is not None for v in pipe.components.values())
    config = {k: v for k, v in pipe.scheduler.config.items() if not k.startswith("_")}
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert {k: config[k] for k in QWEN_IMAGE_SCHEDULER} == QWEN_IMAGE_SCHEDULER
    assert json.loads((FX / "scheduler" / "scheduler_config.json").read_text()) == SCHEDULER
    assert json.loads((locate("tiny-edit") / "scheduler" / "scheduler_config.json").read_text()) == SCHEDULER
    assert pipe.transformer.dtype == pipe.vae.dtype == torch.bfloat16
