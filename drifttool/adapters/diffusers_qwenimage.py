"""Capture adapter for diffusers' ``QwenImageTransformer2DModel`` (RFC ``diffusers_runtime_adapter_qwenimage``).

    >>> from diffusers import QwenImageTransformer2DModel
    >>> tr = QwenImageTransformer2DModel.from_pretrained("fixtures/tiny-t2i/transformer",
    ...                                                  torch_dtype=torch.bfloat16)
    >>> run_diffusers(RunSpec(), "runs/diffusers", transformer=tr)   # a diffusers rollout
    >>> diff_runs(open_run("runs/strict"), open_run("runs/diffusers")).first_drift.op
    'timestep_embed_mlp'

An unmodified diffusers transformer is instrumented from outside, inside ``instrument(tr, rt)``:
the table ``TAPS`` (module path pattern -> RFC operator, stream, layout, which tensor) becomes
forward hooks and pre-hooks (``drifttool.adapters.taps``), and attention runs through a capture
backend registered in diffusers' attention dispatcher (``diffusers_attention``); everything is
removed and restored on exit, and no module-level function is replaced. Each tensor is recorded
under the RFC operator name, stream and layout tag that drifttool's own MMDiT uses
(``drifttool.model.mmdit`` call-site table), through the same ``Runtime`` identity scope, operator
trace and ``Recorder`` (``drifttool.ops.sink.record_external``), so the artifact diffs against a
drifttool run record for record. The hooks only read tensors: the transformer's output bytes do not
change (tested).

=====================================  ======================  ======  =====================
diffusers module / function            RFC operator            stream  capture point
=====================================  ======================  ======  =====================
``time_text_embed``                    timestep_embed_mlp      none    output
``txt_in`` (after ``txt_norm``)        txt_in_rmsnorm_linear   txt     output
``img_in`` / ``proj_out``              latent_proj_gemm        img     output (block −1 / L)
``blocks.i.img_mod`` / ``txt_mod``     adaln_mod_projection    img/txt output
``blocks.i.attn`` (hidden, encoder)    adaln_modulation #0     img/txt input (pre-hook)
``blocks.i.img_mlp`` / ``txt_mlp``     adaln_modulation #1     img/txt input (pre-hook)
``attn.to_q/k/v``, ``add_q/k/v_proj``  qkv_bias_gemm (3 out)   img/txt outputs, as [B, S, H, Dh]
``attn.norm_q/k``, ``norm_added_q/k``  qk_rmsnorm              img/txt output
RoPE (see ``rope_kernel``)            multi_axis_rope         img/txt the attention's query, key
``dispatch_attention_fn``              joint_attention_fused   joint   output [B, S, H, Dh]
``attn.to_out.0`` / ``to_add_out``     attn_out_bias_gemm      img/txt output
``img_norm2`` / ``txt_norm2``          adaln_gate_residual #0  img/txt input (pre-hook)
``blocks.i`` output                    adaln_gate_residual #1  img/txt output
``*_mlp.net.0`` / ``*_mlp.net.2``      mlp_up_gemm_gelu /      img/txt output
                                       mlp_down_gemm
``norm_out``                           final_adaln_out         img     output (block L)
=====================================  ======================  ======  =====================

RoPE is a function, not a module: its four outputs (image query and key, then text query and key)
are recorded from the query and key the processor hands to attention, which are exactly
``cat([txt, img])`` of them (rows ``[0, L)`` text, ``[L, L + N)`` image).

Trace: every call site is recorded with ``actual="diffusers"`` and the module path as the kernel;
for attention, the kernel is read back per call: diffusers' attention backend (e.g. ``native``)
and, for the native backend, the SDPA kernel torch selects for these exact arguments
(``torch._fused_sdp_choice``, the selector SDPA itself calls: ``FLASH_ATTENTION``, ``MATH``, ...).

The sampler side (sigma table, CFG combine + renorm, Flow-GRPO SDE step) is drifttool's
``production`` scheduler operators — diffusers' CFG expression and Flow-GRPO's step verbatim —
driven by ``drifttool.sampling.rollout`` (``run_diffusers`` runs in mode ``auto``). To capture
diffusers' own pipeline loop instead (an unmodified ``QwenImagePipeline`` call), see
``drifttool.adapters.diffusers_pipeline``: it sets the runtime scope that drifttool's sampler
sets here, and uses ``instrument`` for the transformer.

Adding a runtime (vllm-omni, SGLang, ...) is one new module like this one:

1. A table of ``Tap`` entries: for each RFC operator of ``drifttool.model.mmdit``'s call-site
   table, the module path pattern of the runtime's model that computes it (``*`` = the block
   index), the stream, the layout tag, and which tensor (the output, a tuple item, or an input
   by position or name); ``heads=True`` splits ``[..., H*Dh]`` into ``[..., H, Dh]``, and a tuple
   of patterns records separate Q/K/V projections as one call.
2. Glue for what is not one module's tensor, recorded with ``taps.record`` (the trace entry and
   digests of ``ops.sink.record_external``): attention through the runtime's own backend
   selector where it has one (as ``diffusers_attention`` does), else a hook on its attention
   layer; a fused QKV projection's output split into its three parts.
3. ``instrument(model, rt)``: ``tap_modules(model, TABLE, rt, actual="<runtime>", depth=...,
   head_dim=...)`` plus the glue, in one ``with``; and a wrapper with drifttool's model call
   ``model(x, txt, txt_mask, tau, img_grid, rt) -> v`` (as ``DiffusersQwenImage``) so that
   ``drifttool.runner.execute`` runs it. Under a parallel plan (``Runtime.plan``)
   ``record_external`` hands each tensor to the plan, which decides which rank records what, as
   for drifttool's own operators; the records are the canonical tensors' when the runtime shards
   as the plan's rule tables do (``drifttool.distributed.plan``).

Nothing else changes: the recorder, artifact, diff and CLI see drifttool records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from drifttool.adapters.peft_lora import canonical_parameters
from drifttool.adapters.taps import AFTER, BEFORE, Tap, record, tap_modules
from drifttool.errors import DriftToolError
from drifttool.model.checkpoint_files import transformer_folder
from drifttool.model.conditions import join_conditions
from drifttool.model.config import from_diffusers_config
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.settings import resolve

_DIFFUSERS_MODULE = "diffusers.models.transformers.transformer_qwenimage"
_BLOCK = "transformer_blocks.*"
_ATTN = f"{_BLOCK}.attn"


SUPPORTED_DIFFUSERS = ("0.40.", "0.42.")
"""diffusers releases whose QwenImage transformer the table and the RoPE read-back describe: 0.42
(the project's pin) calls ``apply_rotary_emb_qwen`` by name; 0.40 (vllm-omni 0.30's pin) picks
the RoPE function per device from ``ROPE_PER_DEVICE``, bound at import. In both the processor
applies RoPE to the query and key it then hands to the attention dispatcher, where they are
recorded."""


def _diffusers_module():
    try:
        import diffusers
    except ImportError as e:
        raise DriftToolError(f"the diffusers capture adapter needs diffusers installed ({e}; "
                             "pip install 'diffusers>=0.42,<0.43', or the package's [test] extra)") from None
    if not diffusers.__version__.startswith(SUPPORTED_DIFFUSERS):
        raise DriftToolError(f"diffusers {diffusers.__version__} is not supported by the capture "
                             f"adapter (supported: {', '.join(v + 'x' for v in SUPPORTED_DIFFUSERS)})")
    return importlib.import_module(_DIFFUSERS_MODULE)


def rope_kernel(mod, device_type: str) -> str:
    """The RoPE function the processor of diffusers module ``mod`` runs on ``device_type``:
    ``apply_rotary_emb_qwen`` (0.42), or the ``ROPE_PER_DEVICE`` entry it picks (0.40: the
    device's own, else ``cuda``'s)."""
    table = getattr(mod, "ROPE_PER_DEVICE", None)
    if table is None:
        return "diffusers:apply_rotary_emb_qwen"
    key = device_type if device_type in table else "cuda"
    fn = table[key]
    name = getattr(getattr(fn, "func", fn), "__name__", type(fn).__name__)
    extra = ", ".join(f"{k}={v}" for k, v in getattr(fn, "keywords", {}).items())
    return f"diffusers:ROPE_PER_DEVICE[{key!r}] ({name}{', ' + extra if extra else ''})"


def _qkv(*names: str) -> tuple[str, ...]:
    return tuple(f"{_ATTN}.{n}" for n in names)


TAPS = (
    Tap("time_text_embed", "timestep_embed_mlp", "none", "B.", block=BEFORE),
    Tap("txt_in", "txt_in_rmsnorm_linear", "txt", block=BEFORE),
    Tap("img_in", "latent_proj_gemm", "img", block=BEFORE),
    Tap("norm_out", "final_adaln_out", "img", block=AFTER),
    Tap("proj_out", "latent_proj_gemm", "img", block=AFTER),
    Tap(f"{_BLOCK}.img_mod", "adaln_mod_projection", "img", "B."),
    Tap(f"{_BLOCK}.txt_mod", "adaln_mod_projection", "txt", "B."),
    Tap(_ATTN, "adaln_modulation", "img", read="input", item="hidden_states",
        note=" (input: img_norm1+_modulate)"),
    Tap(_ATTN, "adaln_modulation", "txt", read="input", item="encoder_hidden_states",
        note=" (input: txt_norm1+_modulate)"),
    Tap(_qkv("to_q", "to_k", "to_v"), "qkv_bias_gemm", "img", "BS..", heads=True,
        note=" (q, k, v)"),
    Tap(_qkv("add_q_proj", "add_k_proj", "add_v_proj"), "qkv_bias_gemm", "txt", "BS..",
        heads=True, note=" (q, k, v)"),
    Tap(f"{_ATTN}.norm_q", "qk_rmsnorm", "img", "BS.."),
    Tap(f"{_ATTN}.norm_k", "qk_rmsnorm", "img", "BS.."),
    Tap(f"{_ATTN}.norm_added_q", "qk_rmsnorm", "txt", "BS.."),
    Tap(f"{_ATTN}.norm_added_k", "qk_rmsnorm", "txt", "BS.."),
    Tap(f"{_ATTN}.to_out.0", "attn_out_bias_gemm", "img"),
    Tap(f"{_ATTN}.to_add_out", "attn_out_bias_gemm", "txt"),
    Tap(f"{_BLOCK}.img_norm2", "adaln_gate_residual", "img", read="input"),
    Tap(f"{_BLOCK}.txt_norm2", "adaln_gate_residual", "txt", read="input"),
    Tap(f"{_BLOCK}.img_mlp", "adaln_modulation", "img", read="input"),
    Tap(f"{_BLOCK}.img_mlp.net.0", "mlp_up_gemm_gelu", "img"),
    Tap(f"{_BLOCK}.img_mlp.net.2", "mlp_down_gemm", "img"),
    Tap(f"{_BLOCK}.txt_mlp", "adaln_modulation", "txt", read="input"),
    Tap(f"{_BLOCK}.txt_mlp.net.0", "mlp_up_gemm_gelu", "txt"),
    Tap(f"{_BLOCK}.txt_mlp.net.2", "mlp_down_gemm", "txt"),
    Tap(_BLOCK, "adaln_gate_residual", "img", item=1, note=" (output)"),  # (txt, img) out
    Tap(_BLOCK, "adaln_gate_residual", "txt", item=0, note=" (output)"),
)
"""Where diffusers' QwenImage transformer computes each RFC operator (module docstring's table);
RoPE and attention are recorded by ``AttentionGlue``."""


# -- attention: RoPE outputs and the fused attention -----------------------------------------------
@dataclasses.dataclass
class AttentionGlue:
    """Per attention call: the block, the image rows and whether RoPE ran (the attention
    module's pre-hook), then, in the capture backend, the RoPE outputs and the attention output."""

    rt: Runtime
    kernel_of: Callable[[Any, dict[str, Any]], str]  # diffusers_attention.attention_kernel
    rope_of: Callable[[str], str]  # rope_kernel of the diffusers module, by device type
    actual: str = "diffusers"  # the runtime the trace names
    block: int = -1
    img_rows: int = 0
    rope: bool = False
    attention_calls: int = 0
    rope_calls: int = 0

    def enter(self, block: int, kwargs: dict[str, Any]) -> None:
        self.block = block
        self.img_rows = int(kwargs["hidden_states"].shape[1])
        self.rope = kwargs.get("image_rotary_emb") is not None

    def attention(self, backend, args: dict[str, Any], run) -> torch.Tensor:
        q, k = args["query"], args["key"]  # [B, L + N, H, Dh]: text rows, then image rows
        self.attention_calls += 1
        if self.rope:
            self.rope_calls += 1
            L = q.shape[1] - self.img_rows
            kernel = self.rope_of(q.device.type)
            for stream, rows in (("img", slice(L, None)), ("txt", slice(0, L))):
                for t in (q, k):
                    record(self.rt, "multi_axis_rope", stream, t[:, rows], "BS..",
                           actual=self.actual, kernel=kernel, block=self.block)
        kernel = self.kernel_of(backend, args)
        out = run()  # [B, S, H, Dh]
        record(self.rt, "joint_attention_fused", "joint", out, "BS..", actual=self.actual,
               kernel=kernel, block=self.block)
        return out


@contextlib.contextmanager
def instrument(transformer: torch.nn.Module, rt: Runtime) -> Iterator[None]:
    """Hook ``transformer`` (a diffusers ``QwenImageTransformer2DModel``) for the duration of the
    block: every forward inside records its operator outputs into ``rt`` (scope, trace,
    recorder) as drifttool's MMDiT would. Hooks and the attention backend are removed on exit.

    Raises:
        DriftToolError: diffusers is not installed or of an unsupported version
            (``SUPPORTED_DIFFUSERS``), ``transformer`` is not a ``QwenImageTransformer2DModel``,
            another capture's attention backend is active, or (on exit, after a forward) a
            capture point never fired.
    """
    mod = _diffusers_module()
    if not isinstance(transformer, mod.QwenImageTransformer2DModel):
        raise DriftToolError(f"expected a diffusers QwenImageTransformer2DModel, got "
                             f"{type(transformer).__name__}")
    from drifttool.adapters.diffusers_attention import (  # lazy: diffusers is optional
        attention_kernel, capture_backend)

    blocks = transformer.transformer_blocks
    attn = blocks[0].attn
    glue = AttentionGlue(rt, attention_kernel, lambda device: rope_kernel(mod, device))
    with contextlib.ExitStack() as stack:
        begin = stack.enter_context(capture_backend([b.attn for b in blocks], glue.attention))
        for i, blk in enumerate(blocks):
            def pre(m, args, kwargs, i=i):
                glue.enter(i, kwargs)
                begin(m)

            stack.callback(blk.attn.register_forward_pre_hook(pre, with_kwargs=True).remove)
        stack.enter_context(tap_modules(transformer, TAPS, rt, actual="diffusers",
                                        depth=len(blocks), head_dim=attn.inner_dim // attn.heads,
                                        require_all=True))
        yield
        if glue.attention_calls and not glue.rope_calls:
            raise DriftToolError("diffusers capture: attention ran without rotary embeddings: "
                                 "no multi_axis_rope to record (the transformer passed none)")


# -- a rollout driven by the diffusers transformer ------------------------------------------------
class DiffusersQwenImage(torch.nn.Module):
    """A diffusers transformer behind drifttool's model call
    ``model(x, txt, txt_mask, tau, img_grid, rt) -> v`` (``drifttool.runner.execute(model=...)``).

    Parameters are reported under the checkpoint's own names (the diffusers module's; a peft
    LoRA layer's under drifttool's, ``peft_lora``), so the weight digest of the fingerprint
    equals that of drifttool's MMDiT on the same weights (and adapter, in the same mode).
    Each forward is instrumented (``instrument``) with the runtime it is given.
    """

    graphable = True
    """Its forward may be replayed from CUDA graphs (``model.graphs.graphable``): diffusers'
    Qwen-Image forward makes no host synchronisation, and the hooks' Python (identity, trace,
    the digest kernels' launches) runs once at capture; after each replay the records are filed
    as an eager call files them."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "transformer", transformer)  # not a submodule: keep the names
        self.config = from_diffusers_config(dict(transformer.config))
        self.source = {"implementation": "diffusers.QwenImageTransformer2DModel",
                       "adapter": "drifttool.adapters.diffusers_qwenimage",
                       "diffusers_version": _diffusers_version()}

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def named_parameters(self, *args: Any, **kwargs: Any):
        """The transformer's parameters; peft LoRA layers' under drifttool's names
        (``peft_lora.canonical_parameters``)."""
        return iter(canonical_parameters(self.transformer).items())

    def state_dict(self, *args: Any, **kwargs: Any):
        return self.transformer.state_dict(*args, **kwargs)

    def graph_constants(self, grid: tuple[int, int], txt_len: int,
                        cond_grids: tuple[tuple[int, int], ...], device: torch.device) -> tuple:
        """The RoPE frequencies diffusers' forward reads from its cache for these shapes
        (``QwenEmbedRope``'s per-image-shape tables, an LRU cache of 128 entries), for a CUDA
        graph of the forward to hold alive (``model.graphs.SignatureGraphs._kept_tables``): a
        graph reads the addresses it captured, and the cache may drop them. The text table is
        a slice of a table the module keeps. Call after a forward of these shapes on ``device``
        (the entries are then the forward's own). Empty for a transformer without that cache."""
        video = getattr(getattr(self.transformer, "pos_embed", None), "_compute_video_freqs", None)
        if video is None:
            return ()
        shapes = [(1, *grid), *((1, *g) for g in cond_grids)]
        return tuple(video(f, h, w, idx, device) for idx, (f, h, w) in enumerate(shapes))

    def forward(self, x, txt, txt_mask, tau, img_grid, rt: Runtime, *, cond=None,
                cond_grids=()) -> torch.Tensor:
        """With ``cond`` (edit runs): the edit pipelines' call, ``hidden_states = cat([x, cond])``,
        ``img_shapes = [[(1, h, w), (1, h_1, w_1), ...]] * B``, output sliced to the N noisy rows
        (``drifttool.model.conditions``)."""
        h, w = (int(v) for v in img_grid)
        x_all, grids = join_conditions(x, cond, cond_grids, x.dtype)
        shapes = [(1, h, w), *((1, a, b) for a, b in grids)] if grids else (1, h, w)
        with instrument(self.transformer, rt):
            v = self.transformer(
                hidden_states=x_all, encoder_hidden_states=txt, encoder_hidden_states_mask=txt_mask,
                timestep=tau, img_shapes=[shapes] * x.shape[0], return_dict=False)[0]
        return v if cond is None else v[:, :x.shape[1]]


def _diffusers_version() -> str:
    try:
        import diffusers

        return diffusers.__version__
    except ImportError:  # pragma: no cover
        return "unknown"


def load_transformer(folder: str | Path, dtype: torch.dtype, variant: str | None = None) -> torch.nn.Module:
    """``QwenImageTransformer2DModel.from_pretrained(folder, torch_dtype=dtype, variant=variant)``,
    in eval mode; ``folder`` may be a pipeline folder (its ``transformer/`` is loaded, as
    ``drifttool.model.checkpoint_files.transformer_folder`` finds it).

    Raises:
        DriftToolError: diffusers missing, or the folder cannot be loaded.
    """
    mod = _diffusers_module()
    folder = transformer_folder(folder)
    try:
        return mod.QwenImageTransformer2DModel.from_pretrained(str(folder), torch_dtype=dtype, variant=variant).eval()
    except (OSError, ValueError, EnvironmentError) as e:
        raise DriftToolError(f"{folder}: diffusers cannot load the transformer ({e})") from None


def run_diffusers(spec, out: str | Path, *, transformer: torch.nn.Module | None = None,
                  overwrite: bool = False) -> dict[str, Any]:
    """A rollout whose velocities come from a (hooked) diffusers transformer, written as a
    drifttool artifact; ``spec`` is a ``RunSpec`` (its mode is forced to ``auto``: production
    sampler operators, traced). Without ``transformer``, the spec's checkpoint (or fixture
    model) is loaded with diffusers' ``from_pretrained``. Returns ``execute``'s summary."""
    spec = dataclasses.replace(spec, mode="auto")
    fx, s = resolve(spec)
    if transformer is None:
        transformer = load_transformer(s.checkpoint or fx.model_dir, s.torch_dtype, s.variant)
    return execute(spec, out, overwrite=overwrite, model=DiffusersQwenImage(transformer))
