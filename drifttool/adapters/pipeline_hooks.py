"""Taps on an unmodified diffusers pipeline, each installed in a ``with`` block and removed on exit:
a diffusers ``ModelHook`` around the transformer's forward, a wrapper of the scheduler instance's
``step``, and ``method_tap``, a wrapper of any one instance's method (the pipeline's
``_get_qwen_prompt_embeds``, ``_unpack_latents``, ..., the VAE's ``decode``).

    with transformer_tap(pipe.transformer, on_forward), scheduler_tap(pipe.scheduler, on_step):
        pipe(prompt_embeds=..., output_type="latent")
    # on_forward(context, arguments, run) per transformer call: context = the name of the
    #   pipeline's transformer.cache_context(name) block ("cond"/"uncond") or None; arguments =
    #   the forward's bound arguments; run() calls the forward and returns its output
    # on_step(call, output) per scheduler step: call = step's bound arguments, output = its return
    with method_tap(pipe, "_unpack_latents", around):   # around(original, *args, **kwargs)
        ...

The transformer tap is a stateful ``diffusers.hooks.ModelHook`` registered in the transformer's
``HookRegistry`` (diffusers' own extension point for model hooks): diffusers hands every
stateful hook's ``StateManager`` the ``CacheContext`` that ``transformer.cache_context(name)``
sets, which is how the tap learns the CFG branch of a call without reading the pipeline's
frame. No tap changes an argument or an output.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, StateManager

HOOK_NAME = "drifttool_pipeline_capture"
"""The transformer tap's name in the ``HookRegistry``."""

OnForward = Callable[[str | None, dict[str, Any], Callable[[], Any]], Any]
OnStep = Callable[[dict[str, Any], Any], None]


class _NoState(BaseState):
    """The tap keeps no per-context state; its ``StateManager`` only receives the context."""

    def reset(self, *args: Any, **kwargs: Any) -> None:
        pass


class _ForwardTap(ModelHook):
    """``new_forward`` hands each call to ``on_forward`` with the cache context name."""

    _is_stateful = True  # so that cache_context(name) reaches our StateManager

    def __init__(self, on_forward: OnForward, signature: inspect.Signature) -> None:
        super().__init__()
        self.on_forward = on_forward
        self.signature = signature
        self.state_manager = StateManager(_NoState)

    def context_name(self) -> str | None:
        ctx = self.state_manager._context  # CacheContext (diffusers >= 0.42) or its name
        return None if ctx is None else getattr(ctx, "name", ctx)

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        return self.on_forward(self.context_name(), dict(bound.arguments),
                               lambda: self.fn_ref.original_forward(*args, **kwargs))

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.state_manager.reset()
        return module


@contextlib.contextmanager
def transformer_tap(transformer: torch.nn.Module, on_forward: OnForward) -> Iterator[None]:
    """Route every forward of ``transformer`` through ``on_forward`` (module docstring) for the
    block; afterwards the registry, the hooks and ``transformer.forward`` are as before."""
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    had_forward = "forward" in vars(transformer)
    tap = _ForwardTap(on_forward, inspect.signature(transformer.forward))
    registry.register_hook(tap, HOOK_NAME)
    try:
        yield
    finally:
        registry.remove_hook(HOOK_NAME, recurse=False)
        if not had_forward:  # remove_hook leaves the original bound method as an attribute
            vars(transformer).pop("forward", None)


@contextlib.contextmanager
def scheduler_tap(scheduler: Any, on_step: OnStep) -> Iterator[None]:
    """Wrap ``scheduler.step`` (the instance's, not the class's) so every call is reported to
    ``on_step(bound arguments, output)`` after it ran; restored on exit."""
    original = scheduler.step
    signature = inspect.signature(original)
    had_step = "step" in vars(scheduler)

    def step(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        on_step(dict(signature.bind(*args, **kwargs).arguments), out)
        return out

    scheduler.step = step
    try:
        yield
    finally:
        if had_step:
            scheduler.step = original
        else:
            del scheduler.step


@contextlib.contextmanager
def method_tap(obj: Any, name: str, around: Callable[..., Any]) -> Iterator[None]:
    """Route every call of ``obj.<name>`` (the instance's attribute, not the class's) through
    ``around(original, *args, **kwargs)``, which must call ``original`` with the arguments it got
    and return its result unchanged; the attribute is restored on exit (removed again when the
    instance had none of its own).

    Raises:
        AttributeError: ``obj`` has no ``name``.
    """
    original = getattr(obj, name)
    had = name in vars(obj)

    def tapped(*args: Any, **kwargs: Any) -> Any:
        return around(original, *args, **kwargs)

    setattr(obj, name, tapped)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, original)
        else:
            vars(obj).pop(name, None)
