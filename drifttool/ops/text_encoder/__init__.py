"""The Qwen2.5-VL text encoder's operators (component ``text_encoder``; rows ``te_*`` of
``drifttool.ops.specs.OPERATORS``): the ``strict`` family on device ``cpu`` and the
``production`` family (transformers 5.x / diffusers 0.42.1 arithmetic) on ``cpu`` and ``cuda``.

    >>> ids, mask = call(rt, "te_tokenize", prompts, T2I_TEMPLATE, encode, pad_id, 1058,
    ...                  stream="txt", layout=("BS", "BS"))

- ``exact`` — the operators that only move data or count tokens (``te_tokenize``,
  ``te_embed_tokens``, ``te_prompt_extract``): one function registered for both families;
- ``strict`` — batch- and padding-invariant arithmetic from ``drifttool.ops.strict_math``;
- ``production`` — the torch calls and cast points of transformers' ``Qwen2_5_VLTextModel``;
- ``vision_input`` — the prompt image's resize and patches (``te_vision_resize``,
  ``te_vision_patchify``), both families;
- ``vision_exact`` — the vision tokens' positions and scatter and the q/k rotation
  (``te_vision_rope_index``, ``te_vision_scatter``, ``te_vision_rope``), both families;
- ``vision_strict``, ``vision_production`` — the vision tower's arithmetic
  (``Qwen2_5_VisionTransformerPretrainedModel``).

The model that calls them is ``drifttool.text_encoder``.
"""

from drifttool.ops.text_encoder import (  # noqa: F401
    exact, production, strict, vision_exact, vision_input, vision_production, vision_strict,
)
