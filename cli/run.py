"""``drifttool run``: one trajectory to an artifact directory."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from drifttool.cli import _checkpoint, _completion, _json, _layout, _paths
from drifttool.cli._console import console, err, notice
from drifttool.cli._errors import alike_on_every_rank
from drifttool.cli._summary import graph_rows, graph_warning, internals_note, settings_rows, shown
from drifttool.errors import DriftToolError


class PromptPositions(str, enum.Enum):
    """``--prompt-positions``: ``drifttool.text_encoder.encode.POSITIONS`` (a test keeps them
    equal; spelled here to keep torch out of ``drifttool --help``)."""

    rope_index = "rope_index"
    sequential = "sequential"


def _samples(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    if not text.strip():
        return []  # refused by the settings: no sample ids
    parts = [s.strip() for s in text.split(",")]
    if "" in parts:
        raise DriftToolError(f"--samples: an empty entry in {text!r} (comma-separated integers, e.g. 0,1)")
    try:
        return [int(s) for s in parts]
    except ValueError:
        raise DriftToolError(f"--samples: expected comma-separated integers, got {text!r}") from None


def _stage_fixture(fixture: Optional[str], prompt: bool) -> None:
    """Refuse, in one line naming what it is and what runs it, a fixture ``run`` cannot take:
    an edit fixture (condition image → VAE encode → trajectory → VAE decode) without ``--image``
    (``run`` checks ``--image`` first), a chain
    fixture (a pipeline folder without stored prompt embeddings) without ``--prompt``."""
    if fixture is None:
        return
    from drifttool.fixture import load_fixture  # lazy: likewise
    from drifttool.verify import fixture_kind  # lazy: likewise

    kind = fixture_kind(load_fixture(fixture))
    if kind == "edit":
        raise DriftToolError(
            f"--fixture {fixture}: an edit fixture (condition image → VAE encode → trajectory → VAE "
            f"decode), which `drifttool run` takes only with --image: `drifttool fixture verify "
            f"{fixture}` re-runs it; `drifttool run --image COND.png --checkpoint PIPELINE_DIR` runs "
            "an edit from images, `--condition LATENTS` one from packed condition latents")
    if kind == "chain" and not prompt:
        raise DriftToolError(
            f"--fixture {fixture}: a chain fixture (a pipeline folder: prompt → text encoder → "
            "trajectory → VAE decode; no stored prompt embeddings), which `drifttool run` takes "
            f"only with --prompt TEXT; `drifttool fixture verify {fixture}` re-runs it")


def run(
    out: Path = typer.Option(..., "-o", "--out", parser=_paths.path,
                           help="Artifact directory to create (missing parent folders are created)."),
    checkpoint: Optional[Path] = _checkpoint.option("Replaces the fixture's model."),
    variant: Optional[str] = typer.Option(
        None, help="Weight variant of --checkpoint (fp16 reads diffusion_pytorch_model.fp16.safetensors)."),
    fixture: Optional[str] = typer.Option(None, autocompletion=_completion.fixtures,
                                           help="Fixture name or path (default tiny-t2i)."),
    steps: Optional[int] = typer.Option(None, help="Denoising steps N (2 to 1000)."),
    cfg_scale: Optional[float] = typer.Option(None, help="True-CFG scale, a finite number >= 0 (CFG on when > 1)."),
    eta: Optional[float] = typer.Option(None, help="SDE noise level inside the window (>= 0)."),
    batch: Optional[int] = typer.Option(None, min=1, help="Run logical samples 0..B-1 as one batch."),
    samples: Optional[str] = typer.Option(None, help="Comma-separated logical sample ids (e.g. 2 or 0,1,2)."),
    mode: str = typer.Option("strict", envvar="DRIFTTOOL_MODE", autocompletion=_completion.modes,
                             help="strict | audit | auto | off."),
    capture: Optional[str] = typer.Option(None, autocompletion=_completion.levels,
                                           help="L0 | L1 | L2 (default: the fixture's)."),
    internals: Optional[bool] = typer.Option(None, "--internals/--no-internals", show_default=False, help="At L2, also capture the fused attention's internals (its scores and probabilities; the default); --no-internals leaves them out and keeps the attention fused (diff --localize captures them for the drifting step); production modes have none."),
    seed: Optional[int] = typer.Option(None, help="Noise seed, an integer in [-2^63, 2^64): negative ones too, as a torch generator takes them (default: the fixture's)."),
    dtype: Optional[str] = typer.Option(None, autocompletion=_completion.dtypes, help="float32 | bfloat16 (default: the fixture's)."),
    cfg_layout: Optional[str] = typer.Option(None, autocompletion=_completion.cfg_layouts, help="batched | sequential CFG execution."),
    lora: Optional[Path] = typer.Option(None, parser=_paths.adapter,
                                        help="LoRA adapter (peft folder or .safetensors) to load."),
    lora_mode: Optional[str] = typer.Option(
        None, help="How the adapter runs: merged (peft merge_and_unload) | fused (diffusers fuse_lora) | "
                   "unfused (diffusers load_lora_weights) | unfused-fp32 (peft-wrapped, FP32 factors); "
                   "default: the preset's, else merged. The recompute runs the rollout's mode: for a "
                   "strict recompute --grad at full size on an 80 GiB GPU roll out with unfused-fp32."),
    preset: Optional[str] = typer.Option(
        None, autocompletion=_completion.presets,
        help="Production preset: diffusers (QwenImagePipeline's loop) | diffusers-edit "
                   "(QwenImageEditPipeline's, one --condition image) | diffusers-edit-plus "
                   "(QwenImageEditPlusPipeline's, one or more) | flow-grpo (Flow-GRPO's "
                   "Qwen-Image rollout); needs --mode auto or off."),
    device: str = typer.Option("cpu", envvar="DRIFTTOOL_DEVICE", autocompletion=_completion.devices,
                               help="cpu | cuda | cuda:N: where the model and inputs live (strict on CUDA: the Triton family, sm_90)."),
    height: Optional[int] = typer.Option(None, help="Image height in pixels, a multiple of 16 (default: the fixture's; "
                                                    "with --image the last image's resized height)."),
    width: Optional[int] = typer.Option(None, help="Image width in pixels, a multiple of 16 (default: the fixture's; "
                                                   "with --image the last image's resized width)."),
    prompt_embeds: Optional[Path] = typer.Option(
        None, help="safetensors with prompt_embeds [B, L, D] (+ prompt_embeds_mask [B, L]) from QwenImagePipeline.encode_prompt."),
    negative_prompt_embeds: Optional[Path] = typer.Option(
        None, help="Likewise for the negative prompt (without it, file prompts run without CFG)."),
    prompt: Optional[str] = typer.Option(
        None, help="Encode this prompt with the --checkpoint pipeline's text encoder (without --checkpoint: the "
                   "shipped tiny pipeline), run the trajectory, decode with its VAE and write the image beside "
                   "OUT (OUT.png): every stage captured."),
    negative_prompt: Optional[str] = typer.Option(
        None, help="The negative prompt of --prompt (CFG runs only with one, diffusers' rule)."),
    image: Optional[list[Path]] = typer.Option(
        None, "--image", help="An edit run from condition images (repeat for edit-plus): each PNG (RGB, any "
                              "size) is resized as the edit pipelines resize it (about --image-area pixels, "
                              "sides multiples of 32; the output size follows the last image unless "
                              "--height/--width are given), goes through the --checkpoint pipeline's VAE encode "
                              "(captured), then the trajectory, and the final latents are decoded to OUT.png. "
                              "Prompt embeddings come from --prompt (encoded with the images by the pipeline's "
                              "text encoder and its vision tower; edit-plus: each image resized to about "
                              "384x384 for it), --prompt-embeds, or an edit fixture's prompts (encoded "
                              "likewise; --fixture tiny-edit)."),
    image_area: Optional[int] = typer.Option(
        None, help="Pixel area the --image condition images are resized to for the VAE (default 1048576 = "
                   "1024x1024, the edit pipelines'; smaller areas make quick runs of tiny models)."),
    prompt_positions: Optional[PromptPositions] = typer.Option(
        None, help="Positions of an edit prompt's vision tokens (--image with prompts): rope_index "
                   "(Qwen2.5-VL's (t, h, w) mRoPE, as transformers 4.x computes them in diffusers' "
                   "encode_prompt) | sequential (0..L-1, what diffusers 0.42.1 gets from "
                   "transformers 5.x, to which it passes no mm_token_type_ids). Default: an edit "
                   "fixture's, else rope_index. No effect without a condition image: a text-only "
                   "prompt's tokens get positions 0..L-1 either way."),
    latents: Optional[Path] = typer.Option(
        None, help="safetensors with packed latents [B, (H/16)(W/16), in_channels], as QwenImagePipeline(latents=)."),
    condition: Optional[Path] = typer.Option(
        None, help="safetensors with the edit pipelines' packed condition latents image_latents "
                   "[B or 1, Nc, in_channels] and condition_grids [K, 2] (each image's patch grid): "
                   "joined to the noisy tokens at every forward. One row fits any batch; B > 1 rows "
                   "set the run's batch when --batch/--samples are absent, and must equal it when "
                   "given."),
    tp: int = _layout.tp_option(),
    sp: int = _layout.sp_option(),
    sp_attention: Optional[str] = _layout.sp_attention_option(),
    cfg_parallel: int = _layout.cfg_parallel_option(),
    overwrite: bool = typer.Option(False, help="Replace an existing artifact directory."),
    as_json: bool = _json.option(),
) -> None:
    """Run a CFG/SDE trajectory (strict by default) and write its Arrow artifact to OUT.

    With no model arguments it runs the embedded default fixture (tiny-t2i). `--device cuda`
    loads the model straight onto the GPU (strict there runs the strict CUDA family, contract cuda1:
    its bytes differ from strict CPU's; compare them with `diff --tolerance`);
    `--height/--width` set the image size; `--prompt-embeds`, `--negative-prompt-embeds` and
    `--latents` take a real pipeline's inputs from safetensors files, `--condition` an edit
    pipeline's packed condition-image latents. Under torchrun
    (`torchrun --nproc-per-node 2 -m drifttool run --batch 4 -o DIR`) the ranks run the batch's
    samples sample-parallel (gloo on the CPU) and write one artifact; rank 0 prints. With
    `--tp/--sp/--cfg-parallel` (their product = the number of ranks) the ranks run every sample
    under that parallel layout instead, and the artifact diffs identical to one process
    (`--sp-attention ring` captures L0, L1, or L2 with `--no-internals`). A layout the model or the run cannot take is
    refused in one line before any rank starts. `--prompt` (with a pipeline folder holding
    tokenizer/, text_encoder/ and vae/; without --checkpoint the shipped tiny pipeline of the
    tiny-t2i-chain fixture) runs the full chain in one process: the prompt is
    encoded, the trajectory run and its final latents decoded to OUT.png, each stage captured
    under its own component (text_encoder, mmdit, vae). `--image COND.png` runs an edit from its
    condition image, resized as the edit pipelines resize it (its VAE encode before the trajectory); with
    `--prompt` (or, with an edit fixture such as tiny-edit, its prompts) the prompt is encoded
    with the image(s) through the text encoder's vision tower.
    """
    from drifttool.distributed import launch_env  # lazy: keeps torch out of `drifttool --help`
    from drifttool.runner import execute  # lazy: likewise
    from drifttool.settings import RunSpec, resolve  # lazy: likewise

    spec = RunSpec(
        fixture=fixture, checkpoint=checkpoint, variant=variant, steps=steps, cfg_scale=cfg_scale, eta=eta,
        batch=batch, samples=_samples(samples), mode=mode, capture=capture, internals=internals is not False, seed=seed,
        dtype=dtype, cfg_layout=cfg_layout, lora=lora, lora_mode=lora_mode, preset=preset, device=device, height=height,
        width=width, prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
        latents=latents, condition=condition,
    )
    if image_area is not None and not image:
        raise DriftToolError("--image-area goes with --image")
    if image:
        _image_run(spec, out, image, prompt=prompt, negative_prompt=negative_prompt,
                   positions=None if prompt_positions is None else prompt_positions.value,
                   area=image_area, overwrite=overwrite, as_json=as_json,
                   parallel=(tp, sp, cfg_parallel) != (1, 1, 1) or launch_env() is not None)
        return
    with alike_on_every_rank():
        _stage_fixture(fixture, prompt is not None)
    if prompt is not None or negative_prompt is not None:
        _prompt_run(spec, out, prompt, negative_prompt, overwrite=overwrite, as_json=as_json,
                    parallel=(tp, sp, cfg_parallel) != (1, 1, 1) or launch_env() is not None)
        return
    with alike_on_every_rank():  # the command line and its files only: one line for the launch
        fx, settings = resolve(spec)
        dims = _layout.layout_dims(tp, sp, sp_attention, cfg_parallel)
        _layout.check_layout(dims, **_layout.settings_layout(fx, settings),
                             capture_from="the fixture's default" if capture is None else "")
    launch = launch_env()
    with alike_on_every_rank():
        _layout.check_launch(dims, launch, "run")
    # one process without torchrun; under it, rank r runs on cuda:LOCAL_RANK for --device cuda
    dist, summary = _layout.on_ranks(
        dims, settings.device, f"{settings.mode.value} rollout", settings.steps, len(settings.samples),
        settings.cfg_branches, lambda **kw: execute(spec, out, overwrite=overwrite, **kw),
        quiet=as_json)
    if dist.rank != 0:
        return
    if as_json:
        _json.emit("run", {**summary, "settings": settings.record(), "ranks": _layout.ranks_data(dims, dist),
                           "cfg": settings.cfg_branches == 2, "image_px": list(settings.image_size),
                           "device": settings.device})
    else:
        table = Table(title=f"drifttool run → {out}", show_header=False)
        for key in ("mode", "capture", "steps", "samples", "complete"):
            table.add_row(key, shown(summary[key]))
        if (ranks := _layout.ranks_row(dims, dist)) is not None:
            table.add_row("ranks", ranks)
        record = settings.record()
        for key, value in settings_rows(record):
            table.add_row(key, value)
        table.add_row("CFG", "on (cond, uncond)" if settings.cfg_branches == 2 else "off (one branch)")
        table.add_row("image", "{}x{} px".format(*settings.image_size))
        table.add_row("device", settings.device)
        for key, value in graph_rows(summary):
            table.add_row(key, value)
        for role, rec in (record.get("input_files") or {}).items():
            table.add_row(role, f"{rec['path']} (sha256 {rec['sha256'][:12]}…)")
        console.print(table)
    if summary["nonfinite"]:
        err.print(f"[bold yellow]warning:[/] {summary['nonfinite']} non-finite values in the "
                  "trajectory's latents and velocities (recorded in the artifact's non-finite counts)")
    if settings.cfg_branches == 1 and settings.cfg_scale > 1:
        err.print(f"[bold yellow]note:[/] CFG is off although cfg_scale is {settings.cfg_scale:g}: "
                  "no negative prompt was given (diffusers' rule; add --negative-prompt-embeds)")
    if (summary.get("lora") or {}).get("alpha_given") is False:
        err.print("[bold yellow]note:[/] the LoRA adapter has no alpha (no adapter_config.json, no "
                  "metadata): scale 1 (alpha = r, diffusers' convention), recorded as lora.alpha_given false")
    for line in summary.get("warnings", []):
        err.print(f"[bold yellow]warning:[/] checkpoint: {escape(line)} (recorded in the manifest's "
                  "checkpoint_warnings)", highlight=False)
    for line in summary.get("notes", []):
        notice("note", line)
    if (line := graph_warning(summary)) is not None:
        notice("warning", line)
    if settings.mode.value == "off":
        err.print("[bold yellow]note:[/] --mode off captures nothing: this run has replay inputs but "
                  "no records to diff")
    elif (line := internals_note(internals, settings.mode.value, settings.capture)) is not None:
        notice("note", line)


def _image_run(spec, out: Path, images: list[Path], *, prompt: Optional[str], negative_prompt: Optional[str],
               positions: Optional[str], area: Optional[int], overwrite: bool, as_json: bool,
               parallel: bool) -> None:
    """``run --image``: an edit run from its condition images (``drifttool.chain_edit``), its
    prompt (``--prompt``, else an edit fixture's) encoded with the image."""
    from drifttool.chain_edit import run_edit  # lazy: keeps torch out of `drifttool --help`

    if prompt is None and negative_prompt is not None:
        raise DriftToolError("--negative-prompt goes with --prompt")
    if parallel:
        raise DriftToolError("--image runs in one process (no torchrun, --tp, --sp or --cfg-parallel)")
    summary = run_edit(spec, out, condition_images=images, overwrite=overwrite,
                       prompts=None if prompt is None else [prompt],
                       negative_prompts=None if negative_prompt is None else [negative_prompt],
                       positions=positions, vae_area=area)
    stages = "vae (encode) → mmdit → vae (decode)"
    _chain_summary(summary, out, stages=stages if summary["prompts"] is None else "text_encoder → " + stages,
                   as_json=as_json)


def _chain_summary(summary: dict, out: Path, *, stages: str, as_json: bool) -> None:
    """The summary of a chain or edit run: a table (or ``--json``) and its notes."""
    if as_json:
        _json.emit("run", summary)
        return
    table = Table(title=f"drifttool run → {out}", show_header=False)
    for key in ("mode", "capture", "steps", "samples", "complete"):
        table.add_row(key, shown(summary[key]))
    if "cfg" in summary:
        table.add_row("CFG", "on (cond, uncond)" if summary["cfg"] else "off (one branch)")
    table.add_row("stages", stages)
    for path in summary["images"]:
        table.add_row("image", path)
    console.print(table)
    for line in summary.get("warnings", []) + summary.get("notes", []):
        notice("note", line)


def _prompt_run(spec, out: Path, prompt: Optional[str], negative_prompt: Optional[str], *,
                overwrite: bool, as_json: bool, parallel: bool) -> None:
    """``run --prompt``: the full chain (``drifttool.chain``) in one process."""
    from drifttool.chain import run_chain  # lazy: keeps torch out of `drifttool --help`

    if prompt is None:
        raise DriftToolError("--negative-prompt goes with --prompt")
    if parallel:
        raise DriftToolError("--prompt runs in one process (no torchrun, --tp, --sp or --cfg-parallel)")
    if spec.condition is not None:
        raise DriftToolError("--prompt runs the text-to-image chain; --condition (edit pipelines) takes "
                             "--prompt-embeds, not --prompt, for now")
    summary = run_chain(spec, out, prompts=[prompt],
                        negative_prompts=None if negative_prompt is None else [negative_prompt],
                        overwrite=overwrite)
    _chain_summary(summary, out, stages="text_encoder → mmdit → vae", as_json=as_json)
