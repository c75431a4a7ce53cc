"""Capture adapter for vllm-omni's ``QwenImageTransformer2DModel`` (RFC ``vllm_omni_runtime_adapter_qwenimage``,
capture levels L1/L2).

    >>> tr = load_transformer("fixtures/tiny-t2i/transformer", torch.bfloat16)  # a diffusers folder
    >>> run_vllm_omni(RunSpec(), "runs/vllm-omni", transformer=tr)
    >>> diff_runs(open_run("runs/diffusers"), open_run("runs/vllm-omni")).first_drift.op
    'txt_in_rmsnorm_linear'

The same design as ``drifttool.adapters.diffusers_qwenimage``: an unmodified vllm-omni transformer
is instrumented from outside, inside ``instrument(tr, rt)``; the table ``TAPS`` becomes forward
hooks and pre-hooks (``drifttool.adapters.taps``), and the few outputs that are not one module's
tensor are recorded by glue (``vllm_omni_glue``). Every record goes through
``drifttool.ops.sink.record_external`` under drifttool's operator name, stream and layout, so the
artifact diffs record for record against drifttool and diffusers runs. Hooks only read tensors
(the output bytes do not change: tested). vllm-omni 0.30 is supported; another version is refused.

=====================================  ======================  ======  ===========================
vllm-omni module / function            RFC operator            stream  capture point
=====================================  ======================  ======  ===========================
``time_text_embed``                    timestep_embed_mlp      none    output
``txt_in`` (after ``txt_norm``)        txt_in_rmsnorm_linear   txt     output
``img_in`` / ``proj_out``              latent_proj_gemm        img     output (block −1 / L)
``blocks.i.img_mod`` / ``txt_mod``     adaln_mod_projection    img/txt output
``img_norm1`` / ``txt_norm1``          adaln_modulation #0     img/txt output (``AdaLayerNorm``)
``attn.to_qkv`` / ``add_kv_proj``      qkv_bias_gemm (3 out)   img/txt fused output, split q|k|v
``attn.norm_q/k``, ``norm_added_q/k``  qk_rmsnorm              img/txt output (eager path)
``_qwen_image_qk_norm_rope``           multi_axis_rope         img/txt returned query, key
``attn.attn`` (``Attention`` layer)    joint_attention_fused   joint   output [B, S, H, Dh]
``attn.to_out`` / ``to_add_out``       attn_out_bias_gemm      img/txt output
``img_norm2`` / ``txt_norm2``          adaln_gate_residual #0  img/txt input
``img_norm2`` / ``txt_norm2``          adaln_modulation #1     img/txt output
``blocks.i`` output                    adaln_gate_residual #1  img/txt output
``*_mlp.net.0`` / ``*_mlp.net.2``      mlp_up_gemm_gelu /      img/txt output
                                       mlp_down_gemm
``norm_out``                           final_adaln_out         img     output (block L)
=====================================  ======================  ======  ===========================

Trace (kernel read-back): linears name the GEMM vLLM bound at construction
(``quant_method._gemm_impl``); attention names the backend and implementation class the
``Attention`` layer resolved and its parallel strategy; ``multi_axis_rope`` names the path
``_qwen_image_qk_norm_rope`` actually took (eager: the norm modules ran; fused: the Triton
QK-RMSNorm+RoPE kernel) and is a **declared, batch-dependent path**: its trace entry is
``declared`` and its reason gives the threshold (``VLLM_OMNI_FUSED_QK_NORM_ROPE_MIN_TOKENS``, B·S
tokens) and this call's token count, because a row's bytes depend on how many rows share the
call. On the fused path the Q/K RMSNorm is inside the kernel: ``qk_rmsnorm`` is traced with that
kernel and no digest.

Refused (``UnsupportedConfigError`` / ``DriftToolError``): another vllm-omni version; a model
with ``zero_cond_t`` (edit-2511 select01 modulation: no tap for it); any parallel degree above 1
(sequence, tensor, CFG, pipeline, data: the taps would record one rank's shard as the whole
tensor); condition images (edit runs); a compiled run (``enforce_eager=False``:
the transformer or its blocks under ``torch.compile``, whose graphs the hooks cannot run in;
``compiled_problem``); a capture point that never fired in a forward (a renamed module or a
bypassed path must not read as silence).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator

import torch

from safetensors.torch import load_file

from drifttool.adapters.taps import AFTER, BEFORE, Tap, tap_modules
from drifttool.adapters.vllm_omni_cpu import build, cpu_runtime, forward_context
from drifttool.adapters.vllm_omni_glue import Glue, check_version, transformer_module
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.model.checkpoint_files import transformer_folder, weight_files
from drifttool.model.config import from_diffusers_config
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.settings import resolve

_BLOCK = "transformer_blocks.*"
_ATTN = f"{_BLOCK}.attn"

TAPS = (
    Tap("time_text_embed", "timestep_embed_mlp", "none", "B.", block=BEFORE),
    Tap("txt_in", "txt_in_rmsnorm_linear", "txt", block=BEFORE),
    Tap("img_in", "latent_proj_gemm", "img", block=BEFORE),
    Tap("norm_out", "final_adaln_out", "img", block=AFTER),
    Tap("proj_out", "latent_proj_gemm", "img", block=AFTER),
    Tap(f"{_BLOCK}.img_mod", "adaln_mod_projection", "img", "B."),
    Tap(f"{_BLOCK}.txt_mod", "adaln_mod_projection", "txt", "B."),
    Tap(f"{_BLOCK}.img_norm1", "adaln_modulation", "img"),
    Tap(f"{_BLOCK}.txt_norm1", "adaln_modulation", "txt"),
    Tap(f"{_ATTN}.norm_q", "qk_rmsnorm", "img", "BS.."),
    Tap(f"{_ATTN}.norm_k", "qk_rmsnorm", "img", "BS.."),
    Tap(f"{_ATTN}.norm_added_q", "qk_rmsnorm", "txt", "BS.."),
    Tap(f"{_ATTN}.norm_added_k", "qk_rmsnorm", "txt", "BS.."),
    Tap(f"{_ATTN}.attn", "joint_attention_fused", "joint", "BS.."),
    Tap(f"{_ATTN}.to_out", "attn_out_bias_gemm", "img"),
    Tap(f"{_ATTN}.to_add_out", "attn_out_bias_gemm", "txt"),
    Tap(f"{_BLOCK}.img_norm2", "adaln_gate_residual", "img", read="input"),
    Tap(f"{_BLOCK}.img_norm2", "adaln_modulation", "img"),
    Tap(f"{_BLOCK}.txt_norm2", "adaln_gate_residual", "txt", read="input"),
    Tap(f"{_BLOCK}.txt_norm2", "adaln_modulation", "txt"),
    Tap(f"{_BLOCK}.img_mlp.net.0", "mlp_up_gemm_gelu", "img"),
    Tap(f"{_BLOCK}.img_mlp.net.2", "mlp_down_gemm", "img"),
    Tap(f"{_BLOCK}.txt_mlp.net.0", "mlp_up_gemm_gelu", "txt"),
    Tap(f"{_BLOCK}.txt_mlp.net.2", "mlp_down_gemm", "txt"),
    Tap(_BLOCK, "adaln_gate_residual", "img", item=1, note=" (output)"),  # (txt, img) out
    Tap(_BLOCK, "adaln_gate_residual", "txt", item=0, note=" (output)"),
)
"""Where vllm-omni's QwenImage transformer computes each RFC operator (module docstring's table);
the fused QKV projections and RoPE are recorded by ``vllm_omni_glue.Glue``. The table's order is
the call order within a block, so records fall in drifttool's order."""


