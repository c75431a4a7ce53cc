"""Edit prompts with their images (``encode_prompts(template=EDIT | EDIT_PLUS, images=...)``).

Production against diffusers 0.42.1 / transformers 5.x, byte for byte on the CPU (FP32; BF16
for the edit pipeline):
- ``positions="sequential"`` equals ``QwenImageEditPipeline.encode_prompt(prompt, image=...)``
  as it runs here (transformers 5.x is not given ``mm_token_type_ids`` by that pipeline, so
  every token takes positions 0…L−1) — one prompt (mask None), a padded batch of 3, and
  ``QwenImageEditPlusPipeline.encode_prompt`` with two images;
- ``positions="rope_index"`` equals the same pipeline steps with the processor's
  ``mm_token_type_ids`` passed to the text encoder (transformers' ``get_rope_index`` positions),
  and ``te_vision_rope_index`` equals ``get_rope_index`` on a padded batch.
Strict: a prompt's bytes are the same alone and in a batch of 3 with longer and shorter prompts
and other images; close to transformers' forward in FP64."""

from __future__ import annotations

import pytest

from tests.text_encoder.tiny import PROMPTS
from tests.text_encoder.tiny_vision import (
    as_tensor, edit_pipeline, random_image, save_tiny_vision_pipeline, torch, transformers,
)

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implementation
from drifttool.runtime import Runtime
from drifttool.text_encoder import EDIT, EDIT_PLUS, T2I, PromptEncoder, encode_prompts

SIZES = [(150, 262), (60, 90), (310, 200)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_vision_pipeline(tmp_path_factory.mktemp("tiny-vl"), seed=0)


@pytest.fixture(scope="module")
def pipe(folder):
    return edit_pipeline(folder)


@pytest.fixture(scope="module")
def ours(folder):
    return PromptEncoder.load(folder, vision=True)


@pytest.fixture(scope="module")
def images():
    return [random_image(h, w, seed=h + w) for h, w in SIZES]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.contiguous().view(torch.uint8).equal(
        b.contiguous().view(torch.uint8))


def _encode(ours, prompts, imgs, mode="auto", **kw):
    return encode_prompts(ours, prompts, Runtime(mode=mode), template=kw.pop("template", EDIT),
                          images=[as_tensor(i) if not isinstance(i, list) else [as_tensor(j) for j in i]
                                  for i in imgs], **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 3], ids=["one", "three"])
def test_production_is_the_edit_pipelines_encode_prompt(folder, pipe, ours, images, n, dtype):
    if dtype != torch.float32:
        pipe, ours = edit_pipeline(folder, dtype=dtype), PromptEncoder.load(folder, vision=True, dtype=dtype)
    with torch.no_grad():
        want = pipe.encode_prompt(PROMPTS[:n], image=images[:n] if n > 1 else images[0], device="cpu")
    got = _encode(ours, PROMPTS[:n], images[:n], positions="sequential")
    assert got[0].dtype == dtype and _same(got[0], want[0]) and _same(got[1], want[1])
    assert (got[1] is None) == (n == 1)


def test_production_is_the_edit_plus_pipelines_encode_prompt(folder, ours, images):
    plus = edit_pipeline(folder, plus=True)
    with torch.no_grad():
        want = plus.encode_prompt(PROMPTS[:1], image=images[:2], device="cpu")
    got = _encode(ours, PROMPTS[:1], [images[:2]], template=EDIT_PLUS, positions="sequential")
    assert _same(got[0], want[0]) and got[1] is None is want[1]


def _with_rope_index(pipe, prompts, imgs, dtype=torch.float32, te=None):
    """diffusers' ``_get_qwen_prompt_embeds`` steps, the processor's ``mm_token_type_ids`` passed on."""
    inputs = pipe.processor(text=[EDIT.text.format(p) for p in prompts], images=imgs, padding=True,
                            return_tensors="pt")
    te = te or pipe.text_encoder
    with torch.no_grad():
        hidden = te(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                    pixel_values=inputs["pixel_values"].to(dtype), image_grid_thw=inputs["image_grid_thw"],
                    mm_token_type_ids=inputs["mm_token_type_ids"], output_hidden_states=True).hidden_states[-1]
    rows = [h[64:] for h in pipe._extract_masked_hidden(hidden, inputs["attention_mask"])]
    width = max(r.shape[0] for r in rows)
    return torch.stack([torch.cat([r, r.new_zeros(width - r.shape[0], r.shape[1])]) for r in rows]), inputs


def test_production_rope_index_is_transformers_with_its_rope_index(pipe, ours, images):
    want, _ = _with_rope_index(pipe, PROMPTS, images)
    got, mask = _encode(ours, PROMPTS, images)
    assert _same(got, want) and mask is not None
    sequential, _ = _encode(ours, PROMPTS, images, positions="sequential")
    assert not torch.equal(got, sequential)  # the two position rules give other embeddings


