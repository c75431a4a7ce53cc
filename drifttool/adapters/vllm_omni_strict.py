"""drifttool's strict GEMMs bound into vllm-omni's Qwen-Image transformer, through vLLM's linear
method.

    >>> binding = bind_strict_gemms(transformer, od_config)   # after the weights are loaded
    >>> binding.bound        # {module path: RFC operator}, e.g. "...attn.to_out": "attn_out_bias_gemm"
    >>> binding.unbound      # {module path: why its linear keeps vLLM's GEMM}
    >>> binding.restore()    # vLLM's methods back

Every vLLM linear (``ReplicatedLinear``, ``ColumnParallelLinear``, ``RowParallelLinear``,
``QKVParallelLinear``) computes its product in one place: ``layer.quant_method.apply(layer, x,
bias)`` (``vllm/model_executor/layers/linear.py``; the unquantized method calls its
``_gemm_impl``, ``F.linear`` on CUDA). Binding replaces ``layer.quant_method`` with a
``StrictLinearMethod`` (a ``LinearMethodBase``) whose ``apply`` runs drifttool's strict operator
of that layer (the operator registry's ``strict`` family on the input's device, contract v2 of
``drifttool.ops.strict_gemm``), so the layer's output bytes are the operator's:

- a plain GEMM (``img_in``/``proj_out``: ``latent_proj_gemm``; ``attn.to_out``/``to_add_out``:
  ``attn_out_bias_gemm``; ``*_mlp.net.2``: ``mlp_down_gemm``) gets ``x``, the weight and the bias;
- a fused QKV projection (``attn.to_qkv``, ``attn.add_kv_proj``: weight ``[3·H·Dh, d]``) is split
  at its ``output_sizes`` into the three weights and biases ``qkv_bias_gemm`` takes; its three
  ``[B, S, H, Dh]`` outputs are flattened and concatenated back to the fused ``[B, S, 3·H·Dh]``.

The linears whose strict operator fuses more than the GEMM keep vLLM's method and are listed in
``Binding.unbound`` with the module swap they need: ``*_mlp.net.0.proj`` (GELU inside
``mlp_up_gemm_gelu``, one cast after it), ``img_mod.1``/``txt_mod.1`` (SiLU inside
``adaln_mod_projection``), ``txt_in`` (RMSNorm inside ``txt_in_rmsnorm_linear``),
``time_text_embed`` (``timestep_embed_mlp``), ``norm_out.linear`` (``final_adaln_out``).

Read-back: the method's class and its ``_gemm_impl`` (``strict:<operator>``) are what the capture
adapter reads per linear (``vllm_omni_glue.kernel_of``), so a bound linear's trace entry names
``StrictLinearMethod/strict:<operator>``.

Raises (``bind_strict_gemms``): ``UnsupportedConfigError`` in one line for a configuration the
binding cannot keep strict (``refusal``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import drifttool.ops  # noqa: F401  (declares the operators and registers the strict family)
from drifttool.adapters.vllm_omni_glue import check_version
from drifttool.adapters.vllm_omni_qwenimage import compiled_problem
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.ops.registry import implementation

STRICT_GEMMS: tuple[tuple[str, str], ...] = (
    (r"img_in|proj_out", "latent_proj_gemm"),
    (r"transformer_blocks\.\d+\.attn\.(to_qkv|add_kv_proj)", "qkv_bias_gemm"),
    (r"transformer_blocks\.\d+\.attn\.(to_out|to_add_out)", "attn_out_bias_gemm"),
    (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.2", "mlp_down_gemm"),
)
"""(module path pattern, strict operator) of the linears a GEMM method binds."""

NEEDS_MODULE_SWAP: tuple[tuple[str, str], ...] = (
    (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.0\.proj",
     "mlp_up_gemm_gelu applies GELU before its one cast: swap the ColumnParallelApproxGELU module"),
    (r"transformer_blocks\.\d+\.(img|txt)_mod\.1",
     "adaln_mod_projection includes the SiLU: swap the img_mod/txt_mod Sequential"),
    (r"txt_in", "txt_in_rmsnorm_linear includes txt_norm: swap txt_norm and txt_in together"),
    (r"time_text_embed\..*", "timestep_embed_mlp is one operator: swap time_text_embed"),
    (r"norm_out\.linear", "final_adaln_out includes the modulation: swap norm_out"),
)
"""(module path pattern, why a GEMM method cannot bind it) of the linears left to module swaps."""


def _op_for(path: str) -> tuple[str | None, str]:
    """(strict operator, "") for a bindable linear, else (None, reason)."""
    for pattern, op in STRICT_GEMMS:
        if re.fullmatch(pattern, path):
            return op, ""
    for pattern, why in NEEDS_MODULE_SWAP:
        if re.fullmatch(pattern, path):
            return None, why
    return None, "no strict operator is known for this linear"


def refusal(od_config: Any) -> str | None:
    """Why the strict GEMM binding cannot run under ``od_config`` (an ``OmniDiffusionConfig``),
    or ``None``. One line each, checked in this order:

    - ``enforce_eager=False``: vllm-omni compiles the blocks (regional ``torch.compile``); inductor
      would trace the bound method and may fuse or reorder its arithmetic;
    - a cache backend (``cache_backend`` not ``"none"``): TeaCache, cache-dit and the others skip
      or reuse block outputs between steps, so the bound kernels do not run every step;
    - tensor parallelism: row-parallel linears all-reduce partial sums in the collective's order,
      not contract v2's;
    - Ring attention (``ring_degree > 1``): it merges partial softmax states and raises on a text
      mask (padded prompts);
    - sequence parallelism with ``mask_sp_padding=False``: the pad tokens of the sharded image
      sequence are attended.
    """
    if not getattr(od_config, "enforce_eager", False):
        return ("strict binding needs enforce_eager=True (vllm-omni would compile the blocks and "
                "inductor may fuse or reorder the bound GEMMs)")
    cache = getattr(od_config, "cache_backend", None)
    if cache not in (None, "none"):
        return (f"strict binding refuses cache backend {cache!r}: a step cache skips or reuses "
                "block outputs, so the bound kernels do not run every step")
    pc = getattr(od_config, "parallel_config", None)
    if pc is not None:
        if getattr(pc, "tensor_parallel_size", 1) > 1:
            return (f"strict binding refuses tensor_parallel_size={pc.tensor_parallel_size}: "
                    "row-parallel linears all-reduce partial sums in the collective's order")
        if getattr(pc, "ring_degree", 1) > 1:
            return (f"strict binding refuses ring_degree={pc.ring_degree}: Ring attention merges "
                    "partial softmax states and raises on a text mask")
        sp = getattr(pc, "sequence_parallel_size", 1) or 1
        if sp > 1 and not getattr(pc, "mask_sp_padding", False):
            return (f"strict binding refuses sequence_parallel_size={sp} with mask_sp_padding=False: "
                    "the pad tokens of the sharded sequence would be attended")
    return None


class StrictGemm:
    """``_gemm_impl(layer, x, weight, bias)`` of a bound linear: the strict operator ``op`` on
    ``x``'s device (``registry.implementation(op, "strict", device)``, constraints checked on
    every call). ``__name__`` (``strict:<op>``) is what the trace reads back."""

    def __init__(self, op: str, splits: tuple[int, ...] | None = None, heads: int = 0) -> None:
        self.op = op
        self.splits = splits  # fused QKV: the output sizes of q, k, v
        self.heads = heads
        self.__name__ = f"strict:{op}"
        self._impls: dict[str, Callable[..., Any]] = {}

    def _impl(self, device: str) -> Callable[..., Any]:
        if device not in self._impls:
            self._impls[device] = implementation(self.op, "strict", device)
        return self._impls[device]

    def __call__(self, layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [..., K], ``weight`` [N, K], ``bias`` [N] or None → [..., N] in ``x``'s dtype."""
        fn = self._impl(x.device.type)
        if self.splits is None:
            return fn(x, weight, bias)
        ws = weight.split(self.splits, dim=0)
        bs = bias.split(self.splits, dim=0) if bias is not None else (None,) * 3
        q, k, v = fn(x, ws[0], bs[0], ws[1], bs[1], ws[2], bs[2], self.heads)
        return torch.cat([t.flatten(-2) for t in (q, k, v)], dim=-1)


