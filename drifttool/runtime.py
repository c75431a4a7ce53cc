"""Runtime modes and the per-run context every named operator call receives.

The RFC's ``qwenimage_runtime_modes``:

========  ================  =========================================  =========
mode      family requested  fallback                                   capture
========  ================  =========================================  =========
strict    strict            none: an unsupported call raises           yes
                            UnsupportedConfigError
audit     strict            production, recorded in the trace          yes
auto      production        none (production is what was asked)        yes
off       production        none                                       no
========  ================  =========================================  =========

The mode requests a backend *family*; the device comes from each call's tensors, and the
registry picks the family's implementation for that device whose declared constraints pass
(``drifttool.ops.registry``).

A ``Runtime`` is passed explicitly (never read from module globals or the environment); the CLI
resolves ``--mode`` / ``DRIFTTOOL_MODE`` once and records the result in the manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from drifttool.artifact.levels import captures_internals
from drifttool.artifact.manifest_schema import STRICT_MODES
from drifttool.capture.trace import OperatorTrace
from drifttool.errors import UnsupportedConfigError

if TYPE_CHECKING:  # pragma: no cover
    from drifttool.capture.recorder import Recorder


class Mode(str, enum.Enum):
    STRICT = "strict"
    AUDIT = "audit"
    AUTO = "auto"
    OFF = "off"

    @property
    def family(self) -> str:
        """The backend family this mode requests: ``strict`` or ``production``."""
        return "strict" if self.value in STRICT_MODES else "production"

    @property
    def fallback(self) -> str | None:
        """The family dispatch falls back to when the requested one cannot run a call
        (recorded in the trace as a declared fallback), or ``None``: fail closed."""
        return "production" if self is Mode.AUDIT else None

    @property
    def captures(self) -> bool:
        return self is not Mode.OFF


def check_strict_environment() -> None:
    """Fail closed on process-wide settings that break strict arithmetic.

    Raises:
        UnsupportedConfigError: TF32 is enabled for matmul, or the float32 matmul
            precision is not ``"highest"`` (RFC numerical requirements: "No TF32").
    """
    bad = []
    if torch.backends.cuda.matmul.allow_tf32:
        bad.append("torch.backends.cuda.matmul.allow_tf32=True")
    # torch.backends.cudnn.allow_tf32 (True by default) affects convolutions only; the MMDiT
    # has none, so it is not checked.
    if torch.get_float32_matmul_precision() != "highest":
        bad.append(f"torch.get_float32_matmul_precision()={torch.get_float32_matmul_precision()!r}")
    if bad:
        raise UnsupportedConfigError("strict mode does not support TF32: " + ", ".join(bad))


@dataclass(kw_only=True)
class Runtime:
    """Everything an operator call needs besides its tensors.

    Attributes:
        mode: the runtime mode (decides the family requested, fallback policy and capture).
        family: the backend family requested; ``None`` (the default) = the mode's
            (``Mode.family``). Names another registered family (e.g. a new strict backend under
            test) without a new mode; the mode's fallback policy and capture still apply.
        recorder: capture sink (``None`` = no capture), see ``drifttool.capture.recorder``.
            The identity scope (phase, step, sigma, branch, block, samples) lives here, in
            ``scope``/``site``; the recorder only digests and writes.
        trace: the operator trace (``qwenimage_operator_trace``); one entry per call site.
        unavailable: families planted as unavailable, ``{(op_name, family)}``; used by tests and
            probes to exercise the fail-closed and audit-fallback paths.
        variants: ``{op_name: (variant_name, fn)}`` — a probe's one change: ``fn`` replaces the
            operator's implementation for this run (same signature); the trace records
            ``actual="variant:<variant_name>"``. Not a fallback: it is what the run asked for.
            A variant that needs the identity scope (step, block, branch, samples) defines
            ``bind_runtime(rt)``; it is called once here and may then read ``rt.current_scope()``.
        rank: this process's rank (torch.distributed; 0 for one process): the owning rank of
            every record and trace row it produces (an attribute, never part of an identity).
        plan: the parallel plan (``drifttool.distributed.plan.ParallelPlan``): TP/SP/CFG-parallel
            applied to every operator call from outside the model; ``None`` = one device.
        internals: ``None`` (default): fused operators expose their internal tensors when the
            capture level asks for them (``wants_internals``). ``True``/``False``
            pins that decision — a silent re-run of a forward (the backward's recomputation
            under activation checkpointing) must dispatch exactly as the forward did; a run at
            L2 without the internals (the run setting ``internals``) pins it off.
        grad_ledger: ``drifttool.training.ledger.GradLedger`` collecting the adapted weights'
            per-sample gradient partials for the canonical LoRA gradient (strict training);
            ``None`` = autograd accumulates as usual.
        lanes: ``drifttool.model.lanes.Lanes``: each block runs its text stream's operators on a
            second CUDA stream, overlapped with the image stream's (the same kernels and bytes);
            ``None`` (default): one stream. ``GraphedForward`` sets it for the forwards it
            captures.
    """

    mode: Mode = Mode.STRICT
    family: str | None = None
    recorder: "Recorder | None" = None
    trace: "OperatorTrace | None" = None
    unavailable: set[tuple[str, str]] = field(default_factory=set)
    variants: dict[str, tuple[str, Any]] = field(default_factory=dict)
    rank: int = 0
    plan: Any = None
    internals: bool | None = None
    grad_ledger: Any = None
    lanes: Any = None
    _scope: dict[str, Any] = field(default_factory=dict, repr=False)
    _calls: dict[tuple, int] = field(default_factory=dict, repr=False)
    """Call counters of ``site``: ``(component, phase, step, branch, block, op, stream)`` -> the
    next ``call``, and ``(component, phase, step, branch, block)`` -> the next ``op_pos`` (one
    dict, so code that saves and restores the counters, e.g. ``sampling.train.micro_batched``,
    keeps both). The component is part of both keys: the text encoder's, the transformer's and the
    VAE's calls of one operator name in one step and block never share a counter."""

    def __post_init__(self) -> None:
        self.mode = Mode(self.mode)
        if self.family is None:
            self.family = self.mode.family
        if self.trace is None:
            self.trace = OperatorTrace()
        if self.mode.family == "strict":
            check_strict_environment()
        self._scope = {**DEFAULT_SCOPE, "rank": int(self.rank), **self._scope}
        for _, fn in self.variants.values():
            bind = getattr(fn, "bind_runtime", None)
            if callable(bind):
                bind(self)

    def current_scope(self) -> dict[str, Any]:
        """A copy of the identity fields now in force (see ``scope``); read-only for callers."""
        return dict(self._scope)

    def scope_value(self, name: str) -> Any:
        """One identity field now in force (``scope``), without copying the scope."""
        return self._scope[name]

    @contextlib.contextmanager
    def scope(self, **fields: Any) -> Iterator[None]:
        """Set identity fields for the calls inside the block, restoring them afterwards.

        Fields (design.md, "Identity of a captured tensor"): ``phase`` (rollout | train),
        ``step`` (int), ``sigma`` (float), ``branch`` (cond | uncond | cfg | none), ``block``
        (-1 before the blocks, 0..depth-1, depth after, ``schema.SAMPLER_BLOCK`` the sampler),
        ``samples`` (logical sample id of each batch row), ``txt_lens`` (valid prompt length of
        each batch row, or None), ``txt_starts`` (first valid text row of each batch row, or None
        = 0: prompts padded on the left), ``img_grid`` ((h, w) patch grid), ``cond_grids``
        (the (h, w) grid of each condition image whose rows follow the image rows, or None:
        ``drifttool.model.conditions``), ``rank`` (int: the
        owning rank of the records, not part of their identity), ``component`` (the model the
        calls belong to, ``schema.COMPONENTS``; ``"mmdit"``).
        """
        unknown = set(fields) - set(DEFAULT_SCOPE)
        if unknown:
            raise ValueError(f"unknown scope fields {sorted(unknown)}")
        saved = self._scope
        self._scope = {**saved, **fields}
        try:
            yield
        finally:
            self._scope = saved

    @contextlib.contextmanager
    def parts(self) -> Iterator[Callable[..., contextlib.AbstractContextManager[None]]]:
        """Run one logical call as several parts (the micro-batches of a trainer): yields
        ``part(**fields)``, a context manager that narrows the identity fields (``scope``) to the
        part and restarts the call counters from where the whole call started, so each part's
        records get the identities (``call``, ``op_pos``) the unsplit call gives them. After the
        block the counters stand where the unsplit call would leave them (parts that make different
        numbers of calls, the images of edit prompts: where the longest part left each counter).

            with rt.parts() as part:
                for rows in chunks:
                    with part(samples=[...], txt_lens=[...]):
                        forward(x[rows], ..., rt)
        """
        before = dict(self._calls)
        after: dict[tuple, int] = {}

        @contextlib.contextmanager
        def part(**fields: Any) -> Iterator[None]:
            self._calls = dict(before)
            with self.scope(**fields):
                yield
            after.update({k: max(n, after.get(k, 0)) for k, n in self._calls.items()})

        try:
            yield part
        finally:
            self._calls = {**before, **after}

    def wants_internals(self) -> bool:
        """Whether fused operators expose their internal tensors for capture: ``internals`` when
        pinned, else whether the recorder captures at ``INTERNALS_FROM`` (L2) or finer
        (design.md, "Digests": S×S tensors are not materialised for capture at L1)."""
        if self.internals is not None:
            return self.internals
        return (self.recorder is not None and self.mode.captures
                and captures_internals(getattr(self.recorder, "level", None)))

    def recomputation(self) -> "Runtime":
        """A runtime for re-running a forward that already ran under this one (the backward's
        recomputation under activation checkpointing): the current identity scope, no recorder,
        its own trace and fresh call counters — so it adds no records, trace calls or counter
        increments — and the same dispatch decisions (``internals`` pinned to what this runtime
        decides now, so a fused operator expanded for capture is expanded again)."""
        return dataclasses.replace(self, recorder=None, trace=OperatorTrace(),
                                   internals=self.wants_internals(), _scope=dict(self._scope),
                                   _calls={})

    def site(self, op: str, stream: str, **fields: Any) -> dict[str, Any]:
        """Identity of the next call of ``op`` on ``stream`` in the current scope (with
        ``fields`` overriding scope fields for this call alone, as a ``scope`` block around it
        would: hook-based adapters use it, at no context-manager cost per call).

        Returns the scope fields plus ``op``, ``stream``, ``call`` (0-based occurrence of this
        (op, stream) within the same component, phase, step, branch and block) and ``op_pos``
        (0-based ordinal of this call among every operator call of that component, phase, step,
        branch and block: the rank-independent program position that orders records,
        ``schema.OP_ORDER``). Under
        batched CFG the scope's branch is one tuple for both branches, so ``op_pos`` counts the
        same calls as each branch's scope under sequential CFG.
        """
        s = {**self._scope, **fields} if fields else self._scope
        branch = s["branch"] if isinstance(s["branch"], str) else tuple(s["branch"])
        scope = (s["component"], s["phase"], s["step"], branch, s["block"])
        key = (*scope, op, stream)
        n = self._calls.get(key, 0)
        self._calls[key] = n + 1
        pos = self._calls.get(scope, 0)
        self._calls[scope] = pos + 1
        return {**s, "op": op, "stream": stream, "call": n, "op_pos": pos}

    def advance_counters(self, keys: list[tuple], counts: list[int]) -> list[int]:
        """Advance the call counters of ``site`` in the current scope as a known sequence of calls
        would (a replayed forward's, ``drifttool.model.replay``), without one ``site`` per call.

        Args:
            keys: counter suffixes: ``(block, op, stream)`` counts ``call``, ``(block,)`` counts
                ``op_pos`` (``site``'s two counters, under the scope's component, phase, step and
                branch).
            counts: how many calls advance each key.

        Returns:
            each key's value before the advance: the first call's ``call`` (or ``op_pos``).
        """
        s = self._scope
        branch = s["branch"] if isinstance(s["branch"], str) else tuple(s["branch"])
        scope = (s["component"], s["phase"], s["step"], branch)
        full = [(*scope, *k) for k in keys]
        calls = self._calls
        bases = [calls.get(k, 0) for k in full]
        calls.update(zip(full, [b + n for b, n in zip(bases, counts)]))
        return bases


DEFAULT_SCOPE: dict[str, Any] = {
    "phase": "rollout",
    "step": -1,
    "sigma": math.nan,
    "branch": "none",
    "block": -1,
    "samples": None,
    "txt_lens": None,
    "txt_starts": None,
    "img_grid": None,
    "cond_grids": None,
    "rank": 0,
    "component": "mmdit",
}
