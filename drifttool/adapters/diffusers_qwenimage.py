"""Capture adapter for diffusers' ``QwenImageTransformer2DModel`` (RFC ``diffusers_runtime_adapter_qwenimage``).

    >>> from diffusers import QwenImageTransformer2DModel
    >>> tr = QwenImageTransformer2DModel.from_pretrained("fixtures/tiny-t2i/transformer",
    ...                                                  torch_dtype=torch.bfloat16)
    >>> run_diffusers(RunSpec(), "runs/diffusers", transformer=tr)   # a diffusers rollout
    >>> diff_runs(open_run("runs/strict"), open_run("runs/diffusers")).first_drift.op
    'timestep_embed_mlp'

An unmodified diffusers transformer is instrumented from outside, inside ``instrument(tr, rt)``:
forward hooks (and pre-hooks) on its modules, plus two wrapped module-level functions of
``transformer_qwenimage`` (``apply_rotary_emb_qwen`` and ``dispatch_attention_fn``, which are
functions, not modules); everything is removed and restored on exit. Each hooked output is
recorded under the RFC operator name, stream and layout tag that drifttool's own MMDiT uses
(``drifttool.model.mmdit`` call-site table), through the same ``Runtime`` identity scope,
operator trace and ``Recorder``, so the artifact diffs against a drifttool run record for record.
The hooks only read tensors: the transformer's output bytes do not change (tested).

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
``apply_rotary_emb_qwen``              multi_axis_rope         img/txt output (stream from the table)
``dispatch_attention_fn``              joint_attention_fused   joint   output [B, S, H, Dh]
``attn.to_out.0`` / ``to_add_out``     attn_out_bias_gemm      img/txt output
``img_norm2`` / ``txt_norm2``          adaln_gate_residual #0  img/txt input (pre-hook)
``blocks.i`` output                    adaln_gate_residual #1  img/txt output
``*_mlp.net.0`` / ``*_mlp.net.2``      mlp_up_gemm_gelu /      img/txt output
                                       mlp_down_gemm
``norm_out``                           final_adaln_out         img     output (block L)
=====================================  ======================  ======  =====================

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from drifttool.adapters.peft_lora import canonical_parameters
from drifttool.errors import DriftToolError
from drifttool.model.checkpoint_files import transformer_folder
from drifttool.model.config import from_diffusers_config
from drifttool.ops.registry import spec as op_spec
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.settings import resolve

_DIFFUSERS_MODULE = "diffusers.models.transformers.transformer_qwenimage"


def _diffusers_module():
    try:
        return importlib.import_module(_DIFFUSERS_MODULE)
    except ImportError as e:
        raise DriftToolError(f"the diffusers capture adapter needs diffusers installed ({e}; "
                             "pip install 'diffusers>=0.42,<0.43', or the package's [test] extra)") from None


# -- attention backend read-back -----------------------------------------------------------------
def sdpa_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False) -> str:
    """The SDPA kernel torch selects for these arguments (``[B, H, S, D]`` layout), e.g.
    ``"FLASH_ATTENTION"`` or ``"MATH"``; ``"unknown"`` when the selector is unavailable."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal,
                                         scale=scale, enable_gqa=enable_gqa)
        names = {int(getattr(SDPBackend, n)): n for n in dir(SDPBackend) if n.isupper()}
        return names.get(int(choice), str(int(choice)))
    except Exception:  # noqa: BLE001 - a private selector: read-back is best effort
        return "unknown"