def _method_class() -> type:
    """``StrictLinearMethod``, built on first use (vLLM is optional)."""
    global _METHOD
    if _METHOD is None:
        try:
            from vllm.model_executor.layers.linear import LinearMethodBase
        except ImportError as e:
            raise DriftToolError(f"strict binding needs vllm installed ({e})") from None

        class StrictLinearMethod(LinearMethodBase):
            """A vLLM linear method running drifttool's strict operator (module docstring); it is
            bound after the weights exist and creates none."""

            def __init__(self, gemm: StrictGemm, replaced: Any) -> None:
                self._gemm_impl = gemm
                self.replaced = replaced  # the method it replaced, put back by Binding.restore

            def create_weights(self, layer, *args, **kwargs):
                raise DriftToolError("StrictLinearMethod is bound to a built linear; it creates "
                                     "no weights (build with vLLM's method, then bind)")

            def process_weights_after_loading(self, layer) -> None:
                pass

            def apply(self, layer, x, bias=None):
                return self._gemm_impl(layer, x, layer.weight, bias)

        _METHOD = StrictLinearMethod
    return _METHOD


_METHOD: type | None = None


@dataclass
class Binding:
    """The linears of one transformer bound by ``bind_strict_gemms``."""

    bound: dict[str, str] = field(default_factory=dict)
    """module path → strict operator."""
    unbound: dict[str, str] = field(default_factory=dict)
    """module path → why it keeps vLLM's method."""
    _layers: dict[str, torch.nn.Module] = field(default_factory=dict, repr=False)

    def restore(self) -> None:
        """Put back the methods the binding replaced (idempotent)."""
        for layer in self._layers.values():
            qm = layer.quant_method
            if type(qm) is _method_class():
                layer.quant_method = qm.replaced
        self._layers.clear()

    def __enter__(self) -> "Binding":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def bindable(transformer: Any, od_config: Any) -> torch.nn.Module:
    """The vllm-omni transformer to bind (``VllmOmniQwenImage``, the capture wrapper
    ``load_transformer`` returns, is unwrapped), after the checks every strict binding makes.

    Raises:
        DriftToolError: vllm-omni missing or of a version the adapter does not describe.
        UnsupportedConfigError: ``refusal(od_config)``; a transformer compiled by torch.compile
            (whatever the config says); not vllm-omni's Qwen-Image transformer (no
            ``transformer_blocks``).
    """
    check_version()
    why = refusal(od_config)
    if why:
        raise UnsupportedConfigError(why)
    inner = getattr(transformer, "transformer", None)
    if not hasattr(transformer, "transformer_blocks") and isinstance(inner, torch.nn.Module):
        transformer = inner  # VllmOmniQwenImage: the model it wraps
    if not isinstance(transformer, torch.nn.Module) or not hasattr(transformer, "transformer_blocks"):
        raise UnsupportedConfigError(f"strict binding takes vllm-omni's Qwen-Image transformer (or the "
                                     f"VllmOmniQwenImage around it), not {type(transformer).__name__}")
    problem = compiled_problem(transformer)
    if problem is not None:
        raise UnsupportedConfigError(f"strict binding refuses a compiled transformer: {problem}; "
                                     "build and run it with enforce_eager=True")
    return transformer


