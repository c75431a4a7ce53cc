"""Batch and padding: a prompt's strict embedding bytes do not depend on the batch it is encoded
in, its position there or the padding length (batch 1 vs 3, odd prompt lengths, every
operator's per-sample records equal at L2); the production path (transformers' arithmetic) does
depend on them on the CPU — a control that drifts."""

from __future__ import annotations

import pytest

from tests.text_encoder.tiny import PROMPTS, save_tiny_pipeline, torch

from drifttool.runtime import Runtime
from drifttool.text_encoder import PromptEncoder, encode_prompts


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return PromptEncoder.load(save_tiny_pipeline(tmp_path_factory.mktemp("tiny-te"), seed=1))


def _rows(embeds, mask, b):
    n = embeds.shape[1] if mask is None else int(mask[b].sum())
    return embeds[b, :n]


def _bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("batch", [PROMPTS, PROMPTS[::-1], [PROMPTS[2], PROMPTS[1], PROMPTS[1]]],
                         ids=["abc", "cba", "cbb"])
def test_strict_prompt_bytes_do_not_depend_on_batch_or_padding(encoder, batch):
    alone = {p: encode_prompts(encoder, [p], Runtime(mode="strict"))[0][0] for p in set(batch)}
    embeds, mask = encode_prompts(encoder, batch, Runtime(mode="strict"))
    for b, p in enumerate(batch):
        assert _bytes(_rows(embeds, mask, b)).equal(_bytes(alone[p])), (b, p)
        assert not embeds[b, alone[p].shape[0]:].any()  # zero padding


def test_production_prompt_bytes_depend_on_the_batch(encoder):
    """The control: transformers' path (F.linear, SDPA with a padding mask) gives a prompt other
    bytes in a padded batch than alone on this CPU, for at least one prompt of the tiny model."""
    embeds, mask = encode_prompts(encoder, PROMPTS, Runtime(mode="auto"))
    alone = [encode_prompts(encoder, [p], Runtime(mode="auto"))[0][0] for p in PROMPTS]
    same = [_bytes(_rows(embeds, mask, b)).equal(_bytes(a)) for b, a in enumerate(alone)]
    diff = max(float((_rows(embeds, mask, b) - a).abs().max()) for b, a in enumerate(alone))
    assert not all(same) and diff < 1e-4, (same, diff)
