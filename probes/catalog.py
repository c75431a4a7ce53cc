"""The declared probe matrix: one-factor mismatch probes, invariant controls, sensitivity controls.

    >>> names = [p.name for p in catalog()]
    >>> len(names), names[:3]
    (37, ['latent_pack_channels_last', 'timestep_pipeline_bf16', 'stream_weights_swapped'])

``catalog(settings, num_layers)`` builds the list for a baseline (the resolved run settings and
the model depth): expectations that name a step, a block or a row are computed from them, so the
same declarations hold for the tiny preset and for a checkpoint. Every mismatch probe names the
operator where its first drift must appear; the matrix judges the diff against it
(``drifttool.probes.runner``). Baseline: the fixture's settings in strict mode (for ``tiny``:
2 samples, prompts of 7 and 13 tokens, a 3-token negative prompt, batched CFG, 4 steps with the
SDE window over steps 0–2 and a deterministic last step, bf16 weights, capture L2).

RFC factors covered (mismatch): latent layout/normalisation, timestep encoding, stream weights,
sequence order, RoPE, Q/K preprocessing, modulation, GELU, sigma schedule, CFG, step precision,
noise, distributed metadata; plus the prompt mask. Controls (invariant): repeat, batch position,
batch size, prompt padding, CFG layout, replay, training recompute and gradient checkpointing
(``drifttool.probes.controls``, run on ``drifttool.training``). The suspects users report (LoRA
merged vs unmerged and its merge dtype, RoPE table device, text mask None vs all-ones, strided DP
split, training micro-batch, attention kernel fallback, a prompt encoded alone vs padded in a
batch through the prompt chain) are ``drifttool.probes.suspects``,
declared for strict and for the production family (``catalog(family="production")``). TP/SP and CFG-parallel layouts
are the distributed group (``distributed_catalog``, ``drifttool probe --distributed``): planted
parallel faults and layout controls, each a layout on spawned gloo ranks against one process
(``drifttool.probes.distributed``).
"""

from __future__ import annotations

from typing import Any

from drifttool.probes import controls as C
from drifttool.probes import sampler_variants as SV
from drifttool.probes import variants as V
from drifttool.probes.distributed import distributed_probes
from drifttool.probes.spec import Expectation, Probe
from drifttool.probes.suspects import production_probes, suspect_probes
from drifttool.probes.weights import swap_stream_qkv

TINY_SETTINGS: dict[str, Any] = {
    "img_grid": [4, 6], "steps": 4, "samples": [0, 1], "cfg_scale": 4.0, "eta": 1.2,
    "dtype": "bfloat16",
    "prompt_len": 13,  # longest prompt of the batch (tokens), negative prompt included
    "rope": {"axes_dims": [4, 6, 6], "theta": 10000},  # the tiny model's RoPE
}

RFC_FACTORS = (
    "latent layout/normalisation", "timestep encoding", "stream weights", "sequence order",
    "RoPE", "Q/K preprocessing", "modulation", "GELU", "sigma schedule", "CFG", "step precision",
    "noise", "distributed metadata",
)


def _v(cls, *args: Any, **kwargs: Any):
    """``(variant name, factory)`` for ``Probe.variants``."""
    name = kwargs.pop("name", None) or cls.name
    return name, (lambda: cls(*args, **kwargs))


def _drift(op: str, **where: Any) -> Expectation:
    return Expectation(verdict="drift", op=op, **where)


IDENTICAL = Expectation(verdict="identical")


