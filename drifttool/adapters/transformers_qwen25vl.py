"""Capture adapter for transformers' Qwen2.5-VL text encoder (``Qwen2_5_VLForConditionalGeneration``
as a diffusers Qwen-Image pipeline holds it in ``pipe.text_encoder``): its language model's operator
outputs recorded as drifttool's own text encoder records them (``drifttool.text_encoder.model``).

    >>> with instrument(pipe.text_encoder, rt):      # rt's scope: component text_encoder, step −1
    ...     pipe.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    >>> # rt's recorder now holds te_embed_tokens, then per layer te_rmsnorm ... te_mlp_down_residual

Inside ``instrument`` the table ``TAPS`` (module path of the language model → ``te_*`` operator,
layout) becomes forward hooks and pre-hooks (``drifttool.adapters.taps``), and the attention runs
through a capture function registered with transformers' own extension point: ``AttentionInterface``
(and ``AttentionMaskInterface``, so the causal and padding masks are the ones the configured
implementation gets) under ``CAPTURE_IMPLEMENTATION``, which records the RoPE'd query and key and
the attention output, then hands the call to the configured implementation (``sdpa`` as loaded);
the language model's attention implementation is switched to it for the block
(``set_attn_implementation``, the vision tower's untouched). On exit, also on error, the hooks are
removed, the implementation restored and both registrations withdrawn. Nothing is replaced at
module level; the hooks and the capture function only read tensors (the output bytes do not
change, tested).

======================================  =====================  =================================
language model (``Qwen2_5_VLTextModel``)  RFC operator           capture point
======================================  =====================  =================================
``embed_tokens``                        te_embed_tokens        output (block −1)
``layers.i.input_layernorm``            te_rmsnorm #0          output
``self_attn.q_proj/k_proj/v_proj``      te_qkv_bias_gemm       outputs, as [B, L, H(kv), Dh]
attention function: query, key          te_mrope (q, then k)   arguments, as [B, L, H(kv), Dh]
attention function: output              te_causal_attention    return [B, L, H, Dh]
``layers.i.post_attention_layernorm``   te_attn_out_residual   input (pre-hook)
``layers.i.post_attention_layernorm``   te_rmsnorm #1          output
``layers.i.mlp.down_proj``              te_mlp_gate_up_silu    input (pre-hook)
``layers.i`` output                     te_mlp_down_residual   output
``norm``                                te_rmsnorm             output (block = layers)
======================================  =====================  =================================

The identity scope (component ``text_encoder``, step −1, branch ``none``, samples, each prompt's
token count as ``txt_lens``) is the caller's: ``drifttool.adapters.pipeline_stages`` sets it
around the pipeline's ``_get_qwen_prompt_embeds``, which also gives ``te_prompt_extract``. Records
then equal drifttool's own production text encoder's record for record (same identities,
shapes and layouts), so the digests compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Iterator

import torch

from drifttool.adapters.taps import AFTER, BEFORE, Tap, record, tap_modules
from drifttool.errors import DriftToolError
from drifttool.runtime import Runtime

SUPPORTED_TRANSFORMERS = ("5.",)
"""transformers releases whose Qwen2.5-VL modules (``model.language_model``, ``layer_idx``) and
attention-function interface the table describes (5.24 tested; the ``[test]`` extra pins 5.x)."""

CAPTURE_IMPLEMENTATION = "drifttool_capture"
"""The name the capture function is registered under while a capture runs."""

_LAYER = "layers.*"
_ATTN = f"{_LAYER}.self_attn"

TAPS = (
    Tap("embed_tokens", "te_embed_tokens", "txt", block=BEFORE),
    Tap(f"{_LAYER}.input_layernorm", "te_rmsnorm", "txt"),
    Tap((f"{_ATTN}.q_proj", f"{_ATTN}.k_proj", f"{_ATTN}.v_proj"), "te_qkv_bias_gemm", "txt",
        "BS..", heads=True, note=" (q, k, v)"),
    Tap(f"{_LAYER}.post_attention_layernorm", "te_attn_out_residual", "txt", read="input",
        note=" (input: residual + o_proj)"),
    Tap(f"{_LAYER}.post_attention_layernorm", "te_rmsnorm", "txt"),
    Tap(f"{_LAYER}.mlp.down_proj", "te_mlp_gate_up_silu", "txt", read="input",
        note=" (input: act_fn(gate_proj) * up_proj)"),
    Tap(_LAYER, "te_mlp_down_residual", "txt", note=" (output)"),
    Tap("norm", "te_rmsnorm", "txt", block=AFTER),
)
"""Where the language model computes each ``te_*`` operator (module docstring's table); the RoPE
outputs and the attention are recorded by ``AttentionGlue``."""


def language_model(text_encoder: torch.nn.Module) -> torch.nn.Module:
    """The ``Qwen2_5_VLTextModel`` of a ``Qwen2_5_VLForConditionalGeneration`` (or of a
    ``Qwen2_5_VLModel``).

    Raises:
        DriftToolError: transformers missing or of an unsupported version
            (``SUPPORTED_TRANSFORMERS``), or not a Qwen2.5-VL model.
    """
    try:
        import transformers
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mod
    except ImportError as e:
        raise DriftToolError(f"the text-encoder capture needs transformers installed ({e})") from None
    if not transformers.__version__.startswith(SUPPORTED_TRANSFORMERS):
        raise DriftToolError(f"transformers {transformers.__version__} is not supported by the text-encoder "
                             f"capture (supported: {', '.join(v + 'x' for v in SUPPORTED_TRANSFORMERS)})")
    lm = getattr(getattr(text_encoder, "model", text_encoder), "language_model", None)
    if not isinstance(lm, mod.Qwen2_5_VLTextModel):
        raise DriftToolError(f"expected a transformers Qwen2.5-VL text encoder "
                             f"(Qwen2_5_VLForConditionalGeneration), got {type(text_encoder).__name__}")
    return lm


def language_model_weights(text_encoder: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The language model's parameters under their names in it (``embed_tokens.weight``,
    ``layers.0.self_attn.q_proj.weight``, ...): drifttool's text-encoder weight names
    (``drifttool.text_encoder.weights``), so ``weight_digest`` of it equals a chain run's
    ``text_encoder_weights``."""
    return {name: p.detach() for name, p in language_model(text_encoder).named_parameters()}


@dataclasses.dataclass
class AttentionGlue:
    """The capture function's state: the runtime, the implementation it delegates to and how
    many attention calls it saw."""

    rt: Runtime
    delegate: str  # the configured attention implementation, e.g. "sdpa"
    calls: int = 0

    def implementation(self, module: torch.nn.Module) -> Callable:
        """``ALL_ATTENTION_FUNCTIONS``' function of ``delegate`` (eager: the modeling module's)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.delegate, eager)

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Any, **kwargs: Any) -> tuple[Any, Any]:
        """transformers' attention-function signature: query [B, H, L, Dh], key and value
        [B, Hkv, L, Dh] (RoPE applied) → (output [B, L, H, Dh], weights or None)."""
        self.calls += 1
        block = int(module.layer_idx)
        for t in (query, key):  # te_mrope: q, then k, as [B, L, H(kv), Dh]
            record(self.rt, "te_mrope", "txt", t.transpose(1, 2), "BS..", actual="transformers",
                   kernel="transformers:apply_rotary_pos_emb (attention-function argument)",
                   block=block)
        out, weights = self.implementation(module)(module, query, key, value, attention_mask, **kwargs)
        record(self.rt, "te_causal_attention", "txt", out, "BS..", actual="transformers",
               kernel=f"transformers:ALL_ATTENTION_FUNCTIONS[{self.delegate!r}]", block=block)
        return out, weights


@contextlib.contextmanager
def _registered(glue: AttentionGlue) -> Iterator[None]:
    """``glue`` registered as ``CAPTURE_IMPLEMENTATION`` with ``AttentionInterface``, and the
    delegate's mask function under the same name with ``AttentionMaskInterface``; both
    registrations withdrawn on exit (transformers has no unregister: the class mappings that
    ``register`` writes are restored)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if CAPTURE_IMPLEMENTATION in AttentionInterface._global_mapping:
        raise DriftToolError(f"another text-encoder capture is active (attention implementation "
                             f"{CAPTURE_IMPLEMENTATION!r} is registered)")
    if glue.delegate not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise DriftToolError(f"text-encoder capture: attention implementation {glue.delegate!r} has "
                             "no mask function in transformers' AttentionMaskInterface")
    AttentionInterface.register(CAPTURE_IMPLEMENTATION, glue)
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS[glue.delegate])
    try:
        yield
    finally:
        AttentionInterface._global_mapping.pop(CAPTURE_IMPLEMENTATION, None)
        AttentionMaskInterface._global_mapping.pop(CAPTURE_IMPLEMENTATION, None)


