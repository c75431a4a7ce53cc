"""Forward hooks built from a table of taps: which module of another runtime's model computes which
RFC operator output, recorded under drifttool's identity.

    TAPS = (
        Tap("time_text_embed", "timestep_embed_mlp", "none", "B.", block=BEFORE),
        Tap("transformer_blocks.*.img_mod", "adaln_mod_projection", "img", "B."),
        Tap("transformer_blocks.*.img_norm2", "adaln_gate_residual", "img", read="input"),
        Tap(("transformer_blocks.*.attn.to_q", "transformer_blocks.*.attn.to_k",
             "transformer_blocks.*.attn.to_v"), "qkv_bias_gemm", "img", "BS..", heads=True),
        Tap("transformer_blocks.*", "adaln_gate_residual", "txt", item=0),
    )
    with tap_modules(model, TAPS, rt, actual="diffusers", depth=60, head_dim=128):
        model(...)   # every tapped module records its output (or input) as its RFC operator

A tap names modules by their path in ``model.named_modules()``; ``*`` matches one path segment,
and the first ``*`` that matches a number is the block index. Each tap becomes one forward hook
(``read="output"``) or forward pre-hook (``read="input"``) per matched module, registered in table
order (so taps on one module record in table order) and removed when the block exits. A hook
records through ``record``, which is ``drifttool.ops.sink.record_external``: the same trace
entry and digest records as an operator call through drifttool's own registry, with the parallel
plan deciding which rank records what. Hooks only read tensors; they never change an argument or
an output.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from drifttool.ops.sink import record_external
from drifttool.errors import DriftToolError
from drifttool.ops.registry import spec as op_spec
from drifttool.runtime import Runtime

BEFORE = -1
"""``Tap.block`` of a module that runs before the blocks."""
AFTER = "after"
"""``Tap.block`` of a module that runs after the blocks (block ``depth``)."""


@dataclass(frozen=True)
class Tap:
    """One capture point of a model: ``module`` computes ``op`` on ``stream``.

    Attributes:
        module: a module path pattern (``"transformer_blocks.*.attn.norm_q"``), or a tuple of
            patterns whose modules compute the outputs of one call together (Q, K and V
            projections: one record with one output per module, written when the last one ran).
        op: the RFC operator name (``drifttool.ops.registry.spec``). stream: ``img``, ``txt``,
            ``joint`` or ``none``. layout: axis tags of each recorded tensor
            (``drifttool.capture.layout``).
        read: ``"output"`` (forward hook) or ``"input"`` (forward pre-hook).
        item: which tensor: of the output, ``None`` (the output itself) or a tuple index; of the
            input, ``None`` (the first positional argument), a position, or a parameter name
            (passed by keyword or by position).
        block: ``None`` (the block index the pattern's ``*`` matched), ``BEFORE`` or ``AFTER``.
        heads: split the last axis into ``[heads, head_dim]`` (``tap_modules(head_dim=...)``).
        note: what the trace's kernel adds after the module path; ``None``: nothing for an
            output, ``" (input)"`` for an input.
    """

    module: str | tuple[str, ...]
    op: str
    stream: str
    layout: str = "BS."
    read: str = "output"
    item: int | str | None = None
    block: int | str | None = None
    heads: bool = False
    note: str | None = None

    @property
    def patterns(self) -> tuple[str, ...]:
        return self.module if isinstance(self.module, tuple) else (self.module,)

    @property
    def suffix(self) -> str:
        if self.note is not None:
            return self.note
        return "" if self.read == "output" else " (input)"


def record(rt: Runtime, op: str, stream: str, out: Any, layout: str | tuple[str, ...], *,
           actual: str, kernel: str, reason: str = "", declared: bool = False,
           **fields: Any) -> None:
    """``ops.sink.record_external`` with ``op``'s declared arithmetic contract: how every
    adapter records a tensor its runtime computed (``fields``: identity fields of this call
    alone, e.g. ``block``; ``reason``/``declared``: a path the runtime chose, for the trace).

    Raises:
        UnsupportedConfigError: ``op`` is not a declared operator.
    """
    record_external(rt, op, stream, out, layout, contract=op_spec(op).contract, actual=actual,
                    kernel=kernel, reason=reason, declared=declared, **fields)


@functools.lru_cache(maxsize=None)
def _regex(pattern: str) -> re.Pattern[str]:
    """The regular expression of a path pattern: ``*`` = one segment, captured."""
    parts = ["([^.]+)" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(r"\.".join(parts))


def _block(tap: Tap, groups: tuple[str, ...], depth: int) -> int:
    if tap.block == AFTER:
        return depth
    if tap.block is not None:
        return int(tap.block)
    for g in groups:
        if g.isdigit():
            return int(g)
    raise DriftToolError(f"tap {tap.module!r}: no block index in its path; give block=BEFORE "
                         "or block=AFTER")


def _input_reader(module: torch.nn.Module, item: int | str | None):
    """``(args, kwargs) -> tensor`` of a pre-hook: the ``item`` of a module's inputs."""
    if item is None or isinstance(item, int):
        pos = item or 0
        return lambda args, kwargs: args[pos]
    pos = _position(type(module), item)
    return lambda args, kwargs: kwargs[item] if item in kwargs else args[pos]


@functools.lru_cache(maxsize=None)
def _position(cls: type, name: str) -> int:
    """The position of ``cls.forward``'s parameter ``name`` among its arguments after ``self``."""
    return list(inspect.signature(cls.forward).parameters).index(name) - 1


def _index(names: Iterable[str]) -> dict[tuple[int, str], list[str]]:
    """Module paths by (number of segments, last segment), and by (number, "*")."""
    index: dict[tuple[int, str], list[str]] = {}
    for name in names:
        parts = name.split(".")
        index.setdefault((len(parts), parts[-1]), []).append(name)
        index.setdefault((len(parts), "*"), []).append(name)
    return index


def _matches(index: dict[tuple[int, str], list[str]], tap: Tap
             ) -> list[tuple[tuple[str, ...], list[str]]]:
    """``(wildcard values, module paths)`` per call site of ``tap`` among the module paths of
    ``index`` (``_index``): one path per pattern."""
    first, rest = _regex(tap.patterns[0]), tap.patterns[1:]
    parts = tap.patterns[0].split(".")
    sites = []
    for name in index.get((len(parts), parts[-1]), ()):
        m = first.fullmatch(name)
        if m is None:
            continue
        groups = m.groups()
        paths = [name]
        for pattern in rest:
            it = iter(groups)
            paths.append(".".join(next(it) if p == "*" else p for p in pattern.split(".")))
        sites.append((groups, paths))
    if not sites:
        raise DriftToolError(f"tap {tap.module!r} ({tap.op}) matches no module")
    return sites


@contextlib.contextmanager
def tap_modules(model: torch.nn.Module, taps: tuple[Tap, ...], rt: Runtime, *, actual: str,
                depth: int, head_dim: int | None = None,
                kernel_of: Callable[[str, torch.nn.Module], str] | None = None,
                require_all: bool = False,
                accounted: Callable[[], set[str]] | None = None) -> Iterator[None]:
    """Hook every module ``taps`` name for the block; each forward inside records into ``rt``.

    Args:
        model: the model whose modules the patterns name.
        taps: the table. rt: the runtime (scope, trace, recorder, parallel plan).
        actual: the backend written to the trace (e.g. ``"diffusers"``); each kernel is
            ``"<actual>:<module path><Tap.suffix>"``, or ``kernel_of(path, module)`` (a
            read-back of what the module dispatches to) plus the suffix when given.
        depth: the number of blocks (``AFTER``'s block). head_dim: for ``Tap.heads``.
        require_all: on a normal exit after any tap fired, every hooked call site must have
            fired at least once, except the module paths ``accounted()`` names (a path the
            runtime declared it took instead, e.g. a fused kernel that bypasses the module).

    Raises:
        DriftToolError: a tap matches no module (or a tuple pattern names a missing one), or
            has no block index; with ``require_all``, a call site that never fired.
        UnsupportedConfigError: a tap names an undeclared operator.
    """
    modules = dict(model.named_modules())
    index = _index(modules)
    handles: list[Any] = []
    hooks: list[_Hook] = []
    try:
        for tap in taps:
            op_spec(tap.op)
            for groups, paths in _matches(index, tap):
                missing = [p for p in paths if p not in modules]
                if missing:
                    raise DriftToolError(f"tap {tap.module!r}: no module {missing[0]!r}")
                kernel = None if kernel_of is None else \
                    kernel_of(paths[-1], modules[paths[-1]]) + tap.suffix
                got = _install(tap, [modules[p] for p in paths], paths, rt, actual=actual,
                               block=_block(tap, groups, depth), head_dim=head_dim,
                               kernel=kernel)
                handles += [h for h, _ in got]
                hooks += [k for _, k in got]
        yield
        if require_all and any(h.fired for h in hooks):
            skip = accounted() if accounted is not None else set()
            silent = [h for h in hooks if not h.fired and h.path not in skip]
            if silent:
                h = silent[0]
                raise DriftToolError(
                    f"{actual} capture: {h.path} ({h.tap.op}, {h.tap.stream}) never ran in a "
                    f"forward ({len(silent)} capture points silent): the runtime's model no "
                    "longer computes this operator where the adapter's table says")
    finally:
        for h in handles:
            h.remove()


class _Hook:
    """The forward hook (or pre-hook) of one call site of a tap: one object per hook."""

    __slots__ = ("tap", "rt", "actual", "kernel", "block", "head_dim", "read", "pending", "last",
                 "path", "fired")

    def __init__(self, tap: Tap, rt: Runtime, *, actual: str, kernel: str, block: int,
                 head_dim: int | None, path: str, read: Any = None, pending: list | None = None,
                 last: bool = True) -> None:
        self.tap, self.rt, self.actual, self.kernel = tap, rt, actual, kernel
        self.block, self.head_dim, self.read = block, head_dim, read
        self.pending, self.last = pending, last  # a tuple tap's outputs so far, shared
        self.path, self.fired = path, False

    def emit(self, tensors: list[torch.Tensor]) -> None:
        tap = self.tap
        if tap.heads:
            tensors = [t.unflatten(-1, (-1, self.head_dim)) for t in tensors]  # [B, S, H, Dh]
        out = tensors[0] if len(tensors) == 1 else tuple(tensors)
        layout = tap.layout if len(tensors) == 1 else (tap.layout,) * len(tensors)
        record(self.rt, tap.op, tap.stream, out, layout, actual=self.actual, kernel=self.kernel,
               block=self.block)

    def __call__(self, module: torch.nn.Module, args: tuple, *rest: Any) -> None:
        self.fired = True
        if self.read is not None:  # pre-hook: rest = (kwargs,)
            self.emit([self.read(args, rest[0])])
            return
        out = rest[0] if self.tap.item is None else rest[0][self.tap.item]
        if self.pending is None:
            self.emit([out])
            return
        self.pending.append(out)
        if self.last:
            got = list(self.pending)
            self.pending.clear()
            self.emit(got)


def _install(tap: Tap, mods: list[torch.nn.Module], paths: list[str], rt: Runtime, *, actual: str,
             block: int, head_dim: int | None, kernel: str | None = None
             ) -> list[tuple[Any, _Hook]]:
    """The hooks of one call site of ``tap``, each with its handle."""
    if tap.heads and head_dim is None:
        raise DriftToolError(f"tap {tap.module!r} splits heads: tap_modules needs head_dim")
    common = dict(actual=actual, kernel=kernel or f"{actual}:{paths[-1]}{tap.suffix}",
                  block=block, head_dim=head_dim)
    if tap.read == "input":
        if len(mods) != 1:
            raise DriftToolError(f"tap {tap.module!r}: an input tap names one module")
        hook = _Hook(tap, rt, read=_input_reader(mods[0], tap.item), path=paths[0], **common)
        return [(mods[0].register_forward_pre_hook(hook, with_kwargs=True), hook)]
    if len(mods) == 1:
        hook = _Hook(tap, rt, path=paths[0], **common)
        return [(mods[0].register_forward_hook(hook), hook)]
    pending: list[torch.Tensor] = []
    hooks = [_Hook(tap, rt, pending=pending, last=i == len(mods) - 1, path=p, **common)
             for i, p in enumerate(paths)]
    return [(m.register_forward_hook(h), h) for m, h in zip(mods, hooks)]
