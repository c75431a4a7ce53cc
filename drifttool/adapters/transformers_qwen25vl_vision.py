"""Capture adapter for the vision tower of transformers' Qwen2.5-VL text encoder
(``Qwen2_5_VisionTransformerPretrainedModel``, ``pipe.text_encoder.model.visual``): its operator
outputs recorded as drifttool's own vision tower records them (``drifttool.text_encoder.vision``).

    >>> with instrument_vision(pipe.text_encoder, rt):   # rt's scope: component text_encoder, step −1
    ...     pipe.text_encoder(input_ids=ids, attention_mask=mask, pixel_values=px, image_grid_thw=thw)
    >>> # rt's recorder now holds te_vision_patch_embed, te_vision_rope_table, per block
    >>> # te_vision_rmsnorm ... te_vision_mlp_down_residual, then te_vision_merger

One packed call over every image of the encode call, as drifttool runs it. Records have stream
``img`` and no batch axis (layout ``S``: sample −1, rows in the order the operator saw them: patch
order at block −1, window order in the blocks and the merger, as ``VisionTower`` records them):

======================================  ============================  ==========================
vision tower module                     RFC operator                  capture point
======================================  ============================  ==========================
``patch_embed``                         te_vision_patch_embed (−1)    output [N, E]
``rotary_pos_emb``                      te_vision_rope_table (−1)     output (cos, sin) [N, Dh]
``blocks.i.norm1``                      te_vision_rmsnorm #0          output
``blocks.i.attn.qkv``                   te_vision_qkv (q, k, v)       output split [N, H, Dh] ×3
attention function: query, key          te_vision_rope (q, k)         arguments, segments joined
attention function: output              te_vision_attention           returns, segments joined
``blocks.i.norm2``                      te_vision_attn_out_residual   input (x + ``attn``)
``blocks.i.norm2``                      te_vision_rmsnorm #1          output
``blocks.i.mlp.down_proj``              te_vision_mlp_gate_up_silu    input
``blocks.i``                            te_vision_mlp_down_residual   output
``merger``                              te_vision_merger (depth)      output (window order)
======================================  ============================  ==========================

The RoPE'd query and key and the attention output are no module's output: transformers hands
each attention segment (a window, or a whole image in the ``fullatt_block_indexes`` blocks) to
the function ``AttentionInterface`` holds for the tower's implementation. A capture function is
registered under ``VISION_CAPTURE_IMPLEMENTATION`` and the tower's implementation (only the
tower's: ``set_attn_implementation({"vision_config": ...})``) is switched to it for the block;
it keeps each segment's query, key and output and hands the call to the configured
implementation (``sdpa`` as loaded; the trace names it). When the attention module returns, the
segments are joined in row order and recorded. On exit, also on error, the implementation is
restored and the registration withdrawn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Iterator

import torch

from drifttool.adapters.taps import AFTER, BEFORE, Tap, record, tap_modules
from drifttool.adapters.transformers_qwen25vl import language_model, language_model_weights
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.runtime import Runtime

VISION_CAPTURE_IMPLEMENTATION = "drifttool_capture_vision"
"""The name the vision tower's capture function is registered under while a capture runs."""

_BLOCK = "blocks.*"

VISION_TAPS = (
    Tap("patch_embed", "te_vision_patch_embed", "img", "S.", block=BEFORE),
    Tap("rotary_pos_emb", "te_vision_rope_table", "img", ("S.", "S."), block=BEFORE,
        note=" (cos, sin; patch order)"),
    Tap(f"{_BLOCK}.norm1", "te_vision_rmsnorm", "img", "S."),
    Tap(f"{_BLOCK}.norm2", "te_vision_attn_out_residual", "img", "S.", read="input",
        note=" (input: x + attn)"),
    Tap(f"{_BLOCK}.norm2", "te_vision_rmsnorm", "img", "S."),
    Tap(f"{_BLOCK}.mlp.down_proj", "te_vision_mlp_gate_up_silu", "img", "S.", read="input",
        note=" (input: act_fn(gate_proj) * up_proj)"),
    Tap(_BLOCK, "te_vision_mlp_down_residual", "img", "S.", note=" (output)"),
    Tap("merger", "te_vision_merger", "img", "S.", block=AFTER, note=" (output, window order)"),
)
"""Where the vision tower computes each ``te_vision_*`` operator that is a module's tensor (the
module docstring's table); the Q/K/V split and the attention are recorded by ``_VisionGlue``."""