def bind_strict_gemms(transformer: torch.nn.Module, od_config: Any) -> Binding:
    """Bind drifttool's strict GEMM operators to the vLLM linears of vllm-omni's Qwen-Image
    ``transformer`` (or the ``VllmOmniQwenImage`` around it) built under ``od_config`` (module
    docstring; use as a context manager or call ``restore()``).

    Raises:
        DriftToolError, UnsupportedConfigError: as ``bindable``.
        UnsupportedConfigError: no linear to bind; a linear already bound; a bindable linear
            whose method is not vLLM's unquantized one (a quantized checkpoint: no strict
            operator), that has no ``weight`` (vLLM's CPU platform packs and removes it) or whose
            QKV has grouped K/V heads.
        DriftToolError: vllm is not installed.
    """
    transformer = bindable(transformer, od_config)
    method = _method_class()
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    plan: list[tuple[str, torch.nn.Module, StrictGemm]] = []
    binding = Binding()
    for path, layer in transformer.named_modules():
        qm = getattr(layer, "quant_method", None)
        if qm is None:
            continue
        if isinstance(qm, method):
            raise UnsupportedConfigError(f"strict binding: {path} is already bound")
        op, reason = _op_for(path)
        if op is None:
            binding.unbound[path] = reason
            continue
        if type(qm) is not UnquantizedLinearMethod:
            raise UnsupportedConfigError(f"strict binding refuses {path}: its linear method is "
                                         f"{type(qm).__name__} (quantized), not vLLM's unquantized "
                                         "GEMM")
        if not isinstance(getattr(layer, "weight", None), torch.Tensor):
            raise UnsupportedConfigError(f"strict binding refuses {path}: the layer holds no weight "
                                         "tensor (packed by vLLM's CPU platform)")
        if op == "qkv_bias_gemm":
            heads, kv_heads = layer.num_heads, layer.num_kv_heads
            if heads != kv_heads:
                raise UnsupportedConfigError(f"strict binding refuses {path}: grouped K/V heads "
                                             f"({heads} query, {kv_heads} key/value)")
            gemm = StrictGemm(op, tuple(layer.output_partition_sizes), heads)
        else:
            gemm = StrictGemm(op)
        plan.append((path, layer, gemm))
    if not plan:
        raise UnsupportedConfigError(f"strict binding found no vLLM linear to bind in "
                                     f"{type(transformer).__name__}")
    for path, layer, gemm in plan:  # nothing is replaced until every linear is accepted
        layer.quant_method = method(gemm, layer.quant_method)
        binding.bound[path] = gemm.op
        binding._layers[path] = layer
    return binding
