"""Capture an unmodified diffusers ``QwenImagePipeline`` call into a drifttool artifact: the text
encoder, the denoising loop and the VAE decode, each stage under its own component.

    >>> run = capture_pipeline(pipe, "runs/pipe", level="L1", prompt="a red cube",
    ...                        negative_prompt="blurry", height=1024, width=1024,
    ...                        num_inference_steps=50, true_cfg_scale=4.0, generator=g,
    ...                        output_type="pil")
    >>> run.complete, run.steps, run.samples, run.output.images[0].size
    (True, 50, [0], (1024, 1024))
    >>> diff_runs(open_run("runs/chain"), open_run("runs/pipe")).verdict   # drifttool run --prompt
    <Verdict.IDENTICAL: 'identical'>

``pipe(**pipe_kwargs)`` runs as the user would run it, with prompt strings (encoded by the
pipeline's text encoder) or prompt embeddings passed directly, ``output_type="latent"`` unless
given. The stages, in program order (the manifest's ``stages`` lists those that ran):

========================  ==========================  =======================================
stage (component)         steps                       recorded by
========================  ==========================  =======================================
text_encoder              −1 (prompts, then negative  ``pipeline_stages.text_encoder_stage``:
(text_encoder)            prompts)                    transformers' Qwen2.5-VL
                                                      (``transformers_qwen25vl``)
vae_encode (vae)          −1 (edit pipelines: each    ``pipeline_stages.vae_encode_stage``
                          condition image)            (``diffusers_vae``)
transformer (mmdit) and   −1 (sigma table), 0..N−1    the transformer tap and the scheduler
its sampler                                           tap below
vae_decode (vae)          N (after the last step;     ``pipeline_stages.vae_decode_stage``
                          not with ``"latent"``)      (``diffusers_vae``)
========================  ==========================  =======================================

The stages before the loop run before the artifact opens (it opens at the transformer's first
call, when batch, grid, dtype and the sigma table are known): their records are digested as they
run and filed first, in program order, once it opens (``chain.DeferredCapture``, as drifttool's
own chain does), so a prompt capture diffs against ``drifttool run --prompt ... --checkpoint
PIPELINE --mode auto --preset diffusers`` record for record, every stage included.
An edit pipeline's prompt strings: its prompt images and vision tower are captured too
(``pipeline_prompt_images``), against ``drifttool run --image C.png --prompt ... --preset
diffusers-edit --prompt-positions sequential`` (``QwenImageEditPipeline``) or ``drifttool run
--image C1.png --image C2.png --prompt ... --preset diffusers-edit-plus --prompt-positions
sequential`` (``QwenImageEditPlusPipeline``: its ``EDIT_PLUS`` template, "Picture k:" per image,
each image resized apart for the text encoder).

``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline`` are captured the same way: their
``img_shapes`` name the condition images (scope ``cond_grids``, ``drifttool.model.conditions``),
the image-stream records hold the condition rows too, the step records and x0 the noisy rows
only, and the replay inputs store the condition latents the transformer received (``cond``,
``cond_grids``), so the capture diffs against ``drifttool run --preset diffusers-edit[-plus]
--image COND.png`` (the condition's VAE encode captured too), or with ``stages=("transformer",)``
against ``--condition FILE``. In the loop drifttool only watches:

* the transformer: a diffusers ``ModelHook`` (``pipeline_hooks.transformer_tap``) sets the
  runtime scope of each call — step (scheduler steps completed in this call), sigma (the
  scheduler's own table), CFG branch (the ``cache_context`` name, else the call order),
  samples ``0..B-1``, ``txt_lens``/``txt_starts`` from ``encoder_hidden_states_mask`` (None =
  all valid) and ``img_grid`` from ``img_shapes`` — and the capture adapter's hooks
  (``diffusers_qwenimage.instrument``) record every operator output under it, exactly as in
  a ``run_diffusers`` rollout;
* the scheduler: its ``step`` (wrapped on the instance, restored on exit) gives the velocity the
  step used (v_t after true CFG), x_t and x_next.

What is recorded, with drifttool's identities (``drifttool.sampling.rollout``):

==========================  ================================================================
op record (block sampler)   the tensor
==========================  ================================================================
flow_sigma_table #0         ``scheduler.sigmas`` after ``set_timesteps`` (step −1)
cfg_combine_renorm #0       the velocity passed to ``scheduler.step`` (CFG on): the pipeline's
                            inline ``u + s(c − u)`` rescaled to ``‖c‖``
flow_sde_step_logp #0       ``scheduler.step``'s ``prev_sample`` (x_next)
==========================  ================================================================

Step records per sample: branch ``cfg`` (``cond`` without CFG) holds x_t, v_t and x_next in
the pipeline's latent dtype; with CFG, ``cond`` and ``uncond`` hold each branch's v_t (the
transformer outputs). The Euler pipeline has no transition mean, noise scale or log-prob:
``mu``, ``std_t``, ``logp_t`` and ``flow_sde_step_logp`` outputs 1–3 are not written, and the
manifest declares them (``uncaptured``) so ``drifttool diff`` leaves them out on both sides
instead of reporting missing records.

Cost per transformer call: Python only (no device-to-host read); per pipeline call: the
scheduler's sigma table and each prompt mask are read to the host once, the initial latents and
prompt embeddings once at the end (``inputs.safetensors``), and each step's digests once when the
step is flushed (``Recorder.flush``); per text-encoder call its attention mask and kept rows once;
the weight digests (transformer, text encoder's language model, VAE) once per call.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

import torch

from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage, instrument
from drifttool.adapters.peft_lora import lora_of
from drifttool.adapters.pipeline_hooks import scheduler_tap, transformer_tap
from drifttool.adapters.pipeline_scope import TextRows, branch_of, image_grids_of, timestep_policy_of
from drifttool.adapters.pipeline_stages import (
    StageLog, select_stages, text_encoder_stage, vae_decode_stage, vae_encode_stage)
from drifttool.adapters.taps import record
from drifttool.chain import DeferredCapture
from drifttool.environment import environment
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.fingerprint import arch_fingerprint, sampler_record, tensor_digest
from drifttool.lifecycle import ArtifactSession
from drifttool.model.weights import weight_digest
from drifttool.runtime import Mode, Runtime
from drifttool.sampling.config import SAMPLER_BLOCK, SamplerConfig
from drifttool.sampling.inputs import RolloutInputs, replay_tensors
from drifttool.setting_checks import DTYPES, check_level

UNCAPTURED = {
    "steps": ["mu", "std_t", "logp_t"],
    "ops": [{"op": "flow_sde_step_logp", "index": i} for i in (1, 2, 3)],
    "reason": "the diffusers pipeline's Euler step (FlowMatchEulerDiscreteScheduler.step) "
              "computes x_next only: no transition mean, noise scale or log-prob exists",
}
"""The manifest's ``uncaptured``: records a drifttool rollout writes that this capture cannot."""