EAGER_ONLY = ("vllm-omni capture: a compiled transformer (enforce_eager=False: torch.compile / "
              "CUDA graphs) is not supported")
"""The start of the refusal of a compiled run (``compiled_problem``, ``VllmOmniQwenImage``)."""


def compiled_problem(transformer: torch.nn.Module) -> str | None:
    """Where ``transformer`` runs under ``torch.compile``, in words, or None (eager). vllm-omni
    0.30 compiles when ``enforce_eager`` is False (``DiffusionModelRunner``): ``Module.compile()``
    in place (``diffusion_compile_granularity="full"``), or each repeated block's ``forward``
    (or the ``_omni_original_forward`` its hook registry calls) replaced by a compiled function
    (``"regional"``, the default); ``torch.compile(model)`` wraps it in an ``OptimizedModule``
    (``_orig_mod``). Read from the modules only: nothing is imported or compiled."""
    if hasattr(transformer, "_orig_mod"):
        return "the transformer is wrapped by torch.compile (an OptimizedModule)"
    for name, module in transformer.named_modules():
        where = name or "the transformer"
        if getattr(module, "_compiled_call_impl", None) is not None:
            return f"{where} is compiled in place (Module.compile(), full granularity)"
        for attr in ("forward", "_omni_original_forward"):
            fn = vars(module).get(attr)
            if fn is not None and hasattr(fn, "_torchdynamo_orig_callable"):
                return f"{where}.{attr} is a torch.compile'd function (regional compilation)"
    return None


def _refuse_compiled(transformer: torch.nn.Module) -> None:
    problem = compiled_problem(transformer)
    if problem is not None:
        raise UnsupportedConfigError(f"{EAGER_ONLY}: {problem}; build and run it with "
                                     "enforce_eager=True")


