"""The production text encoder equals diffusers 0.42.1's ``QwenImagePipeline.encode_prompt``
(transformers 5.x, ``sdpa``) byte for byte on the CPU: prompt embeddings and mask, for one prompt
(mask None), a padded batch, and a cut ``max_sequence_length``; the token ids equal
transformers' tokenizer's."""

from __future__ import annotations

import pytest

from tests.text_encoder.tiny import PROMPTS, diffusers_pipeline, save_tiny_pipeline, torch

from drifttool.runtime import Runtime
from drifttool.text_encoder import T2I, PromptEncoder, encode_prompts


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny-te"), seed=0)


@pytest.fixture(scope="module")
def pipe(folder):
    return diffusers_pipeline(folder)


@pytest.fixture(scope="module")
def ours(folder):
    return PromptEncoder.load(folder)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.view(torch.uint8).equal(b.view(torch.uint8)) \
        if a.is_floating_point() else a.dtype == b.dtype and a.equal(b)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS, PROMPTS[::-1], [" "]], ids=["one", "three", "reversed", "blank"])
def test_production_encode_prompt_is_diffusers_bytes(pipe, ours, prompts):
    with torch.no_grad():
        want_e, want_m = pipe.encode_prompt(prompts, device="cpu")
    got_e, got_m = encode_prompts(ours, prompts, Runtime(mode="auto"))
    assert _same(got_e, want_e) and _same(got_m, want_m)


def test_max_sequence_length_cuts_rows_and_mask_as_diffusers(pipe, ours):
    with torch.no_grad():
        want_e, want_m = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=7)
    got_e, got_m = encode_prompts(ours, PROMPTS, Runtime(mode="auto"), max_sequence_length=7)
    assert _same(got_e, want_e) and _same(got_m, want_m)


def test_token_ids_equal_transformers_tokenizer(pipe, ours):
    texts = [T2I.text.format(p) for p in PROMPTS] + ["unseen words: Zürich ☃ 42"]
    want = pipe.tokenizer(texts, padding=True, truncation=True, max_length=1058, return_tensors="pt")
    from drifttool.ops.text_encoder.exact import te_tokenize

    ids, mask = te_tokenize(PROMPTS + ["unseen words: Zürich ☃ 42"], "{}", ours.tokenizer.encode,
                            ours.tokenizer.pad_id, 1058)
    ids_t2i, _ = te_tokenize(PROMPTS, T2I.text, ours.tokenizer.encode, ours.tokenizer.pad_id, 1058)
    assert ids_t2i.equal(want.input_ids[:3, : ids_t2i.shape[1]])
    assert ids[3, : int(mask[3].sum())].equal(want.input_ids[3, : int(want.attention_mask[3].sum())])


def test_template_prefix_is_the_dropped_rows(ours):
    """34 tokens up to ``user\\n`` (t2i), the pipelines' hard-coded drop."""
    prefix = T2I.text.split("{}")[0]
    assert len(ours.tokenizer.encode([prefix])[0]) == T2I.drop


def test_last_hidden_state_is_transformers_hidden_states_last(pipe, ours):
    """The language model alone: ``hidden_states[-1]`` of the full model (post final norm)."""
    from drifttool.text_encoder import text_positions

    enc = pipe.tokenizer([T2I.text.format(p) for p in PROMPTS], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = pipe.text_encoder(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                                 output_hidden_states=True).hidden_states[-1]
    got = ours.model(enc.input_ids, enc.attention_mask, text_positions(*enc.input_ids.shape), Runtime(mode="auto"))
    assert _same(got, want)