def mismatch_probes(settings: dict[str, Any], num_layers: int) -> list[Probe]:
    """One factor at a time, each a mistake a real pipeline made (``variants`` docstring)."""
    steps = int(settings["steps"])
    samples = list(settings["samples"])
    out = [
        Probe(name="latent_pack_channels_last", factor="latent layout/normalisation",
              kind="mismatch",
              change="2x2 latent patches packed (dy, dx, c) instead of (c, dy, dx); outputs "
                     "unpacked the same way",
              source="numerics §3.2 (channel = c*4 + dy*2 + dx)",
              variants={"latent_proj_gemm": _v(V.LatentPackChannelsLast)},
              expect=_drift("latent_proj_gemm", step=0, block=-1, stream="img")),
        Probe(name="timestep_pipeline_bf16", factor="timestep encoding", kind="mismatch",
              change="model timestep bf16(bf16(1000*sigma)/1000) as QwenImagePipeline passes it, "
                     "instead of fp32 sigma",
              source="numerics §3.4, §5.2",
              spec={"timestep_policy": "pipeline_bf16"},
              # sigma_0 = 1 encodes exactly: the first step that moves is step 1
              expect=_drift("timestep_embed_mlp", step=1, block=-1, stream="none")),
        Probe(name="stream_weights_swapped", factor="stream weights", kind="mismatch",
              change="checkpoint mapper loads to_q/to_k/to_v into add_q/k/v_proj and back",
              source="RFC qwenimage_checkpoint_mapper (both stream weight maps)",
              weights=swap_stream_qkv,
              expect=_drift("qkv_bias_gemm", step=0, block=0, stream="img")),
        Probe(name="sequence_image_first", factor="sequence order", kind="mismatch",
              change="joint attention over [image, text] instead of [text, image] (same math, "
                     "other key reduction order)",
              source="numerics §2.4",
              variants={op: _v(V.SequenceImageFirst, op)
                        for op in ("joint_attn_softmax", "joint_attn_av_gemm",
                                   "joint_attention_fused")},
              expect=_drift("joint_attn_softmax", step=0, block=0, stream="joint")),
        Probe(name="rope_rotate_half", factor="RoPE", kind="mismatch",
              change="rotate-half pairs (x_j, x_j+D/2) instead of interleaved (x_2j, x_2j+1)",
              source="numerics §2.2, §5.8",
              variants={"multi_axis_rope": _v(V.RopeRotateHalf)},
              expect=_drift("multi_axis_rope", step=0, block=0, stream="img")),
        Probe(name="rope_text_offset_zero", factor="RoPE", kind="mismatch",
              change="text RoPE positions start at 0 instead of max(h//2, w//2)",
              source="numerics §2.2, §5.8",
              variants={"multi_axis_rope": _v(V.RopeTextOffsetZero)},
              expect=_drift("multi_axis_rope", step=0, block=0, stream="txt")),
        Probe(name="qk_norm_no_gain", factor="Q/K preprocessing", kind="mismatch",
              change="parameter-free Q/K RMSNorm (learned gains dropped)",
              source="numerics §2.4, §2.5",
              variants={"qk_rmsnorm": _v(V.QKNormNoGain)},
              expect=_drift("qk_rmsnorm", step=0, block=0, stream="img")),
        Probe(name="final_shift_scale_swapped", factor="modulation", kind="mismatch",
              change="final AdaLN read as (shift, scale); norm_out stores (scale, shift)",
              source="numerics §2 step 8, §5.5",
              variants={"final_adaln_out": _v(V.FinalShiftScaleSwapped)},
              expect=_drift("final_adaln_out", step=0, block=num_layers, stream="img", blocks=num_layers)),
        Probe(name="gelu_exact", factor="GELU", kind="mismatch",
              change="erf GELU instead of the tanh approximation",
              source="numerics §2.3",
              variants={"mlp_up_gemm_gelu": _v(V.GeluExact)},
              expect=_drift("mlp_up_gemm_gelu", step=0, block=0, stream="img")),
        Probe(name="sigma_seq_len_pixels", factor="sigma schedule", kind="mismatch",
              change="dynamic shift from H'*W' latent pixels (4N) instead of N packed tokens",
              source="numerics §3.3",
              variants={"flow_sigma_table": _v(SV.SigmaSeqLenPixels)},
              expect=_drift("flow_sigma_table", step=-1, stream="none")),
        Probe(name="cfg_renorm_off", factor="CFG", kind="mismatch",
              change="CFG without the per-token rescale to |v_cond|",
              source="numerics §3.4",
              variants={"cfg_combine_renorm": _v(SV.CfgRenormOff)},
              expect=_drift("cfg_combine_renorm", step=0, branch="cfg")),
        Probe(name="cfg_renorm_global", factor="CFG", kind="mismatch",
              change="CFG rescale by whole-image norms instead of per-token norms",
              source="numerics §5.12",
              variants={"cfg_combine_renorm": _v(SV.CfgRenormGlobal)},
              expect=_drift("cfg_combine_renorm", step=0, branch="cfg")),
        Probe(name="euler_bf16_product", factor="step precision", kind="mismatch",
              change="deterministic step as diffusers' scheduler: dsigma*v in bf16, latents bf16",
              source="numerics §3.4, §5.4",
              variants={"flow_sde_step_logp": _v(SV.EulerBf16Product)},
              # the SDE window covers steps 0..N-2; the last step is the deterministic one
              expect=_drift("flow_sde_step_logp", step=steps - 1)),
        Probe(name="latents_bf16", factor="step precision", kind="mismatch",
              change="next latent stored in bf16 between steps (logp on the fp32 sample)",
              source="numerics §5.3",
              variants={"flow_sde_step_logp": _v(SV.LatentsBf16)},
              expect=_drift("flow_sde_step_logp", step=0)),
        Probe(name="noise_global_rng", factor="noise", kind="mismatch",
              change="SDE noise from one generator consumed in batch and step order (global RNG) "
                     "instead of pinned per-sample streams",
              source="numerics §4.1 (Flow-GRPO: no generator for the SDE noise)",
              variants={"flow_sde_step_logp": _v(SV.NoiseGlobalRng)},
              expect=_drift("flow_sde_step_logp", step=0)),
        Probe(name="cfg_off", factor="CFG", kind="mismatch",
              change="CFG off (scale 1) for the same samples: the cond velocity alone drives the "
                     "step, as a trainer that recomputes without guidance",
              source="user reports: CFG multiplies log-prob drift about 20x; sampling and "
                     "training CFG must match",
              spec={"cfg_scale": 1.0},
              # step 0 runs the same cond forward; the uncond and cfg records exist in the
              # baseline only, so the first drift is carried into step 1 (no origin claimed).
              # The semantic pre-check names the cause first: "CFG: on (scale 4.0) vs off".
              expect=Expectation(verdict="drift", op="latent_proj_gemm", step=1, block=-1,
                                 stream="img", origin=False)),
        Probe(name="attn_mask_dropped", factor="prompt mask", kind="mismatch",
              change="padded prompt tokens attended (key mask dropped)",
              source="numerics §5.1 (diffusers 0.35/0.36)",
              variants={op: _v(V.AttnMaskDropped, op)
                        for op in ("joint_attn_softmax", "joint_attention_fused")},
              expect=_drift("joint_attn_softmax", step=0, block=0, stream="joint")),
    ]
    if settings.get("dtype") == "float32":
        # ~1e-4 in fp32 (numerics §2.1); in a bf16 model the strict operator's single rounding at
        # its output absorbs it on the tiny preset, so the probe is declared for fp32 only.
        out.insert(2, Probe(
            name="timestep_scale_first", factor="timestep encoding", kind="mismatch",
            change="sinusoid angle (1000*tau)*f instead of (tau*f)*1000",
            source="numerics §2.1, §5.7",
            variants={"timestep_embed_mlp": _v(V.TimestepScaleFirst)},
            expect=_drift("timestep_embed_mlp", step=1, block=-1, stream="none")))
    if len(samples) >= 2:
        data = samples[::-1]
        out.append(Probe(
            name="sample_ids_mislabelled", factor="distributed metadata", kind="mismatch",
            change=f"rows computed for samples {data} but labelled {samples} (a rank's "
                   "local-to-global sample map reversed)",
            source="RFC dist metadata; design.md identity (logical sample id)",
            spec={"samples": data, "sample_labels": samples},
            # the timestep embedding is the same for every sample: the prompt is the first input
            # that differs between the two samples
            expect=_drift("txt_in_rmsnorm_linear", step=0, block=-1, stream="txt",
                          sample=samples[0])))
    else:
        out.append(Probe(name="sample_ids_mislabelled", factor="distributed metadata",
                         kind="mismatch", change="sample labels reversed",
                         expect=_drift("txt_in_rmsnorm_linear"),
                         pending="needs a baseline of at least 2 samples"))
    return out


