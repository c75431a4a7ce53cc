"""An edit run from its condition images: image → VAE encode → trajectory on the noisy and
condition tokens → VAE decode → PNG, every stage captured in one artifact.

    >>> summary = run_edit(RunSpec(fixture="tiny-edit", checkpoint=folder), "runs/e",
    ...                    condition_images=["cond.png"])
    >>> summary["images"]
    ['runs/e.png']

What ``QwenImageEditPipeline.__call__`` (diffusers 0.42.1) does with its ``image`` before the
loop, from an 8-bit RGB image of any size:

0. the resize to about ``vae_area`` pixels (1024², sides multiples of 32;
   ``drifttool.edit_images``: ``vae_image_resize``, Pillow's Lanczos), captured under component
   ``vae`` at step −1; the output size, when no ``--height``/``--width`` is given, is the (last)
   image's resized size, as the pipelines derive it;
1. ``VaeImageProcessor.preprocess``: ``x / 255`` in FP32, then ``2x − 1``; cast to the VAE's
   dtype (``prepare_latents``);
2. ``_encode_vae_image``: the posterior's mode (``QwenImageVAE.encode``), then
   ``(z − mean) / std`` (``vae_latent_normalize``);
3. ``_pack_latents`` (``latent_pack_unpack``, direction ``pack``), in FP32 for the run's inputs.

These run before the artifact opens (the condition latents are its replay inputs), captured
under component ``vae`` at step −1 and filed first into the artifact (``chain.DeferredCapture``).
Each image is encoded once, for the whole batch (the pipeline repeats the latents per sample);
its records carry the first sample's id. The prompt embeddings are the fixture's (or the files'),
or, with ``prompts``, encoded here before the VAE encode, as ``__call__`` calls ``encode_prompt``
(``drifttool.text_encoder.encode_prompts``; the negative prompt likewise; captured under
component ``text_encoder`` at step −1): preset ``diffusers-edit`` (one image), template ``EDIT``
with the resized condition image as every sample's prompt image; preset ``diffusers-edit-plus``,
template ``EDIT_PLUS`` with every image resized apart to about ``prompt_area`` pixels (384²). The
trajectory and the decode are ``chain``'s; the manifest's ``edit`` names the pipeline folder,
the areas, the condition images (original and resized sizes), the prompts with the text
encoder's weight digest and position rule, and the decoded images with their SHA-256.

An edit fixture (``tiny-edit``, ``Fixture.edit``) gives the run its defaults: its folder is the
pipeline folder, its preset and ``vae_image_area`` the run's, and, when ``run_edit`` is given
neither prompts nor prompt-embedding files, its ``prompts`` and ``negative_prompts``, encoded with
the images under its ``prompt_positions`` (the positions' default with any prompts).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Sequence

import torch

from drifttool.chain import ChainStages, DeferredCapture, image_paths, prompt_rows
from drifttool.edit_images import PROMPT_IMAGE_AREA, VAE_IMAGE_AREA, pipeline_size, resize_images
from drifttool.errors import DriftToolError, FixtureError, SigmaTableError, UnsupportedConfigError
from drifttool.fixture import DEFAULT_FIXTURE, load_fixture
from drifttool.memory import check_memory
from drifttool.model.checkpoint import checked_config, read_config
from drifttool.model.vae import QwenImageVAE
from drifttool.model.vae_checkpoint import load_vae, vae_config
from drifttool.model.weights import weight_digest
from drifttool.ops.registry import call
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.sampling.input_files import ExternalInputs
from drifttool.sampling.presets import check_conditions
from drifttool.settings import RunSpec, resolve
from drifttool.setting_checks import MAX_PIXELS, PATCH_PIXELS, check_mode, finite_sigma_table
from drifttool.text_encoder import EDIT, EDIT_PLUS, PromptEncoder, encode_prompts
from drifttool.text_encoder.encode import POSITIONS

PLUS = "diffusers-edit-plus"


def read_image(path: str | Path) -> torch.Tensor:
    """One 8-bit RGB image [H, W, 3] uint8 (Pillow), of any size (the pipeline resizes it).

    Raises:
        DriftToolError: unreadable, over Pillow's decompression-bomb limit (twice
            ``PIL.Image.MAX_IMAGE_PIXELS``), or not RGB (the pipelines' ``preprocess`` needs 3 channels).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.load()
            mode, pixels = img.mode, torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
            w, h = img.size
    except Image.DecompressionBombError:
        raise DriftToolError(f"condition image {path}: {_pixels(path)} pixels, more than the {2 * Image.MAX_IMAGE_PIXELS} "
                             "pixels drifttool opens (Pillow's guard against decompression bombs); "
                             "downscale it first") from None
    except FileNotFoundError:
        raise DriftToolError(f"condition image {path}: missing (no such file)") from None
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise DriftToolError(f"condition image {path}: unreadable ({e})") from None
    if mode != "RGB":
        raise DriftToolError(f"condition image {path}: mode {mode}, drifttool reads 8-bit RGB only")
    return pixels.view(h, w, 3)


def _pixels(path: str | Path) -> str:
    """``W x H`` of an image file as its header says, without decoding it (Pillow's guard off)."""
    from PIL import Image

    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        with Image.open(path) as img:
            return f"{img.size[0]}x{img.size[1]}"
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def encode_condition(vae: QwenImageVAE, image: torch.Tensor, rt: Runtime) -> tuple[torch.Tensor, tuple[int, int]]:
    """Packed condition latents [1, Nc, 4·z_dim] fp32 and the patch grid (h, w) of one image
    [H, W, 3] uint8 (H, W multiples of 16, as resized; module docstring, steps 1–3), captured
    under component ``vae``."""
    dtype = next(vae.parameters()).dtype
    x = image.permute(2, 0, 1).unsqueeze(0).to(torch.float32) / 255.0  # [1, 3, H, W]
    x = (2.0 * x - 1.0).unsqueeze(2).to(dtype)  # [1, 3, 1, H, W]
    z = vae.normalize(vae.encode(x, rt), rt)
    with rt.scope(component="vae", block=-1):
        packed = call(rt, "latent_pack_unpack", z, direction="pack", layout="B..")
    h, w = image.shape[0] // PATCH_PIXELS, image.shape[1] // PATCH_PIXELS
    return packed.to(torch.float32), (h, w)


def _check_prompts(spec: RunSpec, prompts: Sequence[str] | None, negative_prompts: Sequence[str] | None,
                   images: Sequence) -> None:
    if prompts is None:
        if negative_prompts is not None:
            raise DriftToolError("a negative prompt goes with a prompt")
        return
    if spec.prompt_embeds is not None or spec.negative_prompt_embeds is not None:
        raise DriftToolError("--prompt and --prompt-embeds/--negative-prompt-embeds exclude each other "
                             "(the prompt is either encoded here or read from a file)")
    if not prompts or any(not isinstance(p, str) for p in [*prompts, *(negative_prompts or [])]):
        raise DriftToolError("--prompt needs a text")
    if len(images) != 1 and spec.preset != PLUS:
        raise DriftToolError("--prompt with several condition images takes the edit-plus pipeline "
                             f"(--preset {PLUS}); the edit pipeline's prompt holds one image")


def fixture_edit(spec: RunSpec) -> dict[str, Any]:
    """The ``edit`` section of the run's fixture (``Fixture.edit``; the default fixture without
    ``spec.fixture``), empty for a fixture of another kind.

    Raises:
        FixtureError: no such fixture, or a malformed ``edit`` section.
    """
    return load_fixture(spec.fixture or DEFAULT_FIXTURE).edit or {}


def _areas(spec: RunSpec, vae_area: int | None, prompt_area: int | None) -> tuple[int, int | None]:
    """The run's resize areas: the VAE's (default: an edit fixture's ``vae_image_area``, else
    1024²) and, under the edit-plus preset, the prompt images' (default 384²; None under the edit
    pipeline, whose prompt image is the VAE's)."""
    if vae_area is None:
        vae_area = fixture_edit(spec).get("vae_image_area") or VAE_IMAGE_AREA
    pipeline_size(1, 1, vae_area)  # checks the area
    if spec.preset != PLUS:
        if prompt_area is not None:
            raise DriftToolError(f"a prompt-image area is the edit-plus pipeline's (--preset {PLUS})")
        return vae_area, None
    prompt_area = PROMPT_IMAGE_AREA if prompt_area is None else prompt_area
    pipeline_size(1, 1, prompt_area)
    return vae_area, prompt_area


def _encode_prompts(root: Path, rows: list[str], neg_rows: list[str] | None, images: list[torch.Tensor], s,
                    rt: Runtime, positions: str) -> tuple[ExternalInputs, dict[str, Any]]:
    """The prompt embeddings (FP32) and masks (bool) of an edit run and their manifest record."""
    encoder = PromptEncoder.load(root, dtype=s.torch_dtype, vision=True)
    joint = read_config(root).joint_attention_dim
    if encoder.model.config.hidden_size != joint:
        raise DriftToolError(f"--checkpoint {root}: the text encoder is {encoder.model.config.hidden_size} "
                             f"wide, the transformer's joint_attention_dim is {joint}")

    def encode(texts):
        if texts is None:
            return None, None
        template, per_prompt = (EDIT_PLUS, images) if s.preset == PLUS else (EDIT, images[0])
        e, m = encode_prompts(encoder, texts, rt, template=template, images=[per_prompt] * len(texts),
                              samples=list(s.labels), positions=positions)
        return e.to(torch.float32).cpu(), None if m is None else m.to(torch.bool).cpu()

    txt, mask = encode(rows)
    neg, neg_mask = encode(neg_rows)
    record = {"prompts": rows, "negative_prompts": neg_rows, "prompt_positions": positions,
              "text_encoder_weights": weight_digest({**encoder.model.weights,
                                                     **{"visual." + k: v for k, v in encoder.vision.weights.items()}})}
    return ExternalInputs(txt=txt, txt_mask=mask, neg_txt=neg, neg_mask=neg_mask), record


def _size_source(spec: RunSpec, area: int, given_area: int | None) -> str | None:
    """The options that set the run's image size, as messages name them: ``--image-area`` where
    the given area sizes the output (no ``--height``/``--width``), None for the default."""
    if given_area is None or (spec.height is not None and spec.width is not None):
        return None
    return f"--image-area {area}"


def largest_area(width: int, height: int, steps: int) -> int:
    """The largest area such that a ``width`` × ``height`` image resized to any area up to it
    (``pipeline_size``) gets an output size a ``steps``-step run can take: sides up to
    ``MAX_PIXELS`` and a finite sigma table for its 16-pixel patch grid
    (``setting_checks.check_sigma_table``). The resized size changes only where a side's
    rounding to 32 pixels does, so the integer areas next to each such boundary stand for all."""
    ratio = width / height
    near: set[int] = set()
    k = 0
    while True:  # w = 32(k + ½) at A = (32(k + ½))² / ratio; h likewise at (32(k + ½))² · ratio
        ends = ((32 * (k + 0.5)) ** 2 / ratio, (32 * (k + 0.5)) ** 2 * ratio)
        near.update(int(e) + d for e in ends for d in (-1, 0, 1, 2) if int(e) + d >= 1)
        if min(ends) > 4 * MAX_PIXELS ** 2:
            break
        k += 1
    for area in sorted(near):
        try:
            w, h = pipeline_size(width, height, area)
        except DriftToolError:
            continue  # a side of 0: no run at any smaller area either
        if max(w, h) > MAX_PIXELS or not finite_sigma_table(steps, (h // PATCH_PIXELS) * (w // PATCH_PIXELS)):
            return area - 1
    return max(near)


def resolve_sized(spec: RunSpec, source: str | None, image: torch.Tensor):
    """``resolve(spec)``, its sigma-table refusal (``setting_checks.check_sigma_table``) naming
    ``source`` (``--image-area``) and the largest area that runs with this image, not the
    ``--height``/``--width`` the area became."""
    try:
        return resolve(spec)
    except SigmaTableError as e:
        if source is None:
            raise
        top = largest_area(int(image.shape[1]), int(image.shape[0]), e.steps)
        raise SigmaTableError(
            f"{source} (a {spec.width}x{spec.height} px output): {e.why}; at {e.steps} steps, every "
            f"--image-area up to {top} runs with this {image.shape[1]}x{image.shape[0]} px condition image",
            why=e.why, steps=e.steps) from None


def _size(image: torch.Tensor) -> list[int]:
    return [int(image.shape[1]), int(image.shape[0])]  # [width, height]


def _image_record(path, image: torch.Tensor, vae_image: torch.Tensor, prompt_image: torch.Tensor | None) -> dict:
    """A condition image's manifest entry: path, SHA-256, its size and its resized sizes ([W, H])."""
    rec = {"path": str(Path(path).resolve()), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
           "size": _size(image), "vae_size": _size(vae_image)}
    if prompt_image is not None:
        rec["prompt_size"] = _size(prompt_image)
    return rec


def prepare_edit(spec: RunSpec, out: str | Path, *, condition_images: Sequence[str | Path],
                 prompts: Sequence[str] | None = None, negative_prompts: Sequence[str] | None = None,
                 positions: str = "rope_index", vae_area: int | None = None, prompt_area: int | None = None,
                 overwrite: bool = False, no_prompt: str | None = None) -> tuple[RunSpec, ChainStages]:
    """Load the VAE of ``spec.checkpoint`` (a pipeline folder with ``vae/``), resize the
    condition images as the pipeline does (``vae_area``, default 1024²; ``prompt_area``, default
    384², under the edit-plus preset), encode the prompts when given (with ``text_encoder/`` and
    ``tokenizer/``; ``positions`` as ``encode_prompts``') and the resized images (captured,
    deferred) and return the spec (its missing ``height``/``width`` the last image's resized
    size) with the stages around the trajectory. ``no_prompt``: the refusal to raise, after the
    checks of the fixture, folder and preset, when the run has no prompt (``run_edit``).

    Raises:
        DriftToolError: no condition image; a checkpoint that is not a folder; an image as
            ``read_image``; condition files given too; an area as ``edit_images.pipeline_size``,
            or a prompt area without the edit-plus preset; prompts with prompt files, with several
            images without the edit-plus preset, not one per sample, or a text encoder whose
            width is not the transformer's; as ``resolve``; a run that does not fit in memory
            (``memory.check_memory``).
        UnsupportedConfigError: a device other than the CPU.
        CheckpointError: the VAE or the text encoder cannot be loaded.
    """
    if not condition_images:
        raise DriftToolError("an edit run needs at least one condition image")
    if spec.condition is not None:
        raise DriftToolError("condition images and a --condition latents file exclude each other")
    own = None if spec.fixture is None else load_fixture(spec.fixture)
    if own is not None and own.meta.get("chain") is not None:
        raise DriftToolError(
            f"--fixture {spec.fixture}: a text-to-image chain fixture (prompt → image); --image needs an "
            "edit pipeline: an edit fixture such as tiny-edit, or a --checkpoint pipeline folder with an "
            "edit preset (--preset diffusers-edit, or diffusers-edit-plus for several images)")
    if spec.checkpoint is None and own is not None and (own.path / "vae").is_dir():
        spec = dataclasses.replace(spec, checkpoint=own.path)  # an edit fixture is a pipeline folder
    if spec.preset is None and own is not None and own.settings.get("preset") is not None:
        spec = dataclasses.replace(spec, preset=own.settings["preset"])  # an edit fixture's own preset
        if check_mode(spec.mode).family != "production":
            raise UnsupportedConfigError(
                f"--fixture {spec.fixture} runs under its preset {spec.preset!r} (a production "
                f"pipeline's arithmetic), which needs --mode auto (or off), not {spec.mode}")
    if spec.checkpoint is None or not Path(spec.checkpoint).is_dir():
        raise DriftToolError("an edit run from images needs a pipeline folder (--checkpoint with vae/ "
                             "beside transformer/, or --fixture tiny-edit: the shipped one)")
    if spec.preset is not None:  # before the prompts: several images under the one-image preset
        check_conditions(spec.preset, condition_images, source="--image")
    if no_prompt is not None and prompts is None:
        raise DriftToolError(no_prompt)
    _check_prompts(spec, prompts, negative_prompts, condition_images)
    explicit_area = vae_area
    vae_area, prompt_area = _areas(spec, vae_area, prompt_area)
    if prompts is None:
        prompt_area = None  # no prompt image to make
    root = Path(spec.checkpoint)
    missing = [p for p in ("tokenizer", "text_encoder") if prompts is not None and not (root / p).is_dir()]
    if missing:
        raise DriftToolError(f"--checkpoint {root}: an edit run with prompts (--prompt, or an edit fixture's) "
                             f"needs the pipeline's text encoder; the folder lacks "
                             f"{', '.join(p + '/' for p in missing)} (or give --prompt-embeds)")
    if prompts is not None and spec.samples is None and spec.batch is None and spec.fixture is None:
        spec = dataclasses.replace(spec, samples=list(range(len(prompts))))
    images = [read_image(p) for p in condition_images]
    for p, img in zip(condition_images, images):
        for area in (vae_area, prompt_area or vae_area):
            try:
                pipeline_size(img.shape[1], img.shape[0], area)
            except DriftToolError as e:
                raise DriftToolError(f"condition image {p}: {e}") from None
    vae_sizes = [pipeline_size(img.shape[1], img.shape[0], vae_area) for img in images]  # (w, h)
    source = _size_source(spec, vae_area, explicit_area)
    if spec.height is None or spec.width is None:  # __call__: height or the image's, width likewise
        w, h = vae_sizes[-1]
        spec = dataclasses.replace(spec, height=spec.height or h, width=spec.width or w)
    fx, s = resolve_sized(spec, source, images[-1])
    if s.device != "cpu":
        raise UnsupportedConfigError(f"an edit run from images runs on the CPU only for now (asked: "
                                     f"--device {s.device})")
    check_memory(s, checked_config(root, s.variant), vae_config(root),  # before any work
                 condition_grids=[(h // PATCH_PIXELS, w // PATCH_PIXELS) for w, h in vae_sizes], source=source)
    paths = image_paths(out, s.labels, overwrite)  # before any work
    rows = None if prompts is None else prompt_rows(prompts, list(s.samples), "prompt")
    neg_rows = None if negative_prompts is None else prompt_rows(negative_prompts, list(s.samples), "negative prompt")
    capture = DeferredCapture(s.capture) if s.mode.captures else None
    rt = Runtime(mode=s.mode, recorder=capture, unavailable=set(spec.unavailable),
                 variants=dict(spec.variants), internals=None if s.internals else False)
    external, prompt_record = s.external or ExternalInputs(), {}  # --prompt-embeds files, if given
    with torch.no_grad():  # __call__: the resize, encode_prompt, then the VAE encode
        vae_images, prompt_images = resize_images(images, rt, vae_area=vae_area, prompt_area=prompt_area,
                                                  sample=s.labels[0])
        if rows is not None:
            shown = vae_images if prompt_images is None else prompt_images  # the text encoder's images
            external, prompt_record = _encode_prompts(root, rows, neg_rows, shown, s, rt, positions)
    vae = load_vae(root, dtype=s.torch_dtype)
    latents, grids = [], []
    with torch.no_grad(), rt.scope(phase="rollout", step=-1, branch="none", samples=[s.labels[0]],
                                   txt_lens=None, txt_starts=None, img_grid=None):
        for img in vae_images:
            packed, grid = encode_condition(vae, img, rt)
            latents.append(packed)
            grids.append(grid)
    record = {"pipeline": str(root.resolve()), "vae_weights": weight_digest(vae), "vae_image_area": vae_area,
              "condition_images": [_image_record(p, i, v, None if prompt_images is None else prompt_images[k])
                                   for k, (p, i, v) in enumerate(zip(condition_images, images, vae_images))],
              **prompt_record}
    if prompt_area is not None:
        record["prompt_image_area"] = prompt_area
    external = dataclasses.replace(external, cond=torch.cat(latents, dim=1), cond_grids=tuple(grids))
    stages = ChainStages(settings=s, external=external, early_runtime=rt, early_capture=capture,
                         vae=vae, images=paths, record=record,
                         manifest_key="edit")
    return spec, stages


def run_edit(spec: RunSpec, out: str | Path, *, condition_images: Sequence[str | Path],
             prompts: Sequence[str] | None = None, negative_prompts: Sequence[str] | None = None,
             positions: str | None = None, vae_area: int | None = None, prompt_area: int | None = None,
             overwrite: bool = False, **execute_kw: Any) -> dict[str, Any]:
    """Run an edit from its condition images (and prompts: given, or an edit fixture's; module
    docstring) into the artifact ``out``; ``execute``'s summary plus ``images`` (the PNG paths
    written), ``prompts`` (those encoded, one per sample; None without) and ``cfg`` (whether
    CFG ran).

    ``positions`` None: the edit fixture's ``prompt_positions``, else ``"rope_index"``.

    Raises:
        As ``prepare_edit`` and ``runner.execute`` (a preset that takes another number of
        condition images, say); ``DriftToolError``: no prompt (no ``prompts``, no prompt
        embeddings file, and a fixture without an ``edit`` prompt); ``FixtureError``: a
        malformed ``edit`` section of the fixture (its ``prompt_positions`` not one of
        ``text_encoder.encode.POSITIONS``, say).
    """
    own = fixture_edit(spec)
    no_prompt = None  # without one, the fixture's stored embeddings are not this pipeline's prompt
    if prompts is None and negative_prompts is None and spec.prompt_embeds is None \
            and spec.negative_prompt_embeds is None:
        prompts, negative_prompts = own.get("prompts"), own.get("negative_prompts")
        no_prompt = None if prompts is not None else (
            "--image: no prompt for the edit: give --prompt TEXT (encoded with the image by the pipeline's "
            "text encoder) or --prompt-embeds FILE, or an edit fixture that holds its prompts (--fixture "
            f"tiny-edit); {'--fixture ' if spec.fixture else 'the default fixture '}"
            f"{spec.fixture or DEFAULT_FIXTURE!s} has none")
    if positions is None and own.get("prompt_positions", POSITIONS[0]) not in POSITIONS:
        raise FixtureError(f"{load_fixture(spec.fixture or DEFAULT_FIXTURE).path}: fixture.json 'edit' "
                           f"prompt_positions {own['prompt_positions']!r}: one of {', '.join(POSITIONS)}")
    positions = positions or own.get("prompt_positions", "rope_index")
    spec, stages = prepare_edit(spec, out, condition_images=condition_images, prompts=prompts,
                                negative_prompts=negative_prompts, positions=positions, vae_area=vae_area,
                                prompt_area=prompt_area, overwrite=overwrite, no_prompt=no_prompt)
    summary = execute(spec, out, overwrite=overwrite, stages=stages, **execute_kw)
    ran = dataclasses.replace(stages.settings, external=stages.external)  # the trajectory's inputs
    return {**summary, "images": [str(p) for p in stages.images] if summary["complete"] else [],
            "prompts": stages.record.get("prompts"), "cfg": ran.cfg_branches == 2}
