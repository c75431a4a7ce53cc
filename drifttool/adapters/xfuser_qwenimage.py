"""Capture adapter for xfuser (xDiT) 0.7.0's Qwen-Image transformer,
``xFuserQwenImageTransformerWrapper``, on one rank.

    >>> tr = load_transformer("fixtures/tiny-t2i/transformer", torch.float32)  # a diffusers folder
    >>> run_xfuser(RunSpec(dtype="float32"), "runs/xfuser", transformer=tr)
    >>> diff_runs(open_run("runs/diffusers"), open_run("runs/xfuser")).first_drift.op
    'joint_attention_fused'

xfuser's wrapper subclasses diffusers' ``QwenImageTransformer2DModel``: same modules, same module
paths, its own ``forward`` (sequence-parallel chunking, a joint text+image attention mask built
once) and its own attention processor (``xFuserQwenDoubleStreamAttnProcessor``: diffusers' Q/K/V
projections, Q/K RMSNorm and ``apply_rotary_emb_qwen``, then xfuser's ``USP``). So the capture is
the diffusers adapter's (``drifttool.adapters.diffusers_qwenimage``): its table ``TAPS`` as
forward hooks, and its ``AttentionGlue`` for RoPE and attention. Only the attention entry point
differs: ``USP`` never reaches diffusers' dispatcher; it runs the function xfuser's registry
``ATTENTION_FUNCTION_REGISTRY`` holds for the runtime state's backend (the point
``register_attention_function`` binds). For the block, that entry is replaced by a capture that
records the query and key it is handed (``multi_axis_rope``: rows ``[0, L)`` text, ``[L, L + N)``
image) and its output (``joint_attention_fused``) and restores the entry on exit.

Kernel read-back: ``xfuser.attention:<backend>`` and, for the ``SDPA`` backend, the SDPA kernel
torch selects for the exact arguments (``diffusers_attention.sdpa_kernel``), then the mask the
kernel received: ``attn_mask=none`` where the attention module was handed a text mask and the
kernel got none (xfuser 0.7.0's processor drops the joint mask its ``forward`` builds, so padded
text tokens are attended: see docs/adapters.md).

Refused (``UnsupportedConfigError`` / ``DriftToolError``): another xfuser (``xfuser_cpu``) or
diffusers version; any parallel world size above 1 (the hooks would record one rank's shard as
the whole tensor); ``zero_cond_t`` and condition images (edit runs: not captured yet); xfuser's
AITER/FlyDSL fused QK-norm+RoPE path (the norms would not run as modules); an attention call that
did not reach the captured registry entry; a capture point that never fired.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Iterator

import torch

from drifttool.adapters.diffusers_qwenimage import (
    TAPS, AttentionGlue, DiffusersQwenImage, _diffusers_module, _diffusers_version, rope_kernel)
from drifttool.adapters.taps import tap_modules
from drifttool.adapters.xfuser_cpu import check_version, cpu_runtime, transformer_module, world_sizes
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.model.checkpoint_files import transformer_folder
from drifttool.model.config import from_diffusers_config
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.settings import resolve


def attention_kernel(backend: Any, query, key, value, attn_mask, dropout_p: float,
                     is_causal: bool) -> str:
    """Kernel identity of one xfuser attention call (``[B, H, S, D]`` tensors, the registry
    function's arguments): ``xfuser.attention:<backend name>``, for the SDPA backend with the
    SDPA kernel torch selects (``diffusers_attention.sdpa_kernel``)."""
    name = getattr(backend, "name", str(backend))
    if name != "SDPA":
        return f"xfuser.attention:{name}"
    from drifttool.adapters.diffusers_attention import sdpa_kernel  # lazy: diffusers is optional

    return f"xfuser.attention:{name}/torch.sdpa:" + sdpa_kernel(query, key, value, attn_mask,
                                                                dropout_p, is_causal)


@dataclasses.dataclass
class _Registry:
    """The capture in xfuser's ``ATTENTION_FUNCTION_REGISTRY``: the attention module's pre-hook
    calls ``begin``; the module's next registry call is recorded through ``glue``."""

    glue: AttentionGlue
    backend: Any
    original: Any
    pending: bool = False
    masked: bool = False
    begun: int = 0
    captured: int = 0

    def begin(self, kwargs: dict[str, Any]) -> None:
        self.pending = True
        self.begun += 1
        self.masked = any(kwargs.get(k) is not None
                          for k in ("encoder_hidden_states_mask", "attention_mask"))

    def __call__(self, query, key, value, dropout_p=0.0, is_causal=False, attention_kwargs=None):
        if not self.pending:  # another model's attention: unrecorded
            return self.original(query, key, value, dropout_p=dropout_p, is_causal=is_causal,
                                 attention_kwargs=attention_kwargs)
        self.pending = False
        self.captured += 1
        mask = (attention_kwargs or {}).get("attn_mask")
        kernel = attention_kernel(self.backend, query, key, value, mask, dropout_p, is_causal)
        kernel += ", attn_mask=none" if mask is None and self.masked else ""
        lse = []

        def run() -> torch.Tensor:
            out, extra = self.original(query, key, value, dropout_p=dropout_p,
                                       is_causal=is_causal, attention_kwargs=attention_kwargs)
            lse.append(extra)
            return out.transpose(1, 2)  # [B, S, H, Dh], as the glue records

        args = {"query": query.transpose(1, 2), "key": key.transpose(1, 2), "kernel": kernel}
        out = self.glue.attention(self.backend, args, run)
        return out.transpose(1, 2), lse[0]


def _refuse_unsupported(transformer: torch.nn.Module, mod: Any) -> None:
    sizes = {k: v for k, v in world_sizes().items() if v != 1}
    if sizes:
        name, size = next(iter(sizes.items()))
        raise UnsupportedConfigError(f"xfuser capture: {name} parallelism (world size {size}) is "
                                     "not supported; the capture runs one rank")
    if getattr(transformer, "zero_cond_t", False):
        raise UnsupportedConfigError("xfuser capture: zero_cond_t (edit-2511 select01 "
                                     "modulation) is not supported")
    if getattr(mod, "_HAS_FLYDSL", False):
        raise UnsupportedConfigError("xfuser capture: the AITER/FlyDSL fused QK-norm+RoPE path is "
                                     "not supported (the Q/K RMSNorms would not run as modules)")


XFUSER_DIFFUSERS = "0.42."
"""The diffusers release xfuser 0.7.0 is captured with (its wrapper subclasses diffusers' model)."""


def _xfuser_diffusers():
    """diffusers' Qwen-Image module, when its version is ``XFUSER_DIFFUSERS``.

    Raises:
        DriftToolError: diffusers missing or of another version.
    """
    mod = _diffusers_module()  # installed, and a version the diffusers adapter describes
    version = _diffusers_version()
    if not version.startswith(XFUSER_DIFFUSERS):
        raise DriftToolError(f"the xfuser capture adapter runs with diffusers {XFUSER_DIFFUSERS}x, "
                             f"not {version}")
    return mod


@contextlib.contextmanager
def instrument(transformer: torch.nn.Module, rt: Runtime) -> Iterator[None]:
    """Hook ``transformer`` (an ``xFuserQwenImageTransformerWrapper``) for the block: every
    forward inside records its operator outputs into ``rt`` as drifttool's MMDiT would. The
    hooks and the registry entry are restored on exit.

    Raises:
        DriftToolError: xfuser or diffusers missing or of another version, not xfuser's
            Qwen-Image wrapper, xfuser's runtime state not set up (``xfuser_cpu.cpu_runtime``),
            another capture active, or (on
            exit, after a forward) an attention call that bypassed the captured registry entry or
            a capture point that never fired.
        UnsupportedConfigError: parallelism, ``zero_cond_t``, the fused QK-norm+RoPE path.
    """
    check_version()
    dmod = _xfuser_diffusers()
    mod = transformer_module()
    if not isinstance(transformer, mod.xFuserQwenImageTransformerWrapper):
        raise DriftToolError(f"expected xfuser's xFuserQwenImageTransformerWrapper, got "
                             f"{type(transformer).__name__}")
    _refuse_unsupported(transformer, mod)
    import xfuser.core.distributed.attention_backend as ab
    from xfuser.core.distributed import runtime_state as rs

    if not rs.runtime_state_is_initialized():
        raise DriftToolError("xfuser capture: xfuser's runtime state is not set up (on the CPU: "
                             "drifttool.adapters.xfuser_cpu.cpu_runtime())")
    backend = rs.get_runtime_state().attention_backend
    registry = ab.ATTENTION_FUNCTION_REGISTRY
    if backend not in registry:
        raise DriftToolError(f"xfuser capture: attention backend {backend} is not registered")
    if isinstance(registry[backend], _Registry):
        raise DriftToolError("xfuser capture: another capture of xfuser's attention is active")
    blocks = transformer.transformer_blocks
    attn = blocks[0].attn
    glue = AttentionGlue(rt, lambda _backend, args: args["kernel"],
                         lambda device: rope_kernel(dmod, device), actual="xfuser")
    capture = _Registry(glue, backend, registry[backend])
    with contextlib.ExitStack() as stack:
        registry[backend] = capture
        stack.callback(registry.__setitem__, backend, capture.original)
        for i, blk in enumerate(blocks):
            def pre(m, args, kwargs, i=i):
                glue.enter(i, kwargs)
                capture.begin(kwargs)

            stack.callback(blk.attn.register_forward_pre_hook(pre, with_kwargs=True).remove)
        stack.enter_context(tap_modules(transformer, TAPS, rt, actual="xfuser",
                                        depth=len(blocks), head_dim=attn.inner_dim // attn.heads,
                                        require_all=True))
        yield
        if capture.begun != capture.captured:
            raise DriftToolError(f"xfuser capture: {capture.begun - capture.captured} of "
                                 f"{capture.begun} attention calls did not reach xfuser's "
                                 f"registry entry for {backend} (the processor dispatched "
                                 "elsewhere)")
        if glue.attention_calls and not glue.rope_calls:
            raise DriftToolError("xfuser capture: attention ran without rotary embeddings: no "
                                 "multi_axis_rope to record")


class XfuserQwenImage(DiffusersQwenImage):
    """xfuser's transformer behind drifttool's model call
    ``model(x, txt, txt_mask, tau, img_grid, rt) -> v`` (``drifttool.runner.execute(model=...)``):
    the diffusers wrapper (``DiffusersQwenImage``: the checkpoint's parameter names, so the
    fingerprint's weight digest equals diffusers' and drifttool's on the same weights), each
    forward instrumented by this module's ``instrument``."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        torch.nn.Module.__init__(self)
        object.__setattr__(self, "transformer", transformer)  # not a submodule: keep the names
        # diffusers' config of the wrapper: the same keys, xfuser's class name
        config = dict(transformer.config)
        if config.get("_class_name") == type(transformer).__name__:
            config["_class_name"] = "QwenImageTransformer2DModel"
        self.config = from_diffusers_config(config)
        self.source = {"implementation": "xfuser.xFuserQwenImageTransformerWrapper",
                       "adapter": f"drifttool.adapters.xfuser_qwenimage (xfuser {check_version()})",
                       "diffusers_version": _diffusers_version()}

    def forward(self, x, txt, txt_mask, tau, img_grid, rt: Runtime, *, cond=None,
                cond_grids=()) -> torch.Tensor:
        """Raises ``UnsupportedConfigError`` for condition images (edit runs)."""
        if cond is not None:
            raise UnsupportedConfigError("xfuser capture: condition images (edit runs) are not "
                                         "supported")
        h, w = (int(v) for v in img_grid)
        with instrument(self.transformer, rt):
            return self.transformer(
                hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=txt_mask,
                timestep=tau, img_shapes=[(1, h, w)] * x.shape[0], return_dict=False)[0]


def load_transformer(folder: str | Path, dtype: torch.dtype,
                     variant: str | None = None) -> torch.nn.Module:
    """``xFuserQwenImageTransformerWrapper.from_pretrained(folder, torch_dtype=dtype)`` of a
    diffusers checkpoint folder (a pipeline folder's ``transformer/``), in eval mode, after the
    CPU runtime is set up (``xfuser_cpu.cpu_runtime``: one rank).

    Raises:
        DriftToolError: xfuser or diffusers missing or of another version, or the folder cannot
            be loaded.
    """
    _xfuser_diffusers()
    cpu_runtime()
    cls = transformer_module().xFuserQwenImageTransformerWrapper
    folder = transformer_folder(folder)
    try:
        return cls.from_pretrained(str(folder), torch_dtype=dtype, variant=variant).eval()
    except (OSError, ValueError, EnvironmentError) as e:
        raise DriftToolError(f"{folder}: xfuser cannot load the transformer ({e})") from None


def run_xfuser(spec, out: str | Path, *, transformer: torch.nn.Module | None = None,
               overwrite: bool = False) -> dict[str, Any]:
    """A rollout whose velocities come from xfuser's (hooked) transformer, written as a
    drifttool artifact; as ``diffusers_qwenimage.run_diffusers`` (mode forced to ``auto``).
    Without ``transformer``, the spec's checkpoint (or fixture model) is loaded on the CPU."""
    spec = dataclasses.replace(spec, mode="auto")
    fx, s = resolve(spec)
    if transformer is None:
        transformer = load_transformer(s.checkpoint or fx.model_dir, s.torch_dtype, s.variant)
    return execute(spec, out, overwrite=overwrite, model=XfuserQwenImage(transformer))