def invariant_probes(settings: dict[str, Any], device: str = "cpu") -> list[Probe]:
    """Controls that must not move a byte; the training controls' runs capture at
    ``controls.TRAIN_CAPTURE`` on ``device`` (a device type)."""
    capture = C.train_capture(device)
    samples = list(settings["samples"])
    extra = max(samples) + 1
    longest = int(settings["prompt_len"])
    return [
        Probe(name="repeat", factor="repeated execution", kind="invariant",
              change="the baseline run again", expect=IDENTICAL),
        Probe(name="batch_order_reversed", factor="batch position", kind="invariant",
              change=f"samples {samples[::-1]} instead of {samples}",
              spec={"samples": samples[::-1]}, expect=IDENTICAL),
        Probe(name="batch_single", factor="batch size", kind="invariant",
              change=f"sample {samples[-1]} alone (batch 1)",
              spec={"samples": [samples[-1]]}, compare="common_samples", expect=IDENTICAL),
        Probe(name="batch_three_shifted", factor="batch size and position", kind="invariant",
              change=f"samples {[extra, *samples]} (batch {len(samples) + 1}, every position "
                     "shifted)",
              spec={"samples": [extra, *samples]}, compare="common_samples", expect=IDENTICAL),
        Probe(name="prompt_padding", factor="prompt padding", kind="invariant",
              change=f"every prompt right-padded (masked) to {longest + 11} tokens",
              spec={"pad_prompts_to": longest + 11}, expect=IDENTICAL),
        Probe(name="cfg_sequential", factor="CFG layout", kind="invariant",
              change="cond and uncond as two forwards instead of one batched forward",
              spec={"cfg_layout": "sequential" if settings.get("cfg_layout") != "sequential"
                    else "batched"},
              expect=IDENTICAL),
        Probe(name="replay", factor="trajectory replay", kind="invariant",
              change="the trajectory re-executed from the baseline artifact's replay inputs",
              execute=C.replay_control, expect=IDENTICAL),
        Probe(name="train_recompute", factor="training recomputation", kind="invariant",
              change="v_t and logp_t of a LoRA rollout recomputed from the stored latents (phase "
                     "train, autograd, the adapter trainable)",
              execute=C.Recompute(capture), expect=IDENTICAL),
        Probe(name="gradient_checkpointing", factor="gradient checkpointing", kind="invariant",
              change="LoRA training recompute with gradients, gradient checkpointing on vs off "
                     "(v_t, logp_t and LoRA gradient records)",
              execute=C.Checkpointing(capture), expect=IDENTICAL),
    ]


