"""The prompt images of an edit pipeline's prompt encode, captured as drifttool's edit prompt
encode records them (``drifttool.text_encoder.encode``): the image processor's results, the vision
tower, the positions and the scatter of the vision embeddings into the prompt.

    >>> images = PromptImages(pipe, rt)
    >>> with images.installed():                # inside text_encoder_stage
    ...     with images.call(samples=[0], image=prompt_image):   # around _get_qwen_prompt_embeds
    ...         pipe._get_qwen_prompt_embeds(prompt, image, device)
    >>> images.positions                        # the position rule the language model got
    'sequential'

=========================  ======================================================================
record (block −1)          observed at
=========================  ======================================================================
te_vision_resize           ``processor.image_processor.resize``'s return (wrapped on the
                           instance): [3, h, w] uint8 as [1, h, w, 3], under the image's sample
te_vision_patchify         ``processor.image_processor.patchify``'s return (wrapped): the patches
                           [N, 3·T·P·P] fp32 as [1, N, …] and the grid (1, h/P, w/P) as [1, 3];
                           the rescale and normalize before it are its arithmetic, as in drifttool
te_vision_* of the tower   ``transformers_qwen25vl_vision.instrument_vision``
te_vision_rope_index       the ``position_ids`` the language model is handed (forward pre-hook),
                           when it is handed any: the ``rope_index`` rule
te_vision_scatter          the ``inputs_embeds`` the language model is handed (forward pre-hook)
=========================  ======================================================================

A prompt's image records are made with the identities they have alone (``Runtime.parts``), under
the sample of the prompt (image k of the call → prompt k; one prompt: every image is its, as the
edit-plus pipeline's one prompt takes each of its condition images, resized to its prompt area,
in order, as drifttool's ``EDIT_PLUS`` encode does). The
processor's expansion of ``<|image_pad|>`` and its tokenization are ``te_tokenize``'s, which
drifttool traces and neither side captures. Positions: transformers 5.x computes the multimodal
RoPE index only when the text encoder is given ``mm_token_type_ids``, which diffusers' edit
pipelines do not pass; the language model then gets no ``position_ids`` and makes 0…L−1 itself:
the ``sequential`` rule, which has no operator record on either side (``positions`` names the
rule, for the manifest).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch

from drifttool.adapters.pipeline_hooks import method_tap
from drifttool.adapters.taps import record
from drifttool.adapters.transformers_qwen25vl import language_model
from drifttool.adapters.transformers_qwen25vl_vision import instrument_vision
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.runtime import Runtime

IMAGE_PROCESSORS = ("Qwen2VLImageProcessorPil",)
"""The image processors whose arithmetic drifttool's ``te_vision_resize``/``te_vision_patchify``
are (transformers' PIL backend; the torchvision backend resizes with other bytes)."""


class PromptImages:
    """Capture state of one pipeline call's prompt images (module docstring).

    Attributes:
        positions: the position rule of the last encode with images (``"sequential"`` or
            ``"rope_index"``), None before one ran.
    """

    def __init__(self, pipe: Any, rt: Runtime) -> None:
        self.pipe, self.rt = pipe, rt
        self.te = pipe.text_encoder
        self.processor = getattr(getattr(pipe, "processor", None), "image_processor", None)
        if type(self.processor).__name__ not in IMAGE_PROCESSORS:
            raise UnsupportedConfigError(
                f"{type(pipe).__name__}'s image processor {type(self.processor).__name__} is not captured "
                f"(drifttool's te_vision_resize/te_vision_patchify are {', '.join(IMAGE_PROCESSORS)}'s)")
        self.positions: str | None = None
        self._samples: list[int] | None = None  # per image of the encode call in progress
        self._images: int = 0  # images preprocessed in the call in progress
        self._with_pixels = False  # the text encoder's forward in progress got pixel_values
        self._part: Any = None  # Runtime.parts' part() of the processor call in progress
        self._image: contextlib.ExitStack | None = None  # the part of the prompt whose images run
        self._resized = False  # an image resized, its patchify to come

    @contextlib.contextmanager
    def call(self, samples: list[int], image: Any) -> Iterator[None]:
        """Around one ``_get_qwen_prompt_embeds(prompt, image)``: ``samples`` of its prompts.

        Raises:
            UnsupportedConfigError: several prompts and a number of images that is not one per
                prompt (one prompt takes any number: edit-plus).
        """
        n = len(image) if isinstance(image, (list, tuple)) else int(image is not None)
        if len(samples) > 1 and n != len(samples):
            raise UnsupportedConfigError(f"an edit prompt encode of {len(samples)} prompts with {n} image(s): "
                                         "drifttool encodes one image per prompt")
        self._samples = list(samples) if len(samples) == n else [samples[0]] * n
        self._images = 0
        try:
            yield
        finally:
            self._samples = None

    # -- the image processor ------------------------------------------------------------------
    def _preprocess(self, original, *args, **kwargs):
        if self._samples is None:
            return original(*args, **kwargs)  # a processor call outside the prompt encode
        with self.rt.parts() as part:
            self._part, self._resized = part, False
            try:
                return original(*args, **kwargs)
            finally:
                self._part = None
                self._close_image()

    def _close_image(self) -> None:
        if self._image is not None:
            stack, self._image = self._image, None
            stack.close()

    def _resize(self, original, image, *args, **kwargs):
        out = original(image, *args, **kwargs)  # [3, h, w] uint8 (channels first)
        if self._part is None:
            return out
        if self._images >= len(self._samples):
            raise DriftToolError(f"prompt-image capture: the processor resized image {self._images + 1} of "
                                 f"{len(self._samples)} handed to the prompt encode")
        sample = self._samples[self._images]
        if self._image is None or self._images == 0 or self._samples[self._images - 1] != sample:
            self._close_image()  # a prompt's images: one part, the identities they have alone
            self._image = contextlib.ExitStack()
            self._image.enter_context(self._part(samples=[sample], block=-1, txt_lens=None, txt_starts=None))
        self._images += 1
        self._resized = True
        pixels = torch.from_numpy(np.ascontiguousarray(out)).permute(1, 2, 0).unsqueeze(0).contiguous()
        record(self.rt, "te_vision_resize", "img", pixels, "B...", actual="transformers",
               kernel=f"transformers:{type(self.processor).__name__}.resize (return, as [1, h, w, 3])")
        return out

    def _patchify(self, original, *args, **kwargs):
        out = original(*args, **kwargs)  # (patches [N, 3·T·P·P] fp32, grid_h, grid_w)
        if self._part is None:
            return out
        if not self._resized:
            raise UnsupportedConfigError("prompt-image capture: an image patchified without the processor's "
                                         "resize (do_resize=False): drifttool's te_vision_resize always runs")
        self._resized = False
        patches, gh, gw = out
        pixels = torch.from_numpy(np.ascontiguousarray(patches, dtype=np.float32)).unsqueeze(0)
        grid = torch.tensor([[1, int(gh), int(gw)]], dtype=torch.int64)
        record(self.rt, "te_vision_patchify", "img", (pixels, grid), ("BS.", "B."), actual="transformers",
               kernel=f"transformers:{type(self.processor).__name__}.rescale+normalize+patchify (patchify's return)")
        return out

    # -- the text encoder ---------------------------------------------------------------------
    def _te_pre(self, module, args, kwargs) -> None:
        self._with_pixels = kwargs.get("pixel_values") is not None

    def _lm_pre(self, module, args, kwargs) -> None:
        if not self._with_pixels:
            return
        pos, embeds = kwargs.get("position_ids"), kwargs.get("inputs_embeds")
        if embeds is None:
            raise DriftToolError("prompt-image capture: the language model was not handed the scattered "
                                 "inputs_embeds")
        if pos is None:
            self.positions = "sequential"  # 0…L−1, made inside the language model: no operator
        elif pos.dim() == 3 and pos.shape[0] == 3:
            self.positions = "rope_index"
            record(self.rt, "te_vision_rope_index", "txt", pos, ".BS", actual="transformers",
                   kernel="transformers:Qwen2_5_VLModel.get_rope_index (language model's position_ids)",
                   block=-1)
        else:
            raise UnsupportedConfigError(f"prompt-image capture: language-model position_ids of shape "
                                         f"{list(pos.shape)} (drifttool makes [3, B, L] or 0…L−1)")
        record(self.rt, "te_vision_scatter", "txt", embeds, "BS.", actual="transformers",
               kernel="transformers:Qwen2_5_VLModel.forward (masked_scatter; language model's inputs_embeds)",
               block=-1)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Every hook and wrapper of the module docstring, removed on exit (also on error)."""
        lm = language_model(self.te)
        with contextlib.ExitStack() as stack:
            stack.enter_context(instrument_vision(self.te, self.rt))
            stack.callback(self.te.register_forward_pre_hook(self._te_pre, with_kwargs=True).remove)
            stack.callback(lm.register_forward_pre_hook(self._lm_pre, with_kwargs=True).remove)
            for name, around in (("_preprocess", self._preprocess), ("resize", self._resize),
                                 ("patchify", self._patchify)):
                stack.enter_context(method_tap(self.processor, name, around))
            stack.callback(self._close_image)
            yield
