"""The suspects users report, each a one-factor probe declared for the strict matrix and for the
production family (drifttool's production operators, byte-equal to diffusers' arithmetic).

    >>> [p.name for p in suspect_probes(TINY_SETTINGS, 2)][:2]
    ['lora_unmerged', 'lora_merge_bf16']
    >>> production_probes(TINY_SETTINGS, 2, "cpu")[0].expect.describe()
    'drift at qkv_bias_gemm (img, step 0, block 0)'

``suspect_probes`` joins ``catalog()`` (``drifttool probe``, mode strict); ``production_probes``
is the matrix of ``drifttool probe --mode auto``: the same probes with the production family's
expectation on the device the matrix runs on (``cpu``, ``cuda``), each measured there, or
``pending`` with the reason when none is declared. Where a probe needs more than its change (a
LoRA adapter, a batch that pads nothing, ranks), its ``execute`` makes a reference run of those
settings and the probe run differs from it in exactly the one factor:

=====================  ==========================================================================
probe                  reference run → probe run
=====================  ==========================================================================
lora_unmerged          baseline + a LoRA adapter merged into W (``lora_mode`` merged) → the same
                       adapter unmerged, its branch added to the GEMM output (``unfused-fp32``:
                       peft's LoRA layers with FP32 factors, as a Flow-GRPO trainer runs it)
lora_merge_bf16        baseline + adapter merged in fp32 → merged in bf16 (variant on lora_merge)
rope_tables_on_device  baseline → RoPE tables rebuilt on the activations' device (variant)
text_mask_all_ones     sample alone, CFG sequential, so no prompt is padded and the model passes
                       no key mask (``None``) → the same with an all-ones mask (variant)
dp_split_strided       4 samples sample-parallel on 2 spawned gloo ranks, split contiguously
                       ([0, 1] | [2, 3]) → split strided ([0, 2] | [1, 3])
train_micro_batch      strict: a LoRA rollout of the baseline spec → its training recompute (the
                       adapter trainable) in micro-batches of one sample (prompts trimmed to it)
                       instead of the rollout's batch (``controls.Recompute``); production: the
                       baseline → its recompute in micro-batches of one sample
text_encoder_batch     the prompt chain (text encoder → trajectory → VAE) on the tiny pipeline
                       folder, a prompt alone → the same prompt batched with a longer one (so
                       padded); compared on the shared sample
attention_fallback     strict: the strict joint attention planted unavailable under mode audit, so
                       dispatch falls back to the production SDPA kernel (the trace records the
                       fallback and its reason); production: SDPA forced to its MATH kernel
=====================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from drifttool.artifact.reader import open_run
from drifttool.chain import PIPELINE_PARTS, default_pipeline, run_chain
from drifttool.distributed.plan import ParallelDims
from drifttool.errors import UnsupportedConfigError
from drifttool.launch import run_parallel
from drifttool.probes import suspect_variants as SU
from drifttool.probes.controls import Recompute, lora_adapter, train_capture
from drifttool.probes.spec import Expectation, Probe, ProbeContext, first_refusal
from drifttool.runner import execute
from drifttool.settings import resolve
from drifttool.training.options import RerunOptions, TrainOptions
from drifttool.training.recompute import recompute_run

DP_RANKS = 2
ATTENTION_OPS = ("joint_attn_softmax", "joint_attn_av_gemm", "joint_attention_fused")


def _v(cls, *args: Any, **kwargs: Any):
    return cls.name, (lambda: cls(*args, **kwargs))


def _build(variants: dict) -> dict:
    return {op: (name, factory()) for op, (name, factory) in variants.items()}


@dataclasses.dataclass(frozen=True)
class Paired:
    """``Probe.execute``: a reference run of the baseline spec with ``settings`` (and ``lora``: a
    small adapter, ``controls.lora_adapter``), and the probe run of the same plus ``change``
    (``RunSpec`` fields) and ``variants`` (``{op: (name, factory)}``).

    The probe is NOT APPLICABLE (``ProbeContext.noop``) when its variants count their changes
    (``applied``) and none changed a call, or when ``noop_on`` names the run's device type
    (``noop_on = (device type, reason)``: a change that cannot exist there). It refuses a device
    type one of its variants refuses (``refuses``, ``Probe.refusal``).
    """

    settings: dict = dataclasses.field(default_factory=dict)
    change: dict = dataclasses.field(default_factory=dict)
    variants: dict = dataclasses.field(default_factory=dict)
    lora: bool = False
    noop_on: tuple[str, str] | None = None

    def refuses(self, device: str) -> str:
        """The first refusal of ``device`` among its variants (empty: none refuses)."""
        return first_refusal([v for _, v in _build(self.variants).values()], device)

    def __call__(self, ctx: ProbeContext) -> tuple[Path, Path]:
        over = dict(self.settings)
        if self.lora:
            over["lora"] = lora_adapter(ctx)
        spec = dataclasses.replace(ctx.base, **over)
        reference = ctx.work / "reference"
        where = dict(dist=ctx.dist, parallel=ctx.parallel)
        execute(spec, reference, overwrite=True, **where)
        variants = _build(self.variants)
        execute(dataclasses.replace(spec, **self.change, variants={**spec.variants, **variants}),
                ctx.run_dir, overwrite=True, **where)
        counted = [(name, v.applied) for name, v in variants.values() if hasattr(v, "applied")]
        if counted and not any(n for _, n in counted):
            ctx.noop["reason"] = (f"no-op on these inputs: {counted[0][0]} changed none of its "
                                  "calls")
        elif self.noop_on is not None and resolve(spec)[1].device.split(":")[0] == self.noop_on[0]:
            ctx.noop["reason"] = self.noop_on[1]
        return reference, ctx.run_dir


@dataclasses.dataclass(frozen=True)
class DataParallelSplit:
    """``Probe.execute``: ``samples`` sample-parallel on ``ranks`` spawned gloo ranks
    (``launch.run_parallel(sample_parallel=)``), split contiguously (the reference) and strided
    (the probe run: rank r takes samples r, r + ranks, ...; the contiguous split of the
    reordered ids)."""

    samples: tuple[int, ...]
    ranks: int = DP_RANKS

    def refuses(self, device: str) -> str:
        """Why a baseline on device type ``device`` cannot run here (empty: it can)."""
        if device != "cpu":
            return (f"dp_split_strided spawns its {self.ranks} ranks as gloo CPU ranks, which cannot "
                    f"run a {device} baseline")
        return ""

    def __call__(self, ctx: ProbeContext) -> tuple[Path, Path]:
        if ctx.launched:
            raise UnsupportedConfigError("dp_split_strided spawns its own ranks: run it without torchrun")
        why = self.refuses(resolve(ctx.base)[1].device.split(":")[0])
        if why:
            raise UnsupportedConfigError(why)
        ids = list(self.samples)
        strided = [i for r in range(self.ranks) for i in ids[r::self.ranks]]
        one = ParallelDims()
        reference = ctx.work / "contiguous"
        run_parallel(dataclasses.replace(ctx.base, samples=ids, batch=None), reference, one,
                     overwrite=True, sample_parallel=self.ranks)
        run_parallel(dataclasses.replace(ctx.base, samples=strided, batch=None), ctx.run_dir, one,
                     overwrite=True, sample_parallel=self.ranks)
        return reference, ctx.run_dir


def micro_batch_recompute(ctx: ProbeContext) -> tuple[Path, Path]:
    """``Probe.execute``: the baseline rollout against its training recompute in micro-batches of
    one sample (``TrainOptions(micro_batch=1)``; the full-batch recompute is ``train_recompute``)."""
    recompute_run(ctx.baseline, ctx.run_dir, RerunOptions(overwrite=True),
                  TrainOptions(micro_batch=1), dist=ctx.dist, parallel=ctx.parallel)
    return ctx.baseline, ctx.run_dir


CHAIN_CPU_ONLY = "the prompt chain runs on the CPU only (its token ids are made there)"


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """``Probe.execute``: the prompt chain (``drifttool.chain.run_chain``: text encoder →
    trajectory → VAE decode, the baseline's mode, steps and grid) of ``prompt`` alone (sample 0,
    the reference) and of ``prompt`` batched with ``longer`` (samples 0 and 1, so sample 0's prompt
    is padded to the longer one's length), each with the negative prompt ``negative``. The
    pipeline folder is the baseline's checkpoint, or the shipped tiny one
    (``chain.default_pipeline``) without one. Compare the shared sample (``common_samples``):
    its ``text_encoder`` records, then the trajectory and decode fed by them.

    The probe is NOT APPLICABLE (``ProbeContext.noop``) when ``longer`` encodes to no more tokens
    than ``prompt`` (nothing padded).

    Raises:
        UnsupportedConfigError: under a torchrun launch (the chain runs in one process).
        DriftToolError: as ``run_chain`` (a folder that is not a pipeline, a device other than
            the CPU).
    """

    prompt: str = "a red cube on a table"
    longer: str = "a small blue sphere resting beside a tall green cone under soft morning light"
    negative: str = "cat"

    def refuses(self, device: str) -> str:
        """Why a baseline on device type ``device`` cannot run the chain (empty: it can)."""
        return "" if device == "cpu" else CHAIN_CPU_ONLY

    def __call__(self, ctx: ProbeContext) -> tuple[Path, Path]:
        if ctx.launched:
            raise UnsupportedConfigError("text_encoder_batch runs the prompt chain in one process: "
                                         "run it without torchrun")
        spec = dataclasses.replace(ctx.base, checkpoint=str(ctx.base.checkpoint or default_pipeline()),
                                   samples=None, batch=None)
        reference = ctx.work / "alone"
        run_chain(spec, reference, prompts=[self.prompt], negative_prompts=[self.negative],
                  overwrite=True)
        run_chain(spec, ctx.run_dir, prompts=[self.prompt, self.longer],
                  negative_prompts=[self.negative], overwrite=True)
        lens = open_run(ctx.run_dir).manifest["replay"]["prompt_lengths"]
        if lens[1] <= lens[0]:
            ctx.noop["reason"] = (f"no-op on this pipeline: the longer prompt encodes to {lens[1]} "
                                  f"tokens, the prompt to {lens[0]}: nothing padded")
        return reference, ctx.run_dir


def _chain_pending(settings: dict[str, Any]) -> str:
    """Why the prompt chain cannot run on the baseline's settings (empty: it can)."""
    folder = settings.get("checkpoint")
    if settings.get("device", "cpu") != "cpu":
        return CHAIN_CPU_ONLY
    if folder is not None and any(not (Path(folder) / p).is_dir() for p in PIPELINE_PARTS):
        return (f"needs a pipeline folder (tokenizer/, text_encoder/, vae/ beside transformer/); "
                f"the checkpoint {folder} lacks them")
    return ""


def _drift(op: str, **where: Any) -> Expectation:
    return Expectation(verdict="drift", op=op, **where)


IDENTICAL = Expectation(verdict="identical")


def _dp_samples(settings: dict[str, Any]) -> tuple[int, ...]:
    samples = list(settings["samples"])
    extra = max(samples) + 1
    ids = samples + list(range(extra, extra + max(0, 2 * DP_RANKS - len(samples))))
    return tuple(ids[:max(len(ids), 2 * DP_RANKS)])


def _common(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The one change of every suspect, shared by the strict and production declarations."""
    last = list(settings["samples"])[-1]
    return {
        "lora_unmerged": dict(
            factor="LoRA application", change="the adapter unmerged (peft's LoRA layers, FP32 "
            "factors: lora_mode unfused-fp32) instead of merged into W",
            source="user reports: merged vs unmerged LoRA between rollout and trainer",
            execute=Paired(lora=True, change={"lora_mode": "unfused-fp32"})),
        "lora_merge_bf16": dict(
            factor="LoRA merge dtype", change="W + scale*B*A merged in bf16 (delta and sum rounded "
            "to bf16) instead of fp32",
            source="user reports: LoRA merge dtype fp32 vs bf16 (diffusers fuse_lora in the "
            "model dtype)",
            execute=Paired(lora=True, variants={"lora_merge": _v(SU.LoraMergeBf16)})),
        "rope_tables_on_device": dict(
            factor="RoPE table device", change="RoPE tables rebuilt on the activations' device "
            "instead of built on the CPU and moved (on a CPU run: the same device)",
            source="user reports: RoPE tables built on the CPU vs on the GPU",
            execute=Paired(variants={"multi_axis_rope": _v(
                SU.RopeTablesOnDevice, settings["rope"]["axes_dims"], settings["rope"]["theta"])},
                noop_on=("cpu", "no-op on the CPU: the activations are on the CPU, so the table "
                         "is built on the CPU either way (a GPU-specific suspect)"))),
        "text_mask_all_ones": dict(
            factor="text mask", change=f"sample {last} alone, CFG sequential (no prompt padded): an "
            "all-ones key mask instead of None",
            source="user reports: text mask None vs all-ones",
            execute=Paired(settings={"samples": [last], "batch": None, "cfg_layout": "sequential"},
                           variants={op: _v(SU.TextMaskAllOnes, op) for op in ATTENTION_OPS})),
        "dp_split_strided": dict(
            factor="data-parallel split",
            change=f"samples {list(_dp_samples(settings))} on {DP_RANKS} sample-parallel ranks "
                   "split strided instead of contiguously",
            source="user reports: strided vs contiguous split of a batch across DP ranks",
            execute=DataParallelSplit(_dp_samples(settings))),
        "train_micro_batch": dict(
            factor="training micro-batch", change="training recompute in micro-batches of 1 "
            "sample (prompts trimmed) instead of the rollout's batch",
            source="user reports: micro-batch size differs from the rollout group",
            execute=micro_batch_recompute),
        "text_encoder_batch": dict(
            factor="text encoder batch", change="a prompt encoded in a batch with a longer prompt "
            "(so padded, key-masked) instead of alone, through the prompt chain (text encoder → "
            "trajectory → VAE); its sample compared",
            source="user reports: a prompt's embeddings depend on the other prompts in its batch",
            execute=PromptBatch(), compare="common_samples", pending=_chain_pending(settings)),
    }


LORA_UNMERGED_STRICT = {
    # strict merged (fp32 W') and unfused (Wx + s·B(Ax), FP32) differ by FP32 ulps before the one
    # bf16 cast, so the first differing byte is where one crosses a bf16 rounding boundary, which
    # depends on the family's arithmetic on the device. Tiny baseline, measured on the CPU: the
    # text stream's q/k/v of block 0.
    "cpu": _drift("qkv_bias_gemm", step=0, block=0, stream="txt"),
    # measured on an H200 (strict CUDA family): the image stream's MLP up-projection of block 0
    # (cond branch)
    "cuda": _drift("mlp_up_gemm_gelu", step=0, block=0, stream="img"),
}
"""The strict expectation of ``lora_unmerged`` per device type, each measured there."""


def suspect_probes(settings: dict[str, Any], num_layers: int, device: str = "cpu") -> list[Probe]:
    """The suspects in the strict matrix (``catalog()``), with the strict expectations on
    ``device`` (a device type); the training recompute's runs capture at
    ``controls.TRAIN_CAPTURE`` there.

    Raises:
        ValueError: a device type without a declared ``lora_unmerged`` expectation.
    """
    c = _common(settings)
    if device not in LORA_UNMERGED_STRICT:
        raise ValueError(f"no strict expectations declared for device {device!r} "
                         f"(one of {list(LORA_UNMERGED_STRICT)})")
    # the strict matrix's training control trains a LoRA adapter, as the other training controls
    # (controls.Recompute): the strict CUDA family's timestep and modulation projections are
    # forward only. The production matrix keeps the baseline's recompute (PRODUCTION's measure).
    c["train_micro_batch"] = dict(c["train_micro_batch"], change="training recompute of a LoRA "
                                  "rollout in micro-batches of 1 sample (prompts trimmed) instead "
                                  "of the rollout's batch",
                                  execute=Recompute(train_capture(device), micro_batch=1))
    return [
        Probe(name="lora_unmerged", kind="mismatch", expect=LORA_UNMERGED_STRICT[device],
              **c["lora_unmerged"]),
        Probe(name="lora_merge_bf16", kind="mismatch",
              expect=_drift("qkv_bias_gemm", step=0, block=0, stream="img"), **c["lora_merge_bf16"]),
        Probe(name="rope_tables_on_device", kind="invariant", expect=IDENTICAL,
              **c["rope_tables_on_device"]),
        Probe(name="text_mask_all_ones", kind="invariant", expect=IDENTICAL, **c["text_mask_all_ones"]),
        Probe(name="dp_split_strided", kind="invariant", expect=IDENTICAL, **c["dp_split_strided"]),
        Probe(name="train_micro_batch", kind="invariant", expect=IDENTICAL, **c["train_micro_batch"]),
        Probe(name="text_encoder_batch", kind="invariant", expect=IDENTICAL, **c["text_encoder_batch"]),
        Probe(name="attention_fallback", factor="attention kernel", kind="mismatch",
              change="strict joint attention unavailable under mode audit: falls back to the "
                     "production SDPA kernel (fallback recorded in the trace)",
              source="user reports: attention backend forced to another kernel",
              spec={"mode": "audit", "unavailable": (("joint_attention_fused", "strict"),)},
              expect=_drift("joint_attention_fused", step=0, block=0, stream="joint", origin=True)),
    ]


_SDPA_CPU = ("observed: the prompts' padded length differs between the two runs, and the CPU "
             "SDPA kernel's blocking follows the key length and its SIMD width, so the verdict "
             "depends on the machine")
_QKV = _drift("qkv_bias_gemm", step=0, block=0, stream="img")
OBSERVED = Expectation(verdict="observed")

PRODUCTION: dict[str, dict[str, Expectation | str]] = {
    # merged W' = W + s*B*A in one GEMM vs W*x + s*B*(A*x): other arithmetic at the first adapted
    # GEMM (block 0's image Q/K/V); measured on the CPU and on an H200 (torch 2.11, cuBLAS)
    "lora_unmerged": {"cpu": _QKV, "cuda": _QKV},
    # the bf16 merge rounds W' differently from the fp32 merge at the first adapted weight;
    # measured on the CPU and on an H200
    "lora_merge_bf16": {"cpu": _QKV, "cuda": _QKV},
    # one device on a CPU run: NOT APPLICABLE there (identical). On an H200 the polar table built
    # there differs from the CPU's (48 of 384 fp32 values on the tiny image table), so the
    # rotation's output drifts (origin) where a bf16 rounding first falls otherwise: on the tiny
    # baseline the text stream at step 2, block 1 (H200, torch 2.11; v_t, x_t and logp_t stayed
    # identical there). Where it lands depends on the table's values, so only the operator is
    # declared
    "rope_tables_on_device": {"cpu": IDENTICAL, "cuda": _drift("multi_axis_rope")},
    # the CPU SDPA adds the all-ones bool mask as 0.0 to every score: exact, the same bytes. On
    # CUDA a mask may make torch pick another SDPA kernel; measured identical on an H200 (torch
    # 2.11): reported, not judged
    "text_mask_all_ones": {"cpu": IDENTICAL, "cuda": OBSERVED},
    # measured identical here; the ranks' batches pad to other lengths ([0, 2]: 7 tokens,
    # [0, 1]: 13), which the CPU SDPA's blocking may see
    "dp_split_strided": {"cpu": OBSERVED, "cuda": "the ranks are gloo CPU ranks"},
    # measured: drift at joint_attention_fused, step 0, block 0 (prompts trimmed to 7 tokens) on
    # the CPU; identical on an H200 (torch 2.11: its SDPA kernel gave the trimmed key sequence the
    # same bytes). Both follow the kernel torch picks for the key length: reported, not judged
    "train_micro_batch": {"cpu": OBSERVED, "cuda": OBSERVED},
    # the production te_causal_attention (transformers' SDPA path): the prompt alone runs
    # is_causal with no mask, the padded batch an explicit [B, 1, L, L] bool mask over repeated
    # K/V and a longer key length. Measured on the CPU (tiny pipeline, 2 and 4 steps): drift at
    # that first text-encoder attention (step -1, block 0) on an AVX-512 machine; on an AVX2
    # machine the text encoder's records stayed identical and the first drift was the MMDiT's
    # joint_attention_fused (the padded prompt's key length). The CPU SDPA's blocking follows
    # its SIMD width: reported, not judged
    "text_encoder_batch": {"cpu": OBSERVED, "cuda": CHAIN_CPU_ONLY},
    # MATH vs the CPU FLASH kernel, vs cuDNN / flash on an H200: measured drift at the first
    # attention call on both
    "attention_fallback": {"cpu": _drift("joint_attention_fused", step=0, block=0, stream="joint"),
                           "cuda": _drift("joint_attention_fused", step=0, block=0, stream="joint")},
}
"""``{probe: {device type: Expectation, or the reason it is pending there}}``: the production
family's expectation per device type, each measured there (``observed``: reported, not judged)."""


def production_probes(settings: dict[str, Any], num_layers: int, device: str) -> list[Probe]:
    """The suspects in the production matrix (``drifttool probe --mode auto``) on ``device``
    (a device type): each probe's production expectation there (``PRODUCTION``), or pending
    with the reason."""
    c = _common(settings)
    c["attention_fallback"] = dict(
        factor="attention kernel", change="production SDPA forced to its MATH kernel "
        "(sdpa_kernel([MATH])) instead of torch's choice; the trace records the variant",
        source="user reports: attention backend forced to another kernel",
        variants={"joint_attention_fused": _v(SU.AttentionKernelMath)})
    strict = {p.name: p for p in suspect_probes(settings, num_layers)}
    out = []
    for name, fields in c.items():
        e = fields.pop("pending", "") or PRODUCTION[name].get(
            device, f"no production expectation declared for {device}")
        if isinstance(e, str):
            out.append(Probe(name=name, kind=strict[name].kind, expect=strict[name].expect,
                             pending=e, **fields))
            continue
        kind = strict[name].kind if e.verdict == "observed" else (
            "invariant" if e.verdict == "identical" else "mismatch")
        out.append(Probe(name=name, kind=kind, expect=e, **fields))
    return out
