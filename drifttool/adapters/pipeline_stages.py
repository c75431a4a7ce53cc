"""The stages around a diffusers Qwen-Image pipeline's denoising loop, captured as drifttool's
chain captures them (``drifttool.chain``, ``drifttool.chain_edit``): the text encoder, the VAE
encode of an edit pipeline's condition images, the VAE decode.

    >>> log = StageLog()
    >>> with text_encoder_stage(pipe, early_rt, log), vae_encode_stage(pipe, early_rt, log):
    ...     pipe(prompt="a red cube", ...)      # the decode: vae_decode_stage(pipe, rt, fields, log)
    >>> log.stages(steps=50)                  # the manifest's ``stages``
    [{'stage': 'text_encoder', 'component': 'text_encoder', 'step': -1, 'calls': 2, ...}, ...]

Each stage is a ``with`` block of hooks (``diffusers_vae``, ``transformers_qwen25vl``) and
instance-method wrappers (``pipeline_hooks.method_tap``) that set the identity scope drifttool's
chain sets and record what the pipeline computes inline, where its tensor is observable:

=====================  ==========================================================================
stage (component)      scope, and what is recorded besides the model's own operators
=====================  ==========================================================================
text_encoder           ``_get_qwen_prompt_embeds`` (each call: the prompts, then the negative
(text_encoder)         prompts): phase rollout, step −1, branch none, samples 0..B−1, block per
                       operator, ``txt_lens`` = each prompt's token count (the text encoder's
                       ``attention_mask``, read by a forward pre-hook); its return is
                       ``te_prompt_extract`` (block = layers, ``txt_lens`` = kept rows); an
                       edit pipeline's prompt images (the edit-plus pipeline's several, each
                       resized apart by the pipeline): ``pipeline_prompt_images``
vae_encode (vae)       ``_encode_vae_image`` (each condition image): step −1, sample 0; its return
                       is ``vae_latent_normalize`` ((z − mean)/std, block −1); the condition's
                       ``_pack_latents`` that follows is ``latent_pack_unpack`` (pack, its first
                       row: the pipeline repeats the image's latents per sample)
vae_decode (vae)       after the loop, step = steps run, σ = the table's σ at that step, samples
                       0..B−1: ``_unpack_latents``' return is ``latent_pack_unpack`` (unpack);
                       ``vae.decode``'s argument is ``vae_latent_normalize`` (the inverse,
                       ``z / (1/std) + mean``, inline in the pipeline)
=====================  ==========================================================================

The text encoder and the VAE encode run before the transformer's first call, so before the
artifact opens: they record into an early runtime whose recorder is a
``chain.DeferredCapture``, filed first into the artifact when it opens.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator

import torch

from drifttool.adapters import diffusers_vae, transformers_qwen25vl, transformers_qwen25vl_vision
from drifttool.adapters.pipeline_hooks import method_tap
from drifttool.adapters.pipeline_prompt_images import PromptImages
from drifttool.adapters.taps import record
from drifttool.artifact.manifest_schema import STAGES
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.model.weights import weight_digest
from drifttool.runtime import Runtime

EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
"""The pipelines whose ``_encode_vae_image`` encodes condition images (``vae_encode_stage``)."""

_UNSET = dict(sigma=math.nan, branch="none", txt_starts=None, img_grid=None, cond_grids=None)


@dataclass
class StageLog:
    """What each stage captured in one pipeline call (the manifest's ``stages``)."""

    prompts: list[list[str]] = field(default_factory=list)  # per text-encoder call
    prompt_positions: str | None = None  # an edit pipeline's prompt encode: its position rule
    text_encoder_weights: str | None = None
    conditions: int = 0  # condition images encoded
    decodes: int = 0
    decode_step: int | None = None
    vae_weights: str | None = None

    def stages(self, steps: int) -> list[dict[str, Any]]:
        """The stages captured, in program order (``steps``: scheduler steps the transformer
        stage ran)."""
        out = []
        if self.prompts:
            out.append({"stage": "text_encoder", "component": "text_encoder", "step": -1,
                        "calls": len(self.prompts), "prompts": self.prompts,
                        "weights": self.text_encoder_weights,
                        **({"prompt_positions": self.prompt_positions} if self.prompt_positions else {})})
        if self.conditions:
            out.append({"stage": "vae_encode", "component": "vae", "step": -1,
                        "calls": self.conditions, "weights": self.vae_weights})
        out.append({"stage": "transformer", "component": "mmdit", "step": 0, "calls": steps})
        if self.decodes:
            out.append({"stage": "vae_decode", "component": "vae", "step": self.decode_step,
                        "calls": self.decodes, "weights": self.vae_weights})
        return out


def _vae_digest(log: StageLog, vae: torch.nn.Module) -> None:
    if log.vae_weights is None:
        log.vae_weights = weight_digest(vae)


def select_stages(pipe: Any, kwargs: dict[str, Any], stages: Collection[str] | None) -> frozenset[str]:
    """The stages to capture of a pipeline call (``kwargs``, ``output_type`` set): ``stages``
    (``STAGES`` names; None: all of them, each when the call runs it), after refusing, before
    anything runs, what the capture cannot record.

    Raises:
        UnsupportedConfigError: an unknown stage, or none of the transformer; neither
            ``prompt_embeds`` nor prompt strings with a text encoder; prompt strings with
            ``num_images_per_prompt`` > 1 (text encoder captured); a pipeline that VAE-encodes
            images other than the edit pipelines' conditions (image-to-image, inpainting); a VAE
            that will run captured but that ``diffusers_vae`` refuses.
    """
    want = frozenset(STAGES if stages is None else stages)
    if not want <= set(STAGES) or "transformer" not in want:
        raise UnsupportedConfigError(f"capture_pipeline stages {sorted(want)}: from {', '.join(STAGES)}, "
                                     "the transformer included")
    if kwargs.get("prompt_embeds") is None:
        if kwargs.get("prompt") is None or getattr(pipe, "text_encoder", None) is None:
            raise UnsupportedConfigError("capture_pipeline needs prompt strings and a pipeline with its "
                                         "text encoder, or prompt_embeds (and their mask)")
        if kwargs.get("num_images_per_prompt", 1) != 1 and "text_encoder" in want:
            raise UnsupportedConfigError("capture_pipeline with prompt strings: num_images_per_prompt "
                                         "must be 1 (give one prompt per sample, as drifttool run does)")
    vae = getattr(pipe, "vae", None)
    encode = vae is not None and hasattr(pipe, "_encode_vae_image") and "vae_encode" in want
    if encode and type(pipe).__name__ not in EDIT_PIPELINES:
        raise UnsupportedConfigError(f"capture_pipeline: {type(pipe).__name__} encodes images with its VAE "
                                     f"outside the edit pipelines' condition path ({', '.join(EDIT_PIPELINES)})")
    if encode or (vae is not None and kwargs["output_type"] != "latent" and "vae_decode" in want):
        for part in diffusers_vae.PARTS:
            diffusers_vae.taps(vae, part)
        diffusers_vae.check_vae(vae)
    return want


# -- the text encoder ------------------------------------------------------------------------------
@contextlib.contextmanager
def text_encoder_stage(pipe: Any, rt: Runtime, log: StageLog) -> Iterator[None]:
    """Capture every ``_get_qwen_prompt_embeds`` call of ``pipe`` into ``rt`` (module docstring);
    nothing when the pipeline holds no text encoder.

    Raises:
        UnsupportedConfigError: an edit pipeline's image processor that is not captured
            (``pipeline_prompt_images.PromptImages``); (at the call) as ``PromptImages.call``.
        DriftToolError: as ``transformers_qwen25vl.instrument``; the text encoder called outside
            ``_get_qwen_prompt_embeds``.
    """
    te = getattr(pipe, "text_encoder", None)
    if te is None or not hasattr(pipe, "_get_qwen_prompt_embeds"):
        yield
        return
    lm = transformers_qwen25vl.language_model(te)
    vision = "image" in inspect.signature(pipe._get_qwen_prompt_embeds).parameters
    # an edit pipeline's prompt images; refuses an image processor that is not captured
    images = PromptImages(pipe, rt) if vision else None
    calls: list[contextlib.ExitStack] = []  # the encode call in progress

    def pre(module, args, kwargs):
        if not calls:
            raise DriftToolError("text-encoder capture: the text encoder ran outside the pipeline's "
                                 "_get_qwen_prompt_embeds (no prompt scope)")
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        lens = mask.sum(dim=1).tolist() if mask is not None else [int(ids.shape[1])] * int(ids.shape[0])
        calls[-1].enter_context(rt.scope(txt_lens=[int(n) for n in lens]))

    def around(original, prompt=None, *args, **kwargs):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        samples = list(range(len(prompts)))
        with contextlib.ExitStack() as stack:
            stack.enter_context(rt.scope(component="text_encoder", phase="rollout", step=-1, block=-1,
                                         samples=samples, txt_lens=None, **_UNSET))
            if images is not None:
                image = kwargs["image"] if "image" in kwargs else (args[0] if args else None)
                stack.enter_context(images.call(samples, image))
            calls.append(stack)
            try:
                embeds, mask = original(prompt, *args, **kwargs)  # [B, L', D], [B, L'] int64
            finally:
                calls.pop()
            kept = [int(n) for n in mask.sum(dim=1).tolist()]
            with rt.scope(block=lm.config.num_hidden_layers, txt_lens=kept):
                record(rt, "te_prompt_extract", "txt", (embeds, mask), ("BS.", "BS"),
                       actual="diffusers",
                       kernel=f"diffusers:{type(pipe).__name__}._get_qwen_prompt_embeds (return)")
        log.prompts.append(prompts)
        if images is not None and images.positions is not None:
            log.prompt_positions = images.positions
        if log.text_encoder_weights is None:
            log.text_encoder_weights = weight_digest(  # an edit run's digest holds the vision tower
                transformers_qwen25vl_vision.text_encoder_weights(te) if images is not None
                else transformers_qwen25vl.language_model_weights(te))
        return embeds, mask

    with contextlib.ExitStack() as stack:
        stack.enter_context(transformers_qwen25vl.instrument(te, rt))
        if images is not None:
            stack.enter_context(images.installed())
        stack.callback(te.register_forward_pre_hook(pre, with_kwargs=True).remove)
        stack.enter_context(method_tap(pipe, "_get_qwen_prompt_embeds", around))
        yield


# -- the VAE encode of an edit pipeline's condition images -----------------------------------------
@contextlib.contextmanager
def vae_encode_stage(pipe: Any, rt: Runtime, log: StageLog) -> Iterator[None]:
    """Capture every ``_encode_vae_image`` call of an edit pipeline, and the ``_pack_latents``
    of its result, into ``rt`` (module docstring); nothing for a pipeline without condition
    images.

    Raises:
        UnsupportedConfigError: (at the call) more than one image in one encode; as
            ``diffusers_vae.instrument``.
    """
    vae = getattr(pipe, "vae", None)
    if vae is None or not hasattr(pipe, "_encode_vae_image"):
        yield
        return
    scope = dict(component="vae", phase="rollout", step=-1, block=-1, samples=[0], txt_lens=None,
                 **_UNSET)
    pending: list[bool] = []

    def encode(original, image, *args, **kwargs):
        if image.shape[0] != 1:
            raise UnsupportedConfigError(f"VAE capture: {image.shape[0]} images in one condition encode "
                                         "(drifttool encodes each condition image once)")
        with rt.scope(**scope):
            z = original(image, *args, **kwargs)  # [1, z_dim, 1, h, w], normalised
            record(rt, "vae_latent_normalize", "none", z, "B....", actual="diffusers",
                   kernel=f"diffusers:{type(pipe).__name__}._encode_vae_image ((z - mean) / std, return)")
        pending.append(True)
        log.conditions += 1
        _vae_digest(log, vae)
        return z

    def pack(original, *args, **kwargs):
        out = original(*args, **kwargs)  # [B, N, 4·z_dim]
        if pending:
            pending.clear()
            with rt.scope(**scope):
                record(rt, "latent_pack_unpack", "none", out[:1], "B..", actual="diffusers",
                       kernel=f"diffusers:{type(pipe).__name__}._pack_latents (condition, first row)")
        return out

    with contextlib.ExitStack() as stack:
        stack.enter_context(diffusers_vae.instrument(vae, rt, "encoder"))
        stack.enter_context(method_tap(pipe, "_encode_vae_image", encode))
        stack.enter_context(method_tap(pipe, "_pack_latents", pack))
        yield


# -- the VAE decode after the loop -----------------------------------------------------------------
@contextlib.contextmanager
def vae_decode_stage(pipe: Any, rt: Runtime, fields: Callable[[], dict[str, Any]],
                     log: StageLog) -> Iterator[None]:
    """Capture the pipeline's decode after its loop into ``rt`` (module docstring);
    ``fields()`` gives the decode's ``step``, ``sigma`` and ``samples`` when it starts.

    Raises:
        UnsupportedConfigError, DriftToolError: as ``diffusers_vae.instrument``.
    """
    vae = getattr(pipe, "vae", None)
    if vae is None:
        yield
        return
    name = type(pipe).__name__

    def scope():
        return rt.scope(component="vae", phase="rollout", block=-1, txt_lens=None, **{**_UNSET, **fields()})

    def unpack(original, *args, **kwargs):
        out = original(*args, **kwargs)  # [B, z_dim, 1, H', W']
        with scope():
            record(rt, "latent_pack_unpack", "none", out, "B....", actual="diffusers",
                   kernel=f"diffusers:{name}._unpack_latents")
        return out

    def decode(original, z, *args, **kwargs):
        with scope():
            record(rt, "vae_latent_normalize", "none", z, "B....", actual="diffusers",
                   kernel=f"diffusers:{name}.__call__ (z / (1/std) + mean, inline: vae.decode's argument)")
            out = original(z, *args, **kwargs)
        log.decodes += 1
        log.decode_step = int(fields()["step"])
        _vae_digest(log, vae)
        return out

    with contextlib.ExitStack() as stack:
        stack.enter_context(diffusers_vae.instrument(vae, rt, "decoder"))
        stack.enter_context(method_tap(pipe, "_unpack_latents", unpack))
        stack.enter_context(method_tap(vae, "decode", decode))
        yield