PARALLEL_DEGREES = (("sequence_parallel_size", "sequence parallelism"),
                    ("tensor_parallel_size", "tensor parallelism"),
                    ("cfg_parallel_size", "CFG parallelism"),
                    ("pipeline_parallel_size", "pipeline parallelism"),
                    ("data_parallel_size", "data parallelism"))
"""The ``DiffusionParallelConfig`` degrees of the transformer's forward (sequence: Ulysses × Ring,
or all-gather), each of which must be 1 for a capture."""


def _refuse_parallel(pc: Any) -> None:
    """Raise for a parallel degree above 1 in ``pc`` (a ``DiffusionParallelConfig`` or None): on
    one of several ranks the taps would record that rank's shard (heads, rows, a CFG branch, a
    stage, a slice of the batch) as the whole tensor."""
    for field, what in PARALLEL_DEGREES:
        degree = getattr(pc, field, 1) or 1
        if degree > 1:
            raise UnsupportedConfigError(f"vllm-omni capture: {what} ({field}={degree}) is not "
                                         "supported; the capture runs one rank (every parallel "
                                         "degree 1)")


def _refuse_unsupported(transformer: torch.nn.Module) -> None:
    if getattr(transformer, "zero_cond_t", False):
        raise UnsupportedConfigError("vllm-omni capture: zero_cond_t (edit-2511 select01 "
                                     "modulation) is not supported")
    _refuse_parallel(getattr(transformer, "parallel_config", None))


@contextlib.contextmanager
def instrument(transformer: torch.nn.Module, rt: Runtime) -> Iterator[None]:
    """Hook ``transformer`` (a vllm-omni ``QwenImageTransformer2DModel``) for the block: every
    forward inside records its operator outputs into ``rt`` as drifttool's MMDiT would; hooks and
    the RoPE wrapper are removed on exit.

    Raises:
        DriftToolError: vllm-omni missing or of another version, not its Qwen-Image transformer,
            or (on exit, after a forward) a capture point that never fired.
        UnsupportedConfigError: a compiled transformer (``compiled_problem``), ``zero_cond_t``
            or a parallel degree above 1 (``PARALLEL_DEGREES``).
    """
    _refuse_compiled(transformer)  # first: an OptimizedModule is not the transformer's class
    check_version()
    mod = transformer_module()
    if not isinstance(transformer, mod.QwenImageTransformer2DModel):
        raise DriftToolError(f"expected a vllm-omni QwenImageTransformer2DModel, got "
                             f"{type(transformer).__name__}")
    _refuse_unsupported(transformer)
    blocks = transformer.transformer_blocks
    attn = blocks[0].attn
    glue = Glue(rt, transformer)
    with contextlib.ExitStack() as stack:
        stack.enter_context(glue.installed(mod))
        stack.enter_context(tap_modules(transformer, TAPS, rt, actual="vllm_omni",
                                        depth=len(blocks), head_dim=attn.head_dim,
                                        kernel_of=glue.kernel_of, require_all=True,
                                        accounted=glue.accounted))
        yield


