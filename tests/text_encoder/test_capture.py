"""Capture of the text encoder: every operator call is recorded under component
``text_encoder`` (block −1 the embedding, 0..layers−1 the decoder layers, ``layers`` the final
norm and the prompt extraction), and a prompt's strict records at L2 are the same in a batch of
3 as alone (the identity and the digests are per logical sample)."""

from __future__ import annotations

import pytest

from tests.text_encoder.tiny import PROMPTS, save_tiny_pipeline

from drifttool.capture.recorder import Recorder
from drifttool.ops.specs import TEXT_ENCODER_OPERATORS, VISION_OPERATORS
from drifttool.runtime import Runtime
from drifttool.text_encoder import PromptEncoder, encode_prompts

KEY = ("component", "phase", "step", "block", "op", "stream", "call", "op_pos", "index", "role")


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return PromptEncoder.load(save_tiny_pipeline(tmp_path_factory.mktemp("tiny-te"), seed=2))


def _records(encoder, prompts, samples):
    rec = Recorder("L2")
    rt = Runtime(mode="strict", recorder=rec)
    encode_prompts(encoder, prompts, rt, samples=samples)
    rec.flush()
    rows = rec.ops_table().to_pylist()
    return rows, rt


def test_every_operator_is_captured_under_the_text_encoder(encoder):
    rows, rt = _records(encoder, PROMPTS, [0, 1, 2])
    assert {r["component"] for r in rows} == {"text_encoder"}
    captured = {r["op"] for r in rows}
    language = set(TEXT_ENCODER_OPERATORS) - set(VISION_OPERATORS)  # a text-only prompt calls no te_vision_*
    assert captured == language - {"te_tokenize"}  # traced only
    traced = {(e.component, e.op) for e in rt.trace.entries()}
    assert traced == {("text_encoder", op) for op in language}
    blocks = {r["block"] for r in rows}
    assert blocks == {-1, 0, 1, 2}
    assert {r["sample"] for r in rows} == {0, 1, 2}


def test_a_prompts_strict_records_are_the_same_alone_and_in_a_batch(encoder):
    batch, _ = _records(encoder, PROMPTS, [0, 1, 2])
    alone, _ = _records(encoder, PROMPTS[1:2], [1])

    def of(rows, sample):
        return {tuple(r[k] for k in KEY): (r["digest"], r["row_digests"], r["txt_len"]) for r in rows if r["sample"] == sample}

    mine = of(alone, 1)
    assert mine and of(batch, 1) == mine


def test_an_edit_prompts_operators_are_captured_and_its_records_do_not_depend_on_the_batch(tmp_path_factory):
    """Every text-encoder operator runs for edit prompts (the vision ones too); the tower's
    records are of the packed images (sample −1), the others per prompt, and a prompt's strict
    per-prompt records at L2 are the same alone and in a batch of 3."""
    from tests.text_encoder.tiny_vision import as_tensor, random_image, save_tiny_vision_pipeline

    from drifttool.text_encoder import EDIT

    enc = PromptEncoder.load(save_tiny_vision_pipeline(tmp_path_factory.mktemp("tiny-vl"), seed=3), vision=True)
    images = [as_tensor(random_image(h, w, seed=h)) for h, w in ((150, 262), (60, 90), (310, 200))]

    def records(prompts, imgs, samples):
        rec = Recorder("L2")
        rt = Runtime(mode="strict", recorder=rec)
        encode_prompts(enc, prompts, rt, template=EDIT, images=imgs, samples=samples)
        rec.flush()
        return rec.ops_table().to_pylist(), rt

    batch, rt = records(PROMPTS, images, [0, 1, 2])
    assert {r["component"] for r in batch} == {"text_encoder"}
    assert {r["op"] for r in batch} == set(TEXT_ENCODER_OPERATORS) - {"te_tokenize"}
    assert {e.op for e in rt.trace.entries()} == set(TEXT_ENCODER_OPERATORS)
    packed = {"te_vision_resize", "te_vision_patchify", "te_vision_rope_index", "te_vision_scatter"}
    assert {r["op"] for r in batch if r["sample"] == -1} == set(VISION_OPERATORS) - packed
    assert {r["sample"] for r in batch if r["op"] in packed} == {0, 1, 2}
    alone, _ = records(PROMPTS[1:2], images[1:2], [1])

    def of(rows, sample):
        return {tuple(r[k] for k in KEY): (r["digest"], r["row_digests"], r["txt_len"]) for r in rows
                if r["sample"] == sample}

    mine = of(alone, 1)
    assert mine and of(batch, 1) == mine
