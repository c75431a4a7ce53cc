"""The vision side of a Qwen2.5-VL text encoder: the vision tower's shape (``config.json``'s
``vision_config``) and the image processor's settings (``processor/preprocessor_config.json``).

    >>> v = VisionConfig.from_file("Qwen-Image-Edit/text_encoder/config.json")
    >>> v.depth, v.hidden_size, v.heads, v.out_hidden_size, v.fullatt_blocks
    (32, 1280, 16, 3584, (7, 15, 23, 31))
    >>> p = ImageProcessorConfig.from_folder("tiny-pipeline")       # no processor/: the defaults
    >>> p.min_pixels, p.max_pixels, p.factor
    (3136, 1003520, 28)

Both layouts of ``config.json`` are read (transformers 5.x and 4.x as Qwen-Image ships it:
``in_chans``, no ``rope_parameters``). The processor settings are those of transformers'
``Qwen2VLImageProcessor`` (its PIL backend, ``Qwen2VLImageProcessorPil``: the one transformers
5.x picks without torchvision): a folder without ``processor/preprocessor_config.json`` gets that
class's defaults (``min_pixels`` 56², ``max_pixels`` 28²·1280, bicubic, CLIP mean and std).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drifttool.errors import CheckpointError, UnsupportedConfigError
from drifttool.model.checkpoint_files import read_json_object

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """The Qwen2.5-VL vision tower (``Qwen2_5_VisionTransformerPretrainedModel``).

    Attributes:
        depth: blocks.  hidden_size, intermediate_size: widths.  heads: attention heads
            (head_dim = hidden_size / heads).  out_hidden_size: the merger's output width (the
            language model's hidden size).
        patch_size, temporal_patch_size: a patch is ``3 × temporal × patch × patch`` pixels.
        spatial_merge_size: the merger joins ``merge × merge`` patches into one token.
        window_size: window-attention side in pixels.  fullatt_blocks: blocks with full
            attention over each image (the others attend within windows).
        rope_theta: the axial RoPE base.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_blocks: tuple[int, ...]
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch: 3 · temporal · patch · patch (1176 for 2 × 14 × 14)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def window_tokens(self) -> int:
        """Merged tokens along a window's side (112 / 14 / 2 = 4)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "VisionConfig":
        """Raises ``CheckpointError`` without a ``vision_config`` (or a field of it) and
        ``UnsupportedConfigError`` for a tower drifttool does not run."""
        v = raw.get("vision_config")
        if not isinstance(v, dict):
            raise CheckpointError(f"{source}: no vision_config (a text-only encoder cannot encode edit prompts)")
        rope = v.get("rope_parameters") or {}
        try:
            cfg = cls(depth=int(v["depth"]), hidden_size=int(v["hidden_size"]),
                      intermediate_size=int(v["intermediate_size"]), heads=int(v["num_heads"]),
                      out_hidden_size=int(v["out_hidden_size"]), patch_size=int(v["patch_size"]),
                      temporal_patch_size=int(v["temporal_patch_size"]),
                      spatial_merge_size=int(v["spatial_merge_size"]), window_size=int(v["window_size"]),
                      fullatt_blocks=tuple(int(i) for i in v["fullatt_block_indexes"]),
                      rope_theta=float(rope.get("rope_theta", 10000.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: not a Qwen2.5-VL vision config ({e!r} missing or invalid)") from None
        channels = int(v.get("in_channels", v.get("in_chans", 3)))
        if v.get("hidden_act", "silu") != "silu" or channels != 3 or rope.get("rope_type", "axial") != "axial":
            raise UnsupportedConfigError(f"{source}: drifttool runs Qwen2.5-VL's vision tower with a SiLU MLP, "
                                         "3 input channels and axial RoPE only")
        m = cfg.spatial_merge_size
        if cfg.hidden_size % cfg.heads or cfg.head_dim % 4 or cfg.window_size % (m * cfg.patch_size) \
                or cfg.window_tokens < 1 or min(cfg.depth, m, cfg.patch_size, cfg.temporal_patch_size) < 1:
            raise UnsupportedConfigError(f"{source}: vision width {cfg.hidden_size} / {cfg.heads} heads (head_dim "
                                         f"a multiple of 4), window {cfg.window_size} px (a multiple of "
                                         f"merge × patch = {m * cfg.patch_size}) do not fit together")
        if any(not 0 <= i < cfg.depth for i in cfg.fullatt_blocks):
            raise UnsupportedConfigError(f"{source}: fullatt_block_indexes {cfg.fullatt_blocks} outside 0..{cfg.depth - 1}")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "VisionConfig":
        return cls.from_dict(read_json_object(Path(path)), str(path))


@dataclass(frozen=True, kw_only=True)
class ImageProcessorConfig:
    """What ``Qwen2VLImageProcessor`` does to a prompt image (``ops.text_encoder.vision_input``).

    Attributes:
        min_pixels, max_pixels: the smart resize's pixel-count bounds.
        patch_size, temporal_patch_size, merge_size: as the vision tower's.
        image_mean, image_std: per channel (R, G, B).  rescale_factor: 1/255.
        resample: the Pillow filter of the resize (3: bicubic).
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = BICUBIC

    @property
    def factor(self) -> int:
        """Resized sides are multiples of patch · merge (28)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "preprocessor_config") -> "ImageProcessorConfig":
        """transformers' reading of the file: ``min_pixels`` / ``max_pixels`` override
        ``size``'s ``shortest_edge`` / ``longest_edge``.

        Raises:
            UnsupportedConfigError: a step switched off (``do_resize``, ``do_rescale``,
                ``do_normalize``, ``do_convert_rgb`` false) or bounds that do not fit.
            CheckpointError: a field of the wrong type.
        """
        off = [k for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb") if raw.get(k, True) is False]
        if off:
            raise UnsupportedConfigError(f"{source}: {', '.join(off)} false; drifttool runs the processor's "
                                         "resize, rescale, normalize and RGB conversion")
        size, d = raw.get("size") or {}, cls()
        try:
            cfg = cls(min_pixels=int(raw.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", d.min_pixels)))),
                      max_pixels=int(raw.get("max_pixels", size.get("longest_edge", size.get("max_pixels", d.max_pixels)))),
                      patch_size=int(raw.get("patch_size", d.patch_size)),
                      temporal_patch_size=int(raw.get("temporal_patch_size", d.temporal_patch_size)),
                      merge_size=int(raw.get("merge_size", d.merge_size)),
                      image_mean=tuple(float(x) for x in raw.get("image_mean", d.image_mean)),
                      image_std=tuple(float(x) for x in raw.get("image_std", d.image_std)),
                      rescale_factor=float(raw.get("rescale_factor", d.rescale_factor)),
                      resample=int(raw.get("resample", d.resample)))
        except (AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: not a Qwen2-VL image processor config ({e})") from None
        if not 0 < cfg.min_pixels <= cfg.max_pixels or len(cfg.image_mean) != 3 or len(cfg.image_std) != 3 \
                or min(cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size) < 1:
            raise UnsupportedConfigError(f"{source}: pixel bounds {cfg.min_pixels}..{cfg.max_pixels}, 3 means and "
                                         "stds and positive patch sizes are needed")
        return cfg

    @classmethod
    def from_folder(cls, pipeline: str | Path) -> "ImageProcessorConfig":
        """``pipeline/processor/preprocessor_config.json``, or the class defaults without it."""
        path = Path(pipeline) / "processor" / "preprocessor_config.json"
        return cls.from_dict(read_json_object(path), str(path)) if path.is_file() else cls()

    def check_tower(self, tower: VisionConfig, source: str = "processor") -> None:
        """Raises ``UnsupportedConfigError`` when the patch geometry is not the tower's."""
        mine = (self.patch_size, self.temporal_patch_size, self.merge_size)
        theirs = (tower.patch_size, tower.temporal_patch_size, tower.spatial_merge_size)
        if mine != theirs:
            raise UnsupportedConfigError(f"{source}: patch/temporal/merge sizes {mine} differ from the vision "
                                         f"tower's {theirs}")