class VllmOmniQwenImage(torch.nn.Module):
    """A vllm-omni transformer behind drifttool's model call
    ``model(x, txt, txt_mask, tau, img_grid, rt) -> v`` (``drifttool.runner.execute(model=...)``).

    Parameters are reported under the diffusers checkpoint's names, the fused QKV weights split
    back into ``to_q/k/v`` and ``add_q/k/v_proj`` (``to_out`` as ``to_out.0``), so the weight
    digest of the fingerprint equals that of drifttool's MMDiT and of diffusers on the same
    checkpoint. Each forward runs in vllm-omni's forward context and is instrumented.

    Args:
        transformer: the vllm-omni model. od_config: the ``OmniDiffusionConfig`` it was built
            under. config: its diffusers ``config.json`` (drifttool's ``ModelConfig`` source).

    Raises:
        UnsupportedConfigError: ``od_config.enforce_eager`` is False (vllm-omni compiles the
            transformer under it), a cache backend is set, a parallel degree of
            ``od_config.parallel_config`` is above 1 (``PARALLEL_DEGREES``), or the transformer
            is compiled (``compiled_problem``).
    """

    def __init__(self, transformer: torch.nn.Module, od_config: Any, config: dict[str, Any]) -> None:
        if getattr(od_config, "enforce_eager", True) is not True:
            raise UnsupportedConfigError(f"{EAGER_ONLY}: the OmniDiffusionConfig has "
                                         f"enforce_eager={od_config.enforce_eager!r}; build and run "
                                         "it with enforce_eager=True")
        cache = getattr(od_config, "cache_backend", None)
        if cache not in (None, "none"):
            raise UnsupportedConfigError(f"vllm-omni capture: cache backend {cache!r} is not supported (a "
                                         "step cache skips or reuses block outputs, so the captured "
                                         "operators would not all run every step); build it with "
                                         "cache_backend='none'")
        _refuse_parallel(getattr(od_config, "parallel_config", None))
        _refuse_compiled(transformer)
        super().__init__()
        object.__setattr__(self, "transformer", transformer)
        object.__setattr__(self, "od_config", od_config)
        self.config = from_diffusers_config(dict(config))
        import diffusers

        self.source = {"implementation": "vllm_omni.QwenImageTransformer2DModel",
                       "adapter": f"drifttool.adapters.vllm_omni_qwenimage (vllm-omni "
                                  f"{check_version()})",
                       "diffusers_version": diffusers.__version__}

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    def named_parameters(self, *args: Any, **kwargs: Any):
        return iter(checkpoint_parameters(self.transformer).items())

    def state_dict(self, *args: Any, **kwargs: Any):
        return checkpoint_parameters(self.transformer)

    def forward(self, x, txt, txt_mask, tau, img_grid, rt: Runtime, *, cond=None,
                cond_grids=()) -> torch.Tensor:
        """Raises ``UnsupportedConfigError`` for condition images (edit runs)."""
        if cond is not None:
            raise UnsupportedConfigError("vllm-omni capture: condition images (edit runs) are not "
                                         "supported")
        h, w = (int(v) for v in img_grid)
        lens = [txt.shape[1]] * x.shape[0]  # the RoPE table's text rows: the padded length
        with forward_context(self.od_config), instrument(self.transformer, rt):
            out = self.transformer(
                hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=txt_mask,
                timestep=tau, img_shapes=[[(1, h, w)]] * x.shape[0], txt_seq_lens=lens,
                return_dict=False)
            return out[0] if isinstance(out, tuple) else out.sample


def checkpoint_parameters(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformer's parameters under diffusers checkpoint names: ``to_qkv`` split into
    ``to_q/k/v``, ``add_kv_proj`` into ``add_q/k/v_proj`` (rows ``[q | k | v]``, each
    ``heads × head_dim``), ``to_out`` as ``to_out.0``; views, no copies."""
    out: dict[str, torch.Tensor] = {}
    fused = {".to_qkv.": (".to_q.", ".to_k.", ".to_v."),
             ".add_kv_proj.": (".add_q_proj.", ".add_k_proj.", ".add_v_proj.")}
    for name, p in transformer.named_parameters():
        for key, parts in fused.items():
            if key in name:
                for part, t in zip(parts, p.detach().chunk(3, dim=0)):
                    out[name.replace(key, part)] = t
                break
        else:
            out[name.replace(".to_out.", ".to_out.0.")] = p.detach()
    return out


def load_transformer(folder: str | Path, dtype: torch.dtype) -> VllmOmniQwenImage:
    """vllm-omni's transformer of a diffusers checkpoint folder (``config.json`` +
    safetensors; a pipeline folder's ``transformer/``), on the CPU (``vllm_omni_cpu``), its
    weights loaded through vllm-omni's own ``load_weights`` (fused QKV), wrapped for
    ``execute``.

    Raises:
        DriftToolError: vllm-omni missing or of another version, the folder unreadable, or a
            parameter the checkpoint does not fill.
    """
    check_version()
    folder = transformer_folder(folder)
    config = json.loads((folder / "config.json").read_text())
    od = cpu_runtime()
    model = build(od, config, dtype)
    loaded: set[str] = set()
    for f in weight_files(folder):
        tensors = load_file(str(f))
        loaded |= model.load_weights((k, v.to(dtype)) for k, v in tensors.items())
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
    if missing:
        raise DriftToolError(f"{folder}: the checkpoint fills no {missing[0]} "
                             f"({len(missing)} vllm-omni parameters unfilled)")
    return VllmOmniQwenImage(model, od, {k: v for k, v in config.items() if not k.startswith("_")})


def run_vllm_omni(spec, out: str | Path, *, transformer: VllmOmniQwenImage | None = None,
                  overwrite: bool = False) -> dict[str, Any]:
    """A rollout whose velocities come from vllm-omni's (hooked) transformer, written as a
    drifttool artifact; as ``diffusers_qwenimage.run_diffusers`` (mode forced to ``auto``).
    Without ``transformer``, the spec's checkpoint (or fixture model) is loaded on the CPU."""
    spec = dataclasses.replace(spec, mode="auto")
    fx, s = resolve(spec)
    if transformer is None:
        transformer = load_transformer(s.checkpoint or fx.model_dir, s.torch_dtype)
    return execute(spec, out, overwrite=overwrite, model=transformer)