RESIZE_UNCAPTURED = {"op": "vae_image_resize", "index": 0}
"""With condition images, also uncaptured: the edit pipelines' resize of each condition image
(``VaeImageProcessor.resize``, called again inside ``preprocess`` on its own result, so the call
an edit run records is not told apart from the second)."""

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_KERNEL_CFG = "diffusers:QwenImagePipeline.__call__ (inline true CFG + norm rescale)"


@dataclass(kw_only=True)
class PipelineCapture:
    """Result of ``capture_pipeline``.

    Attributes:
        output: what ``pipe(**pipe_kwargs)`` returned (its latents with ``output_type="latent"``).
        out: the artifact directory.
        complete: every scheduler step ran (an interrupted pipeline leaves ``False``).
        steps: scheduler steps captured. samples: logical sample ids (batch rows ``0..B-1``).
        capture: the capture level.
    """

    output: Any
    out: str
    complete: bool
    steps: int
    samples: list[int]
    capture: str


class _PipelineCall:
    """The state of one captured pipeline call: the artifact opens at the first transformer
    call, when batch, grid, dtype and the scheduler's sigma table are known."""

    def __init__(self, pipe: Any, out: str | Path, level: str, overwrite: bool,
                 kwargs: dict[str, Any], stack: contextlib.ExitStack,
                 extra: dict[str, Any] | None = None, decode: bool = True) -> None:
        self.pipe, self.out, self.level, self.overwrite = pipe, out, level, overwrite
        self.decode = decode and kwargs["output_type"] != "latent"  # capture the VAE decode
        self.extra = dict(extra or {})
        self.kwargs, self.stack = kwargs, stack
        # the stages before the artifact opens (text encoder, condition encode): digested as they
        # run, filed first into the artifact when it opens (chain.DeferredCapture)
        self.early_capture = DeferredCapture(level)
        self.early = Runtime(mode=Mode.AUTO, recorder=self.early_capture)
        self.stages = StageLog()
        self.session: ArtifactSession | None = None
        self.text_rows = TextRows()
        self.step = 0  # scheduler steps completed in this call
        self.seen: list[str] = []  # branches called in the current step
        self.v: dict[str, torch.Tensor] = {}  # branch -> transformer output [B, N, C]
        self.cond_grids: tuple[tuple[int, int], ...] = ()  # edit pipelines' condition images
        self.inputs: dict[str, torch.Tensor | None] = {}  # first-step inputs, for the replay file

    # -- the transformer ----------------------------------------------------------------------
    def on_forward(self, context: str | None, args: dict[str, Any], run) -> Any:
        hs, txt = args["hidden_states"], args["encoder_hidden_states"]  # [B, N, C], [B, L, D]
        mask = args.get("encoder_hidden_states_mask")
        if self.session is None:
            self._open(args)
        branch = branch_of(context, seen=self.seen, step=self.step)
        self.seen.append(branch)
        n = self.grid[0] * self.grid[1]  # the noisy rows; the edit pipelines' condition rows follow
        if self.step == 0:
            prefix = "" if branch == "cond" else "neg_"
            self.inputs.update({"x0": hs[:, :n], f"{prefix}txt": txt, f"{prefix}mask": mask})
            if self.cond_grids:
                self.inputs["cond"] = hs[:, n:]
        rt = self.session.rt
        with rt.scope(phase="rollout", step=self.step, sigma=self.sigmas[self.step],
                      branch=branch, samples=self.samples, img_grid=self.grid,
                      cond_grids=self.cond_grids or None, **self.text_rows(txt, mask)):
            out = run()
        self.v[branch] = (out[0] if isinstance(out, tuple) else out.sample)[:, :n]
        return out

    # -- the scheduler -------------------------------------------------------------------------
    def on_step(self, call: dict[str, Any], output: Any) -> None:
        if self.session is None:
            raise DriftToolError("the scheduler stepped before the transformer ran: not a "
                                 "QwenImagePipeline denoising loop")
        if call.get("per_token_timesteps") is not None:
            raise UnsupportedConfigError("scheduler.step with per_token_timesteps: one sigma per "
                                         "step only")
        v, x = call["model_output"], call["sample"]  # [B, N, C] each
        x_next = output[0] if isinstance(output, tuple) else output.prev_sample
        rt, i = self.session.rt, self.step
        cfg_on = "uncond" in self.v
        branch = "cfg" if cfg_on else "cond"
        scope = dict(phase="rollout", step=i, sigma=self.sigmas[i], img_grid=self.grid,
                     samples=self.samples, txt_lens=None, txt_starts=None)
        with rt.scope(**scope, branch=branch):
            if cfg_on:
                record(rt, "cfg_combine_renorm", "img", v, "BS.", actual="diffusers",
                       kernel=_KERNEL_CFG, block=SAMPLER_BLOCK)
            record(rt, "flow_sde_step_logp", "img", x_next, "BS.", actual="diffusers",
                   kernel=f"diffusers:{type(self.pipe.scheduler).__name__}.step (Euler; x_next only)",
                   block=SAMPLER_BLOCK)
        rec = rt.recorder
        if rec is not None:
            common = dict(phase="rollout", step=i, sigma=self.sigmas[i],
                          sigma_next=self.sigmas[i + 1], rank=0)
            for b, sid in enumerate(self.samples):
                rec.record_step(**common, sample=sid, branch=branch,
                                quantities={"x_t": x[b], "v_t": v[b], "x_next": x_next[b]})
                if cfg_on:
                    for br in ("cond", "uncond"):
                        rec.record_step(**common, sample=sid, branch=br,
                                        quantities={"v_t": self.v[br][b]})
            rec.flush()  # the step's one read-back
        self.step += 1
        self.seen, self.v = [], {}

    # -- the artifact --------------------------------------------------------------------------
    def _open(self, args: dict[str, Any]) -> None:
        tr, sched = self.pipe.transformer, self.pipe.scheduler
        hs = args["hidden_states"]
        self.samples = list(range(int(hs.shape[0])))
        self.grid, self.cond_grids = image_grids_of(args.get("img_shapes"))
        policy = timestep_policy_of(args["timestep"].dtype)
        if tr.dtype not in _DTYPE_NAMES:
            raise UnsupportedConfigError(f"transformer dtype {tr.dtype}: one of {sorted(DTYPES)}")
        table = sched.sigmas.detach()  # [N + 1] fp32, on the pipeline's device
        if table.dtype != torch.float32 or table.dim() != 1:
            raise UnsupportedConfigError(f"scheduler.sigmas {table.dtype} {tuple(table.shape)}: "
                                         "an fp32 [num_steps + 1] table is expected")
        host = table.cpu()  # the call's one read of the table
        self.sigmas = [float(s) for s in host.tolist()]
        steps = len(self.sigmas) - 1
        if steps < 2:
            raise UnsupportedConfigError(f"{steps} scheduler step(s): the capture needs >= 2")
        sampler = SamplerConfig(num_steps=steps, cfg_scale=float(self._cfg_scale()), eta=0.0,
                                timestep_policy=policy, cfg_layout="sequential")
        model = DiffusersQwenImage(tr)
        manifest = self._manifest(model, sampler, host, hs.dtype)
        self.session = ArtifactSession(mode=Mode.AUTO, level=self.level, cfg_layout="sequential")
        self.stack.enter_context(self.session.open(self.out, manifest, overwrite=self.overwrite))
        rt = self.session.rt
        if self.session.recorder is not None:
            self.early_capture.file_into(self.session.recorder)
        rt.trace = self.early.trace  # still empty: the early stages' entries come first
        self.stack.enter_context(instrument(tr, rt))
        if self.decode:
            self.stack.enter_context(vae_decode_stage(self.pipe, rt, self._decode_scope, self.stages))
        with rt.scope(phase="rollout", step=-1, sigma=math.nan, branch="none", samples=None,
                      txt_lens=None, img_grid=self.grid):
            record(rt, "flow_sigma_table", "none", table, ".", actual="diffusers",
                   kernel=f"diffusers:{type(sched).__name__}.set_timesteps", block=SAMPLER_BLOCK)

    def _decode_scope(self) -> dict[str, Any]:
        """The decode's scope fields: after the steps run (all of them in a complete call)."""
        return {"step": self.step, "sigma": self.sigmas[self.step], "samples": list(self.samples)}

    def _cfg_scale(self) -> float:
        default = inspect.signature(self.pipe.__call__).parameters["true_cfg_scale"].default
        return self.kwargs.get("true_cfg_scale", default)

    def _manifest(self, model: DiffusersQwenImage, sampler: SamplerConfig, sigmas: torch.Tensor,
                  latent_dtype: torch.dtype) -> dict[str, Any]:
        dtype = self.pipe.transformer.dtype
        fp = arch_fingerprint(arch=model.config.arch_fields(), img_grid=self.grid,
                              weights=weight_digest(model), dtype=dtype, mode="auto",
                              sampler=sampler_record(sampler, sigmas))
        lat = _DTYPE_NAMES.get(latent_dtype, str(latent_dtype).removeprefix("torch."))
        fp["dtype_policy"].update(latents_between_steps=lat,
                                  sde_step_and_logp=f"float32 Euler step, x_next cast to {lat}; "
                                                    "no logp")
        sched = self.pipe.scheduler
        settings = {"fixture": None, "checkpoint": None, "mode": "auto", "capture": self.level,
                    "dtype": _DTYPE_NAMES[dtype], "steps": sampler.num_steps,
                    "cfg_scale": sampler.cfg_scale, "eta": 0.0, "seed": None,
                    "samples": list(self.samples), "img_grid": list(self.grid),
                    "cfg_layout": "sequential", "timestep_policy": sampler.timestep_policy}
        lora = lora_of(self.pipe.transformer)
        if lora is not None:
            settings["lora_mode"] = lora["mode"]
        source = {**model.source, "implementation": f"diffusers.{type(self.pipe).__name__}",
                  "adapter": "drifttool.adapters.diffusers_pipeline",
                  "scheduler": type(sched).__name__,
                  "scheduler_config": {k: v for k, v in dict(sched.config).items()
                                       if not k.startswith("_")}}
        manifest = {"kind": "rollout", "fingerprint": fp, "settings": settings,
                    "environment": environment(), "model_source": source, "variants": [],
                    "uncaptured": UNCAPTURED if not self.cond_grids else {
                        **UNCAPTURED, "ops": [*UNCAPTURED["ops"], RESIZE_UNCAPTURED],
                        "reason": UNCAPTURED["reason"] + "; the condition images' resize "
                                  "(VaeImageProcessor.resize) is not recorded"}}
        if lora is not None:
            manifest["lora"] = lora
        return {**manifest, **self.extra}

    def finish(self) -> bool:
        """Write the replay inputs (the first step's transformer inputs; x0 and the prompt
        embeddings upcast exactly to fp32, as ``RolloutInputs`` holds them and ``drifttool run``
        stores them, so a run fed the same values has the same input bytes) and close the
        artifact. Returns ``complete``."""
        got = self.inputs
        neg = got.get("neg_txt")
        inputs = RolloutInputs(
            sample_ids=list(self.samples), x0=got["x0"].detach().float().cpu(),
            txt=got["txt"].detach().float().cpu(), img_grid=self.grid,
            txt_mask=None if got.get("mask") is None else got["mask"].detach().cpu().bool(),
            neg_txt=None if neg is None else neg.detach().float().cpu(),
            neg_mask=None if got.get("neg_mask") is None else got["neg_mask"].detach().cpu().bool(),
            cond=None if got.get("cond") is None else got["cond"].detach().float().cpu(),
            cond_grids=self.cond_grids)
        tensors = replay_tensors(inputs)
        self.session.write_inputs(tensors)
        lens = inputs.txt_mask.sum(-1).tolist() if inputs.txt_mask is not None \
            else [int(inputs.txt.shape[1])] * inputs.batch
        complete = self.step == len(self.sigmas) - 1
        self.session.finish(complete=complete, stages=self.stages.stages(self.step), replay={
            "noise": None, "inputs": "inputs.safetensors", "prompt_lengths": lens,
            "input_digests": {k: tensor_digest(v) for k, v in tensors.items()}})
        return complete