@contextlib.contextmanager
def _attention_switched(text_encoder: torch.nn.Module, lm: torch.nn.Module, name: str) -> Iterator[None]:
    """The language model's attention implementation set to ``name`` for the block (its config's
    own key in the model's ``sub_configs`` when it has one, else the whole model), restored after."""
    before = lm.config._attn_implementation
    key = next((k for k in getattr(text_encoder.config, "sub_configs", {})
                if getattr(text_encoder.config, k, None) is lm.config), None)
    target = text_encoder if key is not None else lm
    request = (lambda impl: {key: impl}) if key is not None else (lambda impl: impl)
    target.set_attn_implementation(request(name))
    try:
        if lm.config._attn_implementation != name:
            raise DriftToolError(f"text-encoder capture: the language model's attention implementation "
                                 f"stayed {lm.config._attn_implementation!r}")
        yield
    finally:
        target.set_attn_implementation(request(before))


@contextlib.contextmanager
def instrument(text_encoder: torch.nn.Module, rt: Runtime) -> Iterator[AttentionGlue]:
    """Hook ``text_encoder``'s language model for the block: every forward inside records its
    ``te_*`` operator outputs into ``rt`` (the caller's scope). Yields the attention glue
    (``calls``: attention calls seen).

    Raises:
        DriftToolError: not a Qwen2.5-VL text encoder; another capture active; an attention
            implementation without a mask function; (on exit, after a forward) a capture point
            that never fired, or a forward whose attention bypassed the capture function.
    """
    lm = language_model(text_encoder)
    glue = AttentionGlue(rt, lm.config._attn_implementation or "eager")
    cfg = lm.config
    with contextlib.ExitStack() as stack:
        stack.enter_context(_registered(glue))
        stack.enter_context(_attention_switched(text_encoder, lm, CAPTURE_IMPLEMENTATION))
        hooks = stack.enter_context(_forward_counter(lm))
        stack.enter_context(tap_modules(lm, TAPS, rt, actual="transformers", depth=cfg.num_hidden_layers,
                                        head_dim=cfg.hidden_size // cfg.num_attention_heads,
                                        require_all=True))
        yield glue
        if hooks.calls and glue.calls != hooks.calls * cfg.num_hidden_layers:
            raise DriftToolError(f"text-encoder capture: {glue.calls} attention calls through the capture "
                                 f"function for {hooks.calls} forward(s) of {cfg.num_hidden_layers} layers")


@dataclasses.dataclass
class _Counter:
    calls: int = 0


@contextlib.contextmanager
def _forward_counter(module: torch.nn.Module) -> Iterator[_Counter]:
    """Count ``module``'s forwards for the block (a pre-hook, removed on exit)."""
    counter = _Counter()

    def pre(m, args):
        counter.calls += 1

    handle = module.register_forward_pre_hook(pre)
    try:
        yield counter
    finally:
        handle.remove()