def test_rope_index_and_token_ids_are_transformers(pipe, ours, images):
    _, inputs = _with_rope_index(pipe, PROMPTS, images)
    want, _ = pipe.text_encoder.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"])
    got = implementation("te_vision_rope_index", "strict")(
        inputs["input_ids"], inputs["attention_mask"], ours.image_token_id, inputs["image_grid_thw"], 2)
    assert got.equal(want)
    from drifttool.text_encoder.encode import _expand
    from drifttool.text_encoder.vision_grid import merged_tokens

    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    texts = [_expand(EDIT.format(p, 1), [merged_tokens(g, 2)]) for p, g in zip(PROMPTS, grids)]
    ids = ours.tokenizer.encode(texts)
    assert ids == [row[m.bool()].tolist() for row, m in zip(inputs["input_ids"], inputs["attention_mask"])]


def test_text_only_prompts_take_the_same_positions_under_either_rule(pipe, ours):
    """``--prompt-positions`` (its help says so) changes nothing without a condition image: on
    text-only prompts the rope index (drifttool's, and transformers' ``get_rope_index``) gives
    each valid token 0..n-1 on the three axes, as ``sequential`` and the text-to-image encode
    (``text_positions``) do; padding positions are masked either way."""
    from drifttool.text_encoder.model import text_positions

    rows = ours.tokenizer.encode([T2I.format(p) for p in PROMPTS])
    width = max(map(len, rows))
    ids = torch.tensor([r + [ours.tokenizer.pad_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    assert len(set(map(len, rows))) > 1  # padded rows
    got = implementation("te_vision_rope_index", "strict")(ids, mask, ours.image_token_id,
                                                           torch.zeros(0, 3, dtype=torch.int64), 2)
    want, _ = pipe.text_encoder.model.get_rope_index(ids, torch.zeros_like(ids), image_grid_thw=None,
                                                     attention_mask=mask)
    valid = mask.bool()
    sequential = text_positions(*ids.shape)
    assert got[:, valid].equal(sequential[:, valid]) and want[:, valid].equal(sequential[:, valid])


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 2, 2]], ids=["abc", "cba", "bcc"])
def test_strict_prompt_bytes_do_not_depend_on_the_batch(ours, images, order):
    prompts, imgs = [PROMPTS[i] for i in order], [images[i] for i in order]
    alone = {i: _encode(ours, [PROMPTS[i]], [images[i]], "strict")[0][0] for i in set(order)}
    embeds, mask = _encode(ours, prompts, imgs, "strict")
    for b, i in enumerate(order):
        n = alone[i].shape[0]
        assert _same(embeds[b, :n], alone[i]) and not embeds[b, n:].any(), (order, b)
        assert mask is None or int(mask[b].sum()) == n


def test_strict_edit_plus_prompt_bytes_do_not_depend_on_the_batch(ours, images):
    """A prompt with two images alone and after a one-image prompt (diffusers' edit-plus pipeline
    takes one prompt; drifttool takes each prompt's own images)."""
    alone, _ = _encode(ours, PROMPTS[2:], [[images[0], images[2]]], "strict", template=EDIT_PLUS)
    both, mask = _encode(ours, PROMPTS[1:], [[images[1]], [images[0], images[2]]], "strict", template=EDIT_PLUS)
    n = alone.shape[1]
    assert _same(both[1, :n], alone[0]) and int(mask[1].sum()) == n and int(mask[0].sum()) < n


def test_strict_is_close_to_the_fp64_forward(folder, pipe, ours, images):
    te64 = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder / "text_encoder", dtype=torch.float64, local_files_only=True).eval()
    want, _ = _with_rope_index(pipe, PROMPTS, images, torch.float64, te64)
    for mode in ("strict", "auto"):
        got, _ = _encode(ours, PROMPTS, images, mode)
        err = (got.double() - want).abs()  # measured: strict 6.1e-7, production 8.3e-7 (|r| ≤ 3.4)
        assert bool((err <= 2e-6 + 2e-6 * want.abs()).all()), (mode, float(err.max()))


def test_unsupported_edit_calls_fail_closed(folder, ours, images):
    img = as_tensor(images[1])
    text_only = PromptEncoder.load(folder)
    with pytest.raises(UnsupportedConfigError, match="vision tower"):
        encode_prompts(text_only, ["a"], Runtime(mode="strict"), template=EDIT, images=[img])
    with pytest.raises(UnsupportedConfigError, match="images of each"):
        encode_prompts(ours, ["a", "b"], Runtime(mode="strict"), template=EDIT, images=[img])
    with pytest.raises(UnsupportedConfigError, match="1 image"):
        encode_prompts(ours, ["a"], Runtime(mode="strict"), template=EDIT, images=[[img, img]])
    with pytest.raises(UnsupportedConfigError, match="placeholder"):
        encode_prompts(ours, ["a <|image_pad|>"], Runtime(mode="strict"), template=EDIT, images=[img])
    with pytest.raises(UnsupportedConfigError, match="takes no images"):
        encode_prompts(ours, ["a"], Runtime(mode="strict"), template=T2I, images=[img])
    with pytest.raises(UnsupportedConfigError, match="positions"):
        encode_prompts(ours, ["a"], Runtime(mode="strict"), template=EDIT, images=[img], positions="3d")