def vision_tower(text_encoder: torch.nn.Module) -> torch.nn.Module:
    """The ``Qwen2_5_VisionTransformerPretrainedModel`` of a ``Qwen2_5_VLForConditionalGeneration``.

    Raises:
        DriftToolError: as ``transformers_qwen25vl.language_model``; a model without that tower.
    """
    language_model(text_encoder)  # transformers' version and the model's class
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mod

    tower = getattr(getattr(text_encoder, "model", text_encoder), "visual", None)
    if not isinstance(tower, mod.Qwen2_5_VisionTransformerPretrainedModel):
        raise DriftToolError(f"expected a Qwen2.5-VL text encoder with its vision tower "
                             f"(Qwen2_5_VisionTransformerPretrainedModel), got {type(tower).__name__}")
    return tower


def text_encoder_weights(text_encoder: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The language model's parameters and the tower's under ``visual.``: the names of an edit
    run's ``text_encoder_weights`` (``drifttool.chain_edit``), so ``weight_digest`` equals it."""
    tower = vision_tower(text_encoder)
    return {**language_model_weights(text_encoder),
            **{"visual." + n: p.detach() for n, p in tower.named_parameters()}}


@dataclasses.dataclass
class _VisionGlue:
    """The capture function's state: the segments of the attention call in progress."""

    rt: Runtime
    delegate: str  # the tower's configured implementation, e.g. "sdpa"
    segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    calls: int = 0  # attention modules whose segments were recorded

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, **kwargs: Any) -> tuple[Any, Any]:
        """transformers' attention-function signature, one segment: query, key, value
        [1, H, n, Dh] (RoPE applied) → (output [1, n, H, Dh], weights or None)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
        out, weights = ALL_ATTENTION_FUNCTIONS.get_interface(self.delegate, eager)(
            module, query, key, value, attention_mask, **kwargs)
        self.segments.append((query, key, out))
        return out, weights

    def flush(self, block: int, rows: int) -> None:
        """Record the segments of block ``block``'s attention (``rows`` = N) and forget them."""
        got, self.segments = self.segments, []
        if sum(q.shape[2] for q, _, _ in got) != rows:
            raise DriftToolError(f"vision-tower capture: block {block}'s attention handed "
                                 f"{sum(q.shape[2] for q, _, _ in got)} of {rows} rows to the capture "
                                 "function (a path that bypasses AttentionInterface)")
        q = torch.cat([s[0] for s in got], dim=2)[0].transpose(0, 1)  # [1, H, N, Dh] -> [N, H, Dh]
        k = torch.cat([s[1] for s in got], dim=2)[0].transpose(0, 1)
        a = torch.cat([s[2] for s in got], dim=1)[0]  # [1, N, H, Dh] -> [N, H, Dh]
        record(self.rt, "te_vision_rope", "img", (q, k), ("S..", "S.."), actual="transformers",
               kernel="transformers:apply_rotary_pos_emb_vision (attention-function arguments, "
                      "segments joined)", block=block)
        record(self.rt, "te_vision_attention", "img", a, "S..", actual="transformers",
               kernel=f"transformers:ALL_ATTENTION_FUNCTIONS[{self.delegate!r}] per segment",
               block=block)
        self.calls += 1


