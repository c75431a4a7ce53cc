"""The attention of a diffusers ``QwenImageTransformer2DModel``, captured through a registered
diffusers attention backend.

    attns = [blk.attn for blk in transformer.transformer_blocks]
    with capture_backend(attns, on_attention) as begin:
        transformer(...)
    # an attention module's forward pre-hook calls begin(module): the module's next dispatch
    # then runs on_attention(backend, args, run), backend = the one its processor would run

diffusers dispatches every attention call through ``attention_dispatch.dispatch_attention_fn``,
which runs the backend of the processor (``set_attention_backend``) or else the registry's active
backend (``attention_backend(...)``, ``DIFFUSERS_ATTN_BACKEND``). For the block, a capture backend
is registered in diffusers' ``_AttentionBackendRegistry`` and made the active one, and processors
that name a backend are set to none (so they dispatch to the active one); the capture backend then
dispatches each call to the backend it would have run, with the same arguments, through
``dispatch_attention_fn`` again (so diffusers' own argument filtering and checks apply), and hands
the call to ``on_attention``. On exit the registry, its active backend and every processor are as
before. A dispatch from a module the capture did not begin (another model's attention) runs its
backend unrecorded. ``attention_kwargs`` beyond SDPA's arguments are not forwarded (QwenImage's
processor passes none).

``attention_kernel`` reads back the kernel identity of a call: diffusers' backend name, and for the
``native`` backend the SDPA kernel torch selects for these exact arguments.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from diffusers.models.attention_dispatch import (
    AttentionBackendName, _AttentionBackendRegistry, dispatch_attention_fn)

from drifttool.errors import DriftToolError

OnAttention = Callable[[AttentionBackendName, dict[str, Any], Callable[[], torch.Tensor]],
                       torch.Tensor]
"""``on_attention(backend, args, run)``: args = query, key, value ``[B, S, H, Dh]``, attn_mask,
dropout_p, is_causal, scale, enable_gqa; ``run()`` dispatches to ``backend`` and returns its
``[B, S, H, Dh]`` output, which ``on_attention`` returns."""


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


def attention_kernel(backend: AttentionBackendName, args: dict[str, Any]) -> str:
    """Kernel identity of one attention call (``OnAttention`` arguments): diffusers backend, and
    for the native backend the SDPA kernel (``sdpa_kernel``)."""
    name = AttentionBackendName(backend).value
    if name != AttentionBackendName.NATIVE.value:
        return f"diffusers.attention:{name}"
    q, k, v = (args[n].permute(0, 2, 1, 3) for n in ("query", "key", "value"))
    sdpa = sdpa_kernel(q, k, v, args["attn_mask"], args["dropout_p"], args["is_causal"],
                       args["scale"], args["enable_gqa"])
    return f"diffusers.attention:{name}/torch.sdpa:{sdpa}"


_UNSET = object()


@dataclass
class _Backend:
    """The capture backend's state: the active backend it replaced, the backends processors
    named (by processor id), and the backend of the next call to record."""

    on_attention: OnAttention
    replaced: AttentionBackendName
    named: dict[int, AttentionBackendName]
    next: AttentionBackendName | None = None

    def begin(self, module: torch.nn.Module) -> None:
        self.next = self.named.get(id(getattr(module, "processor", None)), self.replaced)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                 _parallel_config: Any = None) -> torch.Tensor:
        backend, self.next = self.next, None
        args = dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

        def run() -> torch.Tensor:
            return dispatch_attention_fn(**args, backend=backend or self.replaced,
                                         parallel_config=_parallel_config)

        return run() if backend is None else self.on_attention(backend, args, run)


def _processors(modules: list[torch.nn.Module]) -> list[Any]:
    """The processors of the attention ``modules`` that dispatch through diffusers' registry."""
    procs = (getattr(m, "processor", None) for m in modules)
    return list({id(p): p for p in procs if hasattr(p, "_attention_backend")}.values())


@contextlib.contextmanager
def capture_backend(modules: list[torch.nn.Module], on_attention: OnAttention
                    ) -> Iterator[Callable[[torch.nn.Module], None]]:
    """Route the attention of ``modules`` (diffusers attention modules) through a capture backend
    for the block (module docstring); yields ``begin(module)``, to call from each one's forward
    pre-hook: that module's next dispatch goes to ``on_attention``.

    Raises:
        DriftToolError: the active backend is not one of diffusers' own (another capture's).
    """
    registry = _AttentionBackendRegistry
    replaced = registry._active_backend
    try:
        replaced = AttentionBackendName(replaced)
    except ValueError:
        raise DriftToolError(f"the active diffusers attention backend {replaced!r} is not one of "
                             "diffusers' own: is another transformer being captured?") from None
    saved = [(p, vars(p).get("_attention_backend", _UNSET)) for p in _processors(modules)]
    named = {id(p): AttentionBackendName(p._attention_backend) for p, _ in saved
             if p._attention_backend is not None}
    backend = _Backend(on_attention, replaced, named)
    key = f"drifttool_capture_{id(backend):x}"  # a registry key, not an AttentionBackendName
    registry.register(key)(backend)
    registry.set_active_backend(key)
    try:
        for p, _ in saved:
            p._attention_backend = None
        yield backend.begin
    finally:
        for p, value in saved:
            if value is _UNSET:
                vars(p).pop("_attention_backend", None)
            else:
                p._attention_backend = value
        registry.set_active_backend(replaced)
        for table in (registry._backends, registry._constraints, registry._supported_arg_names):
            table.pop(key, None)
