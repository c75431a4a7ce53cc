"""The full text-to-image chain in one artifact: prompts → text encoder → transformer trajectory →
VAE decode → PNG (``drifttool run --prompt``).

    >>> summary = run_chain(RunSpec(checkpoint="Qwen-Image", mode="strict"), "runs/a",
    ...                     prompts=["a red cube"], negative_prompts=["blurry"])
    >>> summary["images"]                                 # beside the artifact
    ['runs/a.png']

The stages, each captured by the run's recorder under its own ``component`` (records of one
identity space, ordered by the diff as phase, step, component, …):

1. ``text_encoder`` (step −1): ``drifttool.text_encoder.encode_prompts`` of the prompts and, when
   given, the negative prompts (one row per sample; the negative prompts are the second call of
   each operator), ``max_sequence_length`` 512 as ``QwenImagePipeline.__call__``. The embeddings
   go to the trajectory in memory (``runner.execute(stages=...)``); they are its replay inputs,
   digested in the manifest as any prompt embeddings. Without negative prompts CFG is off
   (diffusers' rule, as with ``--prompt-embeds``).
2. ``mmdit`` (steps −1 … N−1): the trajectory, ``runner.execute``.
3. ``vae`` (step N, after the last step): the final latents x_N unpacked (``latent_pack_unpack``,
   ``_unpack_latents``), cast to the VAE's dtype, de-normalised (``vae_latent_normalize`` inverse:
   ``z / (1/std) + mean``), decoded and clamped (``QwenImageVAE.decode``) — the arithmetic of
   ``QwenImagePipeline.__call__`` after its loop. The image is then turned to 8-bit RGB as
   ``VaeImageProcessor.postprocess(output_type="pil")`` does (``x·0.5 + 0.5`` clamped to [0, 1]
   in the VAE's dtype, then FP32, ``round(·255)``; outside the operators: an exact, fixed map)
   and written with Pillow.

The text encoder runs before the artifact opens (its embeddings are the artifact's inputs): its
records are digested as it runs and filed into the artifact's recorder, in program order and
before the trajectory's, once the artifact is open; its trace entries likewise. Images: one PNG
per sample beside the artifact directory (``<out>.png`` for one sample, ``<out>-<sample>.png``
otherwise), so ``--overwrite`` of the artifact never meets a foreign file. The manifest's
``chain`` names the prompts, the pipeline folder, the text encoder's and VAE's weight digests and
the images with their SHA-256. ``drifttool replay`` of such a run re-runs every stage from that
folder (``drifttool.training.chain_replay``); an edit run from its condition images uses the same
stages around the trajectory (``drifttool.chain_edit``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Sequence

import torch

from drifttool.artifact.directory import run_images
from drifttool.capture.recorder import record_parts
from drifttool.errors import DriftToolError, UnsupportedConfigError, writing
from drifttool.fixture import packaged_fixtures
from drifttool.memory import check_memory
from drifttool.model.checkpoint import checked_config
from drifttool.model.vae import QwenImageVAE
from drifttool.model.vae_checkpoint import load_vae, vae_config
from drifttool.model.weights import weight_digest
from drifttool.ops.registry import call
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.sampling.input_files import ExternalInputs
from drifttool.settings import RunSettings, RunSpec, resolve
from drifttool.setting_checks import PATCH_PIXELS
from drifttool.text_encoder import PromptEncoder, encode_prompts

PIPELINE_PARTS = ("tokenizer", "text_encoder", "vae")
"""The folders a pipeline needs beside its transformer for the chain."""
MAX_SEQUENCE_LENGTH = 512
"""Prompt embedding rows kept (``QwenImagePipeline.__call__``'s default)."""


def default_pipeline() -> Path:
    """The pipeline folder a prompt run uses without ``--checkpoint``: the shipped
    ``tiny-t2i-chain`` fixture's (tiny random tokenizer, text encoder, transformer and VAE)."""
    return packaged_fixtures() / "tiny-t2i-chain"


def check_pipeline(folder: str | Path | None) -> Path:
    """The pipeline folder of a chain run, with ``tokenizer/``, ``text_encoder/`` and ``vae/``.

    Raises:
        DriftToolError: no folder given, or one lacking those parts (one line naming them).
    """
    if folder is None:
        raise DriftToolError("--prompt needs a pipeline folder (--checkpoint with tokenizer/, "
                             "text_encoder/ and vae/ beside transformer/)")
    root = Path(folder)
    if not root.is_dir():
        raise DriftToolError(f"--checkpoint {root}: not a directory")
    missing = [p for p in PIPELINE_PARTS if not (root / p).is_dir()]
    if missing:
        raise DriftToolError(f"--checkpoint {root}: a prompt run needs a pipeline folder; it lacks "
                             f"{', '.join(p + '/' for p in missing)}")
    return root


def image_paths(out: str | Path, samples: Sequence[int], overwrite: bool = False) -> list[Path]:
    """Where the decoded images go: ``<out>.png`` for one sample, else ``<out>-<sample>.png``;
    checked before any work, as the artifact directory is: a folder there is refused, and so is
    an existing file that is not an image of the run at ``out`` (``artifact.directory.run_images``)
    always, and one that is only without ``overwrite``.

    Raises:
        DriftToolError: naming the image path in the way and what to do.
    """
    out = Path(out)
    if len(samples) == 1:
        paths = [out.with_name(out.name + ".png")]
    else:
        paths = [out.with_name(f"{out.name}-{s}.png") for s in samples]
    earlier = run_images(out) if out.is_dir() else {}
    for p in paths:
        if p.is_dir():
            raise DriftToolError(f"{p} is a directory; the run writes its image there (choose another -o)")
        if not (p.exists() or p.is_symlink()):
            continue
        if p.resolve() not in earlier:
            raise DriftToolError(f"{p} exists and is not an image of a drifttool run at {out}: drifttool will "
                                 "not replace it; move it or choose another -o")
        if not overwrite:
            raise DriftToolError(f"{p} exists (the image of the earlier run at {out}): use --overwrite to "
                                 "replace that run and its image, or choose another -o")
    return paths


class DeferredCapture:
    """A recorder stand-in for a stage that runs before the artifact opens: each operator output
    is digested as it is produced (``record_parts``: the recorder's own device work) and kept
    with its site; ``file_into(recorder)`` files them, in order, once the artifact is open."""

    def __init__(self, level: str) -> None:
        self.level = level
        self._held: list[tuple[dict[str, Any], list, int, str, Any]] = []

    def capture(self, site: dict[str, Any], tensor: torch.Tensor, layout: str, index: int = 0,
                role: str = "output") -> None:
        if self.level != "L0":
            self._held.append((dict(site), record_parts(site, tensor, layout, self.level), index, role, None))

    def capture_digested(self, site: dict[str, Any], parts: list, index: int = 0, role: str = "output",
                         ranks: list | None = None) -> None:
        if self.level != "L0":
            self._held.append((dict(site), parts, index, role, ranks))

    def file_into(self, recorder) -> None:
        for site, parts, index, role, ranks in self._held:
            recorder.capture_digested(site, parts, index=index, role=role, ranks=ranks)
        self._held.clear()


def prompt_rows(prompts: Sequence[str], samples: Sequence[int], what: str) -> list[str]:
    """One prompt per sample: a single prompt serves every sample."""
    if len(prompts) == 1:
        return list(prompts) * len(samples)
    if len(prompts) != len(samples):
        raise DriftToolError(f"{len(prompts)} {what}s for {len(samples)} samples (give one, or one "
                             "per sample)")
    return list(prompts)


@dataclasses.dataclass(kw_only=True)
class ChainStages:
    """The stages around the trajectory (``runner.execute(stages=...)``): what ran before the
    artifact opened (the text encoder of a prompt run, the VAE encode of an edit run's condition
    images: ``early_runtime`` with its deferred capture ``early_capture``), its result for the
    trajectory (``external``), and the VAE decode. ``manifest_key`` names the manifest section
    ``record`` goes to (``chain``, or ``edit``: ``drifttool.chain_edit``)."""

    settings: RunSettings
    external: ExternalInputs
    early_runtime: Runtime
    early_capture: DeferredCapture | None
    vae: QwenImageVAE
    images: list[Path]
    record: dict[str, Any]
    manifest_key: str = "chain"

    def opened(self, session) -> None:
        """File the early stages' records and trace entries first in the open artifact."""
        if self.early_capture is not None and session.recorder is not None:
            self.early_capture.file_into(session.recorder)
        # the session's trace is still empty (nothing ran on it): the early stages' entries
        # come first, the trajectory's and the VAE's follow in the same trace
        session.rt.trace = self.early_runtime.trace

    def finished(self, session, traj) -> dict[str, Any]:
        """Decode x_N (a complete trajectory only), write the PNGs; the manifest's ``chain``."""
        if not traj.complete:
            return {self.manifest_key: {**self.record, "images": []}}
        pixels = decode_latents(self.vae, traj.latents[-1], float(traj.sigmas[-1]), self.settings,
                                session.rt)
        written = []
        for path, img in zip(self.images, pixels):
            written.append({"path": str(path.resolve()), "sha256": write_png(img, path)})
        return {self.manifest_key: {**self.record, "images": written}}


def decode_latents(vae: QwenImageVAE, latents: torch.Tensor, sigma: float, settings: RunSettings,
                   rt: Runtime) -> torch.Tensor:
    """8-bit RGB images [B, H, W, 3] (uint8, CPU) from the packed final latents x_N [B, N, Cp]
    at ``sigma`` (the table's last, σ_N), as ``QwenImagePipeline.__call__`` after its loop
    (module docstring), captured under component ``vae`` at step N = ``settings.steps``.

    Raises:
        UnsupportedConfigError: a VAE whose spatial factor is not 8 (the transformer's 2×2
            patches then do not make 16-pixel patches), or as the operators raise.
    """
    if vae.config.spatial_factor * 2 != PATCH_PIXELS:
        raise UnsupportedConfigError(f"the VAE downsamples by {vae.config.spatial_factor}, the "
                                     f"chain needs {PATCH_PIXELS // 2} ({PATCH_PIXELS}-pixel patches)")
    dtype = next(vae.parameters()).dtype
    # no autograd graph: it would keep every operator's working tensors (the strict im2col
    # patches) alive until the end, ~20 KB per pixel (OOM at 1024² on 22 GiB)
    with torch.no_grad(), rt.scope(component="vae", phase="rollout", step=settings.steps, sigma=sigma,
                                   branch="none", block=-1, samples=settings.labels, txt_lens=None,
                                   txt_starts=None, img_grid=None):
        z = call(rt, "latent_pack_unpack", latents, direction="unpack", grid=tuple(settings.img_grid),
                 layout="B....")
        images = vae.decode(vae.denormalize(z.to(dtype), rt), rt)[:, :, 0]  # [B, 3, H, W]
    # VaeImageProcessor.postprocess(output_type="pil"): denormalise, FP32 HWC, round(x·255)
    images = (images * 0.5 + 0.5).clamp(0, 1).cpu().permute(0, 2, 3, 1).float()
    return (images * 255).round().to(torch.uint8)


def write_png(image: torch.Tensor, path: Path) -> str:
    """Write one [H, W, 3] uint8 image as PNG (Pillow); returns the file's SHA-256."""
    from PIL import Image

    with writing(path):
        Image.fromarray(image.numpy(), mode="RGB").save(path, format="PNG")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _encode(encoder: PromptEncoder, prompts: list[str] | None, rt: Runtime, samples: list[int]):
    if prompts is None:
        return None, None
    embeds, mask = encode_prompts(encoder, prompts, rt, max_sequence_length=MAX_SEQUENCE_LENGTH,
                                  samples=samples)
    return embeds.to(torch.float32), (None if mask is None else mask.to(torch.bool))


def prepare(spec: RunSpec, out: str | Path, *, prompts: Sequence[str],
            negative_prompts: Sequence[str] | None = None, overwrite: bool = False
            ) -> tuple[RunSpec, ChainStages]:
    """Load the pipeline's text encoder and VAE, encode the prompts (captured, deferred) and
    return the spec the trajectory runs (its samples fixed) with the stages around it.

    Raises:
        DriftToolError: an image path in the way (``image_paths``); a pipeline folder lacking
            parts (``check_pipeline``; without
            ``spec.checkpoint`` the shipped tiny pipeline, ``default_pipeline``, runs); prompt
            file inputs given too; prompts not one per sample; as ``resolve``; a run that does
            not fit in memory (``memory.check_memory``, before any work).
        UnsupportedConfigError: a device other than the CPU.
        CheckpointError, UnsupportedConfigError: the text encoder or VAE cannot be loaded, or a
            text width other than the transformer's ``joint_attention_dim``.
    """
    if spec.prompt_embeds is not None or spec.negative_prompt_embeds is not None:
        raise DriftToolError("--prompt and --prompt-embeds/--negative-prompt-embeds exclude each other "
                             "(the prompt is either encoded here or read from a file)")
    if not prompts or any(not isinstance(p, str) for p in prompts):
        raise DriftToolError("--prompt needs a text")
    if spec.checkpoint is None:  # the embedded default: the shipped tiny pipeline folder
        spec = dataclasses.replace(spec, checkpoint=str(default_pipeline()))
    root = check_pipeline(spec.checkpoint)
    if spec.samples is None and spec.batch is None:
        spec = dataclasses.replace(spec, samples=list(range(len(prompts))))
    fx, s = resolve(spec)
    ids = list(s.samples)
    images = image_paths(out, s.labels, overwrite)  # before any work
    rows = prompt_rows(prompts, ids, "prompt")
    neg_rows = None if negative_prompts is None else prompt_rows(negative_prompts, ids, "negative prompt")
    if s.device != "cpu":
        raise UnsupportedConfigError(f"--prompt runs on the CPU only for now (asked: --device {s.device}): "
                                     "the text encoder's token ids are made on the CPU")
    config = checked_config(root, s.variant)
    check_memory(s, config, vae_config(root))  # before any work
    encoder = PromptEncoder.load(root, dtype=s.torch_dtype)
    joint = config.joint_attention_dim
    if encoder.model.config.hidden_size != joint:
        raise DriftToolError(f"--checkpoint {root}: the text encoder is {encoder.model.config.hidden_size} "
                             f"wide, the transformer's joint_attention_dim is {joint}")
    vae = load_vae(root, dtype=s.torch_dtype)
    capture = DeferredCapture(s.capture) if s.mode.captures else None
    rt = Runtime(mode=s.mode, recorder=capture, unavailable=set(spec.unavailable),
                 variants=dict(spec.variants), internals=None if s.internals else False)
    with torch.no_grad():
        txt, mask = _encode(encoder, rows, rt, s.labels)
        neg, neg_mask = _encode(encoder, neg_rows, rt, s.labels)
    record = {"pipeline": str(root.resolve()), "prompts": rows, "negative_prompts": neg_rows,
              "max_sequence_length": MAX_SEQUENCE_LENGTH,
              "text_encoder_weights": weight_digest(encoder.model.weights),
              "vae_weights": weight_digest(vae)}
    external = ExternalInputs(txt=txt.cpu(), txt_mask=None if mask is None else mask.cpu(),
                              neg_txt=None if neg is None else neg.cpu(),
                              neg_mask=None if neg_mask is None else neg_mask.cpu())
    stages = ChainStages(settings=s, external=external, early_runtime=rt, early_capture=capture, vae=vae,
                         images=images, record=record)
    return spec, stages


def run_chain(spec: RunSpec, out: str | Path, *, prompts: Sequence[str],
              negative_prompts: Sequence[str] | None = None, overwrite: bool = False,
              **execute_kw: Any) -> dict[str, Any]:
    """Run the chain (module docstring) into the artifact ``out``; ``execute``'s summary plus
    ``images`` (the PNG paths written) and ``cfg`` (whether CFG ran).

    Raises:
        As ``prepare`` and ``runner.execute``; a transformer whose ``joint_attention_dim`` is not
        the text encoder's width (``DriftToolError``).
    """
    spec, stages = prepare(spec, out, prompts=prompts, negative_prompts=negative_prompts,
                           overwrite=overwrite)
    summary = execute(spec, out, overwrite=overwrite, stages=stages, **execute_kw)
    images = [str(p) for p in stages.images] if summary["complete"] else []
    return {**summary, "images": images, "cfg": stages.external.neg_txt is not None
            and stages.settings.cfg_scale > 1}