@contextlib.contextmanager
def _registered(text_encoder: torch.nn.Module, tower: torch.nn.Module, glue: _VisionGlue) -> Iterator[None]:
    """``glue`` registered with ``AttentionInterface`` and the tower's implementation switched to
    it for the block; both undone on exit."""
    from transformers import AttentionInterface

    if VISION_CAPTURE_IMPLEMENTATION in AttentionInterface._global_mapping:
        raise DriftToolError(f"another vision-tower capture is active (attention implementation "
                             f"{VISION_CAPTURE_IMPLEMENTATION!r} is registered)")
    key = next((k for k in getattr(text_encoder.config, "sub_configs", {})
                if getattr(text_encoder.config, k, None) is tower.config), None)
    if key is None:
        raise DriftToolError("vision-tower capture: the text encoder's config holds no vision_config "
                             "of its tower")
    AttentionInterface.register(VISION_CAPTURE_IMPLEMENTATION, glue)
    try:
        text_encoder.set_attn_implementation({key: VISION_CAPTURE_IMPLEMENTATION})
        try:
            if tower.config._attn_implementation != VISION_CAPTURE_IMPLEMENTATION:
                raise DriftToolError(f"vision-tower capture: the tower's attention implementation stayed "
                                     f"{tower.config._attn_implementation!r}")
            yield
        finally:
            text_encoder.set_attn_implementation({key: glue.delegate})
    finally:
        AttentionInterface._global_mapping.pop(VISION_CAPTURE_IMPLEMENTATION, None)


def _qkv_hook(rt: Runtime, block: int, heads: int) -> Callable:
    def hook(module, args, out):  # out [N, 3·H·Dh] -> q, k, v [N, H, Dh], as the attention splits it
        q, k, v = out.reshape(out.shape[0], 3, heads, -1).unbind(1)
        record(rt, "te_vision_qkv", "img", (q, k, v), ("S..",) * 3, actual="transformers",
               kernel=f"transformers:blocks.{block}.attn.qkv (q, k, v)", block=block)
    return hook


def _attention_done(glue: _VisionGlue, block: int) -> Callable:
    def hook(module, args, kwargs, out):
        rows = (args[0] if args else kwargs["hidden_states"]).shape[0]
        glue.flush(block, rows)
    return hook


@contextlib.contextmanager
def instrument_vision(text_encoder: torch.nn.Module, rt: Runtime) -> Iterator[_VisionGlue]:
    """Hook ``text_encoder``'s vision tower for the block: every tower forward inside records its
    ``te_vision_*`` operator outputs into ``rt`` (the caller's scope, whose block is replaced per
    operator). Yields the glue (``calls``: attention modules recorded).

    Raises:
        DriftToolError: not a Qwen2.5-VL text encoder with a vision tower; another capture
            active; (during a forward) attention rows that bypassed the capture function;
            (on exit, after a forward) a capture point that never fired.
        UnsupportedConfigError: a flash-attention implementation for the tower (its varlen
            call over every segment at once is a path the capture function would change).
    """
    tower = vision_tower(text_encoder)
    cfg = tower.config
    delegate = cfg._attn_implementation or "eager"
    if "flash" in delegate:
        raise UnsupportedConfigError(f"vision-tower capture: attention implementation {delegate!r} (one varlen "
                                     "call over every segment) is not captured; load the text encoder with "
                                     "sdpa or eager")
    glue = _VisionGlue(rt, delegate)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_registered(text_encoder, tower, glue))
        for i, blk in enumerate(tower.blocks):
            stack.callback(blk.attn.qkv.register_forward_hook(_qkv_hook(rt, i, cfg.num_heads)).remove)
            stack.callback(blk.attn.register_forward_hook(_attention_done(glue, i), with_kwargs=True).remove)
        stack.enter_context(tap_modules(tower, VISION_TAPS, rt, actual="transformers", depth=cfg.depth,
                                        require_all=True))
        yield glue