def sensitivity_probes(settings: dict[str, Any], num_layers: int) -> list[Probe]:
    """1-ULP changes planted at one element; the diff must name operator, step, block, stream,
    branch, sample and the single differing row."""
    steps = int(settings["steps"])
    h, w = (int(v) for v in settings["img_grid"])
    samples = list(settings["samples"])
    cfg = float(settings.get("cfg_scale", 1.0)) > 1
    s_img = samples[-1]
    branch_img = "uncond" if cfg else "cond"
    step_img, block_img = min(1, steps - 1), min(1, num_layers - 1)
    row_img = min(13, h * w - 1)
    i, j = divmod(row_img, w)
    step_txt = min(2, steps - 1)
    return [
        Probe(name="ulp_img_mlp_down", factor="sensitivity (image row)", kind="sensitivity",
              change=f"lowest mantissa bit flipped in mlp_down_gemm (img) output, step "
                     f"{step_img}, block {block_img}, {branch_img} row of sample {s_img}, "
                     f"patch ({i}, {j})",
              variants={"mlp_down_gemm": _v(
                  V.PlantUlp, "mlp_down_gemm", step=step_img, block=block_img, call=0,
                  sample=s_img, branch=branch_img, row=row_img, rest=(1,))},
              expect=_drift("mlp_down_gemm", step=step_img, block=block_img, stream="img",
                            branch=branch_img, sample=s_img, rows=(f"img ({i}, {j})",))),
        Probe(name="ulp_txt_qk_rmsnorm", factor="sensitivity (text row)", kind="sensitivity",
              change=f"lowest mantissa bit flipped in qk_rmsnorm (txt q) output, step "
                     f"{step_txt}, block 0, cond row of sample {samples[0]}, text position 2",
              variants={"qk_rmsnorm": _v(
                  V.PlantUlp, "qk_rmsnorm", step=step_txt, block=0, call=2, sample=samples[0],
                  branch="cond", row=2, rest=(0, 1))},
              expect=_drift("qk_rmsnorm", step=step_txt, block=0, stream="txt", branch="cond",
                            sample=samples[0], rows=("txt 2",))),
    ]