def attention_kernel(kwargs: dict[str, Any]) -> str:
    """Kernel identity of one ``dispatch_attention_fn`` call: diffusers backend, and for the
    native backend the SDPA kernel (see ``sdpa_kernel``)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    backend = kwargs.get("backend")
    if backend is None:
        backend = _AttentionBackendRegistry.get_active_backend()[0]
    name = AttentionBackendName(backend).value
    if name != AttentionBackendName.NATIVE.value:
        return f"diffusers.attention:{name}"
    q, k, v = (kwargs[n].permute(0, 2, 1, 3) for n in ("query", "key", "value"))
    sdpa = sdpa_kernel(q, k, v, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0),
                       kwargs.get("is_causal", False), kwargs.get("scale"),
                       kwargs.get("enable_gqa", False))
    return f"diffusers.attention:{name}/torch.sdpa:{sdpa}"


# -- the hooks -----------------------------------------------------------------------------------
class _Capture:
    """Hook state of one instrumented forward (or several): the runtime and the current block."""

    def __init__(self, transformer: torch.nn.Module, rt: Runtime) -> None:
        self.tr = transformer
        self.rt = rt
        self.depth = len(transformer.transformer_blocks)
        self.block = -1
        self.freqs: tuple[Any, Any] | None = None  # (img, txt) RoPE tables of the current attn
        self.pending: dict[str, list[torch.Tensor]] = {"img": [], "txt": []}
        self.handles: list[Any] = []
        self.names = {id(m): n for n, m in transformer.named_modules()}

    # recording ------------------------------------------------------------------------------
    def record(self, op: str, stream: str, outputs: list[tuple[torch.Tensor, str]], *,
               block: int, kernel: str) -> None:
        rt = self.rt
        site = rt.site(op, stream, block=block)
        rt.trace.record(site=site, contract=op_spec(op).contract, requested=rt.family,
                        actual="diffusers", kernel=kernel, fallback=False, reason="",
                        declared=False, device=str(outputs[0][0].device))
        if rt.recorder is not None and rt.mode.captures:
            for i, (t, layout) in enumerate(outputs):
                rt.recorder.capture(site, t.detach(), layout, index=i)

    def _hook(self, module: torch.nn.Module, op: str, stream: str, layout: str, block: int,
              *, pre: bool = False) -> None:
        """Record the module's output (or, ``pre``, its first input) as ``op``."""
        kernel = f"diffusers:{self.names.get(id(module), type(module).__name__)}" + (
            " (input)" if pre else "")

        def record(t: torch.Tensor) -> None:
            self.record(op, stream, [(t, layout)], block=block, kernel=kernel)

        if pre:
            h = module.register_forward_pre_hook(lambda m, args: record(args[0]))
        else:
            h = module.register_forward_hook(lambda m, args, out: record(out))
        self.handles.append(h)

    def _qkv(self, linear: torch.nn.Module, stream: str, heads_dim: int, last: bool) -> None:
        """Collect one of the three Q/K/V projections; record the triple at the third."""
        kernel = f"diffusers:{self.names.get(id(linear), 'Linear')} (q, k, v)"

        def hook(m, args, out):
            self.pending[stream].append(out.unflatten(-1, (-1, heads_dim)))  # [B, S, H, Dh]
            if last:
                outs, self.pending[stream] = self.pending[stream], []
                self.record("qkv_bias_gemm", stream, [(t, "BS..") for t in outs],
                            block=self.block, kernel=kernel)

        self.handles.append(linear.register_forward_hook(hook))

    def install(self) -> None:
        tr = self.tr
        L = self.depth
        self._hook(tr.time_text_embed, "timestep_embed_mlp", "none", "B.", -1)
        self._hook(tr.txt_in, "txt_in_rmsnorm_linear", "txt", "BS.", -1)
        self._hook(tr.img_in, "latent_proj_gemm", "img", "BS.", -1)
        self._hook(tr.norm_out, "final_adaln_out", "img", "BS.", L)
        self._hook(tr.proj_out, "latent_proj_gemm", "img", "BS.", L)
        for i, blk in enumerate(tr.transformer_blocks):
            self._block(i, blk)

    def _block(self, i: int, blk: torch.nn.Module) -> None:
        attn = blk.attn
        dh = attn.inner_dim // attn.heads

        def enter(m, args, kwargs):
            self.block = i

        def leave(m, args, kwargs, out):
            txt, img = out  # (encoder_hidden_states, hidden_states)
            self.record("adaln_gate_residual", "img", [(img, "BS.")], block=i,
                        kernel=f"diffusers:transformer_blocks.{i} (output)")
            self.record("adaln_gate_residual", "txt", [(txt, "BS.")], block=i,
                        kernel=f"diffusers:transformer_blocks.{i} (output)")
            self.block = -1

        def attn_inputs(m, args, kwargs):
            self.freqs = kwargs.get("image_rotary_emb")
            img = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            txt = kwargs.get("encoder_hidden_states")
            self.record("adaln_modulation", "img", [(img, "BS.")], block=i,
                        kernel=f"diffusers:transformer_blocks.{i}.attn (input: img_norm1+_modulate)")
            self.record("adaln_modulation", "txt", [(txt, "BS.")], block=i,
                        kernel=f"diffusers:transformer_blocks.{i}.attn (input: txt_norm1+_modulate)")

        self.handles.append(blk.register_forward_pre_hook(enter, with_kwargs=True))
        self._hook(blk.img_mod, "adaln_mod_projection", "img", "B.", i)
        self._hook(blk.txt_mod, "adaln_mod_projection", "txt", "B.", i)
        self.handles.append(attn.register_forward_pre_hook(attn_inputs, with_kwargs=True))
        for name, last in (("to_q", False), ("to_k", False), ("to_v", True)):
            self._qkv(getattr(attn, name), "img", dh, last)
        for name, last in (("add_q_proj", False), ("add_k_proj", False), ("add_v_proj", True)):
            self._qkv(getattr(attn, name), "txt", dh, last)
        self._hook(attn.norm_q, "qk_rmsnorm", "img", "BS..", i)
        self._hook(attn.norm_k, "qk_rmsnorm", "img", "BS..", i)
        self._hook(attn.norm_added_q, "qk_rmsnorm", "txt", "BS..", i)
        self._hook(attn.norm_added_k, "qk_rmsnorm", "txt", "BS..", i)
        self._hook(attn.to_out[0], "attn_out_bias_gemm", "img", "BS.", i)
        self._hook(attn.to_add_out, "attn_out_bias_gemm", "txt", "BS.", i)
        self._hook(blk.img_norm2, "adaln_gate_residual", "img", "BS.", i, pre=True)
        self._hook(blk.txt_norm2, "adaln_gate_residual", "txt", "BS.", i, pre=True)
        self._hook(blk.img_mlp, "adaln_modulation", "img", "BS.", i, pre=True)
        self._hook(blk.img_mlp.net[0], "mlp_up_gemm_gelu", "img", "BS.", i)
        self._hook(blk.img_mlp.net[2], "mlp_down_gemm", "img", "BS.", i)
        self._hook(blk.txt_mlp, "adaln_modulation", "txt", "BS.", i, pre=True)
        self._hook(blk.txt_mlp.net[0], "mlp_up_gemm_gelu", "txt", "BS.", i)
        self._hook(blk.txt_mlp.net[2], "mlp_down_gemm", "txt", "BS.", i)
        self.handles.append(blk.register_forward_hook(leave, with_kwargs=True))

    # wrapped module functions ---------------------------------------------------------------
    def rope(self, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def apply_rotary_emb_qwen(x, freqs_cis, *args, **kwargs):
            out = original(x, freqs_cis, *args, **kwargs)
            img = self.freqs[0] if self.freqs is not None else None
            stream = "img" if freqs_cis is img else "txt"
            self.record("multi_axis_rope", stream, [(out, "BS..")], block=self.block,
                        kernel="diffusers:apply_rotary_emb_qwen")
            return out

        return apply_rotary_emb_qwen

    def attention(self, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        import inspect

        sig = inspect.signature(original)

        def dispatch_attention_fn(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            kernel = attention_kernel(dict(bound.arguments))
            out = original(*args, **kwargs)  # [B, S, H, Dh]
            self.record("joint_attention_fused", "joint", [(out, "BS..")], block=self.block,
                        kernel=kernel)
            return out

        return dispatch_attention_fn

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


@contextlib.contextmanager
def instrument(transformer: torch.nn.Module, rt: Runtime) -> Iterator[_Capture]:
    """Hook ``transformer`` (a diffusers ``QwenImageTransformer2DModel``) for the duration of the
    block: every forward inside records its operator outputs into ``rt`` (scope, trace,
    recorder) as drifttool's MMDiT would. Hooks and wrapped functions are removed on exit.

    Raises:
        DriftToolError: diffusers is not installed, or ``transformer`` is not a
            ``QwenImageTransformer2DModel``.
    """
    mod = _diffusers_module()
    if not isinstance(transformer, mod.QwenImageTransformer2DModel):
        raise DriftToolError(f"expected a diffusers QwenImageTransformer2DModel, got "
                             f"{type(transformer).__name__}")
    cap = _Capture(transformer, rt)
    saved = {n: getattr(mod, n) for n in ("apply_rotary_emb_qwen", "dispatch_attention_fn")}
    try:
        cap.install()
        mod.apply_rotary_emb_qwen = cap.rope(saved["apply_rotary_emb_qwen"])
        mod.dispatch_attention_fn = cap.attention(saved["dispatch_attention_fn"])
        yield cap
    finally:
        for n, fn in saved.items():
            setattr(mod, n, fn)
        cap.remove()


# -- a rollout driven by the diffusers transformer ------------------------------------------------
class DiffusersQwenImage(torch.nn.Module):
    """A diffusers transformer behind drifttool's model call
    ``model(x, txt, txt_mask, tau, img_grid, rt) -> v`` (``drifttool.runner.execute(model=...)``).

    Parameters are reported under the checkpoint's own names (the diffusers module's; a peft
    LoRA layer's under drifttool's, ``peft_lora``), so the weight digest of the fingerprint
    equals that of drifttool's MMDiT on the same weights (and adapter, in the same mode).
    Each forward is instrumented (``instrument``) with the runtime it is given.
    """

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

    def forward(self, x, txt, txt_mask, tau, img_grid, rt: Runtime) -> torch.Tensor:
        h, w = (int(v) for v in img_grid)
        with instrument(self.transformer, rt):
            return self.transformer(
                hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=txt_mask,
                timestep=tau, img_shapes=[(1, h, w)] * x.shape[0], return_dict=False)[0]


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
