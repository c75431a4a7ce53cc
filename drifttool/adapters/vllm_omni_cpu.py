"""vllm-omni's Qwen-Image transformer in this process, on the CPU: for developing and testing a
capture without a GPU.

    >>> od = cpu_runtime()            # once per process; returns the OmniDiffusionConfig
    >>> model = build(od, config, torch.float32)   # a vllm-omni QwenImageTransformer2DModel

vllm-omni 0.30 ships no CPU platform: its fallback platform refuses to choose an attention backend,
and its attention implementations dispatch on the device family (CUDA, ROCm, NPU, XPU, MUSA) and
raise on any other. ``cpu_runtime`` installs, process-wide and once:

- a CPU platform (``CpuPlatform``): device type ``cpu``, one device, ``gloo`` collectives, and
  ``CpuSDPABackend`` as its only attention backend;
- ``CpuSDPABackend``: vllm-omni's torch SDPA backend whose ``forward`` runs SDPA itself (vllm-omni's
  ``_forward_impl``, the same function its CUDA path calls) instead of dispatching on the device;
- a single-rank ``gloo`` process group through vllm-omni's own ``parallel_state`` (every parallel
  degree 1), which its parallel linear layers read at construction.

Nothing here changes the arithmetic of a layer: the linears run vLLM's unquantized method (with a
CUDA-less vLLM build: ``F.linear``), attention runs ``torch.nn.functional.scaled_dot_product_attention``
as vllm-omni's SDPA backend does on CUDA. A process that already runs vllm-omni on a real
platform must not call ``cpu_runtime``.

Raises (every function): ``DriftToolError`` when vllm-omni is not installed or a distributed
group of another size already exists.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from typing import Any

import torch

from drifttool.adapters.single_rank import single_rank_env
from drifttool.errors import DriftToolError

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}

BACKEND = f"{__name__}.CpuSDPABackend"
"""The class path vllm-omni's attention selector resolves on ``CpuPlatform``."""


def _require(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DriftToolError(f"the vllm-omni adapter needs vllm and vllm-omni installed ({e}); see "
                             "docs/adapters.md for the CPU test environment") from None


def _platform_class() -> type:
    """``CpuPlatform``, built on first use (vllm-omni is optional)."""
    if "platform" not in _STATE:
        interface = _require("vllm_omni.platforms.interface")

        class CpuPlatform(interface.UnspecifiedOmniPlatform):
            dist_backend = "gloo"

            @classmethod
            def get_device_count(cls) -> int:
                return 1

            @classmethod
            def set_device(cls, device) -> None:
                pass

            @classmethod
            def get_diffusion_attn_backend_cls(cls, selected_backend, head_size,
                                               allow_trtllm_default=False):
                return BACKEND

        _STATE["platform"] = CpuPlatform
    return _STATE["platform"]


def _backend_classes() -> tuple[type, type]:
    """``(CpuSDPABackend, CpuSDPAImpl)``, built on first use, after the platform is set (vllm-omni
    modules read the current platform when they are imported)."""
    if "backend" not in _STATE:
        sdpa = _require("vllm_omni.diffusion.attention.backends.sdpa")

        class CpuSDPAImpl(sdpa.SDPAImpl):
            """vllm-omni's SDPA implementation, run directly (no device-family dispatch)."""

            def forward(self, query, key, value, attn_metadata=None):
                return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")

        class CpuSDPABackend(sdpa.SDPABackend):
            @staticmethod
            def get_name() -> str:
                return "TORCH_SDPA_CPU"

            @staticmethod
            def get_impl_cls():
                return CpuSDPAImpl

        _STATE["backend"] = (CpuSDPABackend, CpuSDPAImpl)
    return _STATE["backend"]


def __getattr__(name: str):  # the backend's class path must resolve by name
    if name == "CpuPlatform":
        return _platform_class()
    if name in ("CpuSDPABackend", "CpuSDPAImpl"):
        return dict(zip(("CpuSDPABackend", "CpuSDPAImpl"), _backend_classes()))[name]
    raise AttributeError(name)


def cpu_runtime() -> Any:
    """Install the CPU platform and the single-rank gloo group (module docstring), once per
    process; returns the ``OmniDiffusionConfig`` (Qwen-Image pipeline, every degree 1) the model
    is built and run under (``enforce_eager=True``: nothing is compiled).

    Raises:
        DriftToolError: vllm-omni missing, or torch.distributed already initialised with more
            than one rank.
    """
    with _LOCK:
        if "config" in _STATE:
            return _STATE["config"]
        platforms = _require("vllm_omni.platforms")
        interface = _require("vllm_omni.platforms.interface")
        current = platforms._current_omni_platform
        if current is not None and type(current) is not interface.UnspecifiedOmniPlatform:
            raise DriftToolError(f"vllm-omni already runs on {type(current).__name__}; the CPU "
                                 "runtime is for a machine without one")
        platforms._current_omni_platform = _platform_class()()
        ps = _require("vllm_omni.diffusion.distributed.parallel_state")
        if not isinstance(ps.current_omni_platform, _platform_class()):
            raise DriftToolError("vllm-omni's parallel state was imported before the CPU runtime "
                                 "was set up: call cpu_runtime() before other vllm-omni imports")
        data = _require("vllm_omni.diffusion.data")
        single_rank_env("vllm-omni")
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                        distributed_init_method="env://", backend="gloo")
        ps.initialize_model_parallel(backend="gloo")
        # eager: the model is built and run here, never compiled (the capture refuses compiled runs)
        _STATE["config"] = data.OmniDiffusionConfig(model_class_name="QwenImagePipeline",
                                                    enforce_eager=True)
        return _STATE["config"]


def forward_context(od: Any):
    """vllm-omni's forward context for ``od`` (its layers read the parallel config from it)."""
    fc = _require("vllm_omni.diffusion.forward_context")
    return fc.set_forward_context(omni_diffusion_config=od)


def build(od: Any, config: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """A vllm-omni ``QwenImageTransformer2DModel`` of a diffusers ``config`` (its ``config.json``
    keys the constructor takes), with uninitialised weights, cast to ``dtype``, in eval mode.

    Raises:
        DriftToolError: vllm-omni missing, or the config asks for what the constructor lacks.
    """
    mod = _require("vllm_omni.diffusion.models.qwen_image.qwen_image_transformer")
    cfgmod = _require("vllm_omni.diffusion.config")

    accepted = set(inspect.signature(mod.QwenImageTransformer2DModel.__init__).parameters)
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    unknown = sorted(k for k in kwargs if k not in accepted and k not in ("pooled_projection_dim",))
    if unknown:
        raise DriftToolError(f"vllm-omni's QwenImageTransformer2DModel does not take {unknown}")
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    if "axes_dims_rope" in kwargs:
        kwargs["axes_dims_rope"] = tuple(kwargs["axes_dims_rope"])
    with cfgmod.set_current_diffusion_config(od), forward_context(od):
        return mod.QwenImageTransformer2DModel(od_config=od, **kwargs).to(dtype).eval()