def capture_pipeline(pipe: Any, out: str | Path, *, level: str = "L1", overwrite: bool = False,
                     manifest_extra: dict[str, Any] | None = None,
                     stages: Collection[str] | None = None, **pipe_kwargs: Any) -> PipelineCapture:
    """Run ``pipe(**pipe_kwargs)`` — an unmodified diffusers ``QwenImagePipeline`` (or edit
    pipeline) — and write its drifttool artifact to ``out`` (module docstring: the stages, what
    is recorded, and how).

    Args:
        pipe: the pipeline (``transformer`` a ``QwenImageTransformer2DModel``, ``scheduler`` a
            first-order flow-matching scheduler such as ``FlowMatchEulerDiscreteScheduler``;
            ``text_encoder`` a transformers Qwen2.5-VL model for prompt strings, ``vae`` an
            ``AutoencoderKLQwenImage`` for a decode or condition images).
        out: artifact directory. level: ``L0``/``L1``/``L2``. overwrite: replace ``out``.
        manifest_extra: keys added to the manifest (a replay's ``replay_of``:
            ``drifttool.training.pipeline_replay``).
        stages: the stages to capture (``text_encoder``, ``vae_encode``, ``transformer``,
            ``vae_decode``); None: every stage the call runs. ``("transformer",)`` captures the
            loop alone, to diff against a run from embedding and condition files.
        pipe_kwargs: the pipeline call's arguments: ``prompt`` (and ``negative_prompt``) strings,
            encoded by the pipeline's text encoder and captured, or ``prompt_embeds`` (and their
            masks) as the pipeline takes them; ``output_type`` defaults to ``"latent"`` (no
            decode); any other (``"pil"``, ``"np"``, ``"pt"``) decodes, captured.

    Returns:
        ``PipelineCapture`` (the pipeline's own output included).

    The manifest's settings describe the call: ``steps`` (the scheduler's), ``cfg_scale`` =
    ``true_cfg_scale``, ``img_grid`` = (height, width) / 16, ``dtype`` (the transformer's),
    ``samples`` 0..B−1, ``cfg_layout`` sequential, ``eta`` 0, ``timestep_policy`` from the
    latent dtype (bf16: ``pipeline_bf16``), ``seed`` null (the pipeline's generator is not
    drifttool's). Its ``stages`` lists the stages captured in program order (``pipeline_stages``).
    A LoRA adapter the transformer carries (``load_lora_weights``, fused or not, or a peft
    wrapper) is recorded as ``drifttool run --lora`` records it (``lora``, ``settings.lora_mode``;
    ``peft_lora.lora_of``): the capture diffs IDENTICAL against ``drifttool run --lora ADAPTER
    --lora-mode <its mode>``.
    Every hook and wrapper is removed on exit, also on error; an error after the artifact
    opened leaves it ``complete: false`` with the finished steps.

    Raises:
        DriftToolError: diffusers missing, not a QwenImage pipeline, or the transformer never ran.
        UnsupportedConfigError: as ``pipeline_stages.select_stages``; an edit pipeline's prompt
            strings with an image processor drifttool does not reproduce
            (``pipeline_prompt_images``); a scheduler of order > 1;
            a call the scope cannot name (``pipeline_scope``); a transformer dtype drifttool
            does not run.
        ArtifactError: ``out`` cannot be created.
    """
    check_level(level)
    if not all(hasattr(pipe, a) for a in ("transformer", "scheduler")) or not callable(pipe):
        raise DriftToolError(f"expected a diffusers QwenImagePipeline (a callable with .transformer "
                             f"and .scheduler), got {type(pipe).__name__}")
    kwargs = {"output_type": "latent", **pipe_kwargs}
    want = select_stages(pipe, kwargs, stages)
    if getattr(pipe.scheduler, "order", 1) != 1:
        raise UnsupportedConfigError(f"scheduler {type(pipe.scheduler).__name__} of order "
                                     f"{pipe.scheduler.order}: one step call per step only")
    with contextlib.ExitStack() as stack:
        call = _PipelineCall(pipe, out, level, overwrite, kwargs, stack, manifest_extra,
                             decode="vae_decode" in want)
        if "text_encoder" in want:
            stack.enter_context(text_encoder_stage(pipe, call.early, call.stages))
        if "vae_encode" in want:
            stack.enter_context(vae_encode_stage(pipe, call.early, call.stages))
        stack.enter_context(transformer_tap(pipe.transformer, call.on_forward))
        stack.enter_context(scheduler_tap(pipe.scheduler, call.on_step))
        output = pipe(**kwargs)
        if call.session is None:
            raise DriftToolError("the pipeline never called its transformer: nothing to capture")
        complete = call.finish()
    return PipelineCapture(output=output, out=str(out), complete=complete, steps=call.step,
                           samples=list(call.samples), capture=level)