FAMILIES = ("strict", "production")
"""The backend family a matrix's baseline runs (``drifttool probe --mode strict | auto``)."""


def catalog(settings: dict[str, Any] | None = None, num_layers: int = 2, *,
            family: str = "strict", device: str = "cpu") -> list[Probe]:
    """Every probe for a baseline with ``settings`` (default: the tiny preset's) and a model of
    ``num_layers`` blocks: mismatch probes, invariant controls, the suspects users report
    (``drifttool.probes.suspects``), sensitivity controls. ``family="production"`` (a baseline
    in mode auto) gives the suspects alone, with the production family's expectations on
    ``device`` (a device type, ``cpu`` or ``cuda``). The strict matrix's expectations and
    training capture level are ``device``'s too. On either, a probe whose variant or execution
    refuses ``device`` (``Probe.refusal``: a CPU-only variant, ranks that are CPU ranks) is
    pending there with the refusal as its reason.

    Raises:
        ValueError: an unknown family.
    """
    s = dict(TINY_SETTINGS, **(settings or {}))
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (one of {FAMILIES})")
    if family == "production":
        probes = production_probes(s, num_layers, device)
    else:
        probes = (mismatch_probes(s, num_layers) + invariant_probes(s, device)
                  + suspect_probes(s, num_layers, device) + sensitivity_probes(s, num_layers))
    names = [p.name for p in probes]
    if len(set(names)) != len(names):  # pragma: no cover - a declaration bug
        raise ValueError(f"duplicate probe names in {names}")
    out = []
    for p in probes:
        why = "" if p.pending else p.refusal(device)
        out.append(p.with_(pending=why) if why else p)
    return out


def probe(name: str, settings: dict[str, Any] | None = None, num_layers: int = 2) -> Probe:
    """One probe of ``catalog(settings, num_layers)`` by name.

    Raises:
        KeyError: no such probe (the message lists the names).
    """
    for p in catalog(settings, num_layers):
        if p.name == name:
            return p
    raise KeyError(f"no probe {name!r}; known: {[p.name for p in catalog(settings, num_layers)]}")


def distributed_catalog(settings: dict[str, Any] | None = None, num_layers: int = 2) -> list[Probe]:
    """The distributed probes for a baseline with ``settings`` and ``num_layers`` blocks
    (``drifttool.probes.distributed.distributed_probes``): not part of ``catalog()``, run with
    ``drifttool probe --distributed`` (every probe spawns gloo ranks)."""
    return distributed_probes(dict(TINY_SETTINGS, **(settings or {})), num_layers)
