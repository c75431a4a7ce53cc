"""The peer matrix's declarations: each peer probe's one change and its expectation per device
type (``drifttool.probes.peer`` runs them against diffusers' ``QwenImageTransformer2DModel``).

    >>> [p.name for p in peer_catalog()][:3]
    ['repeat', 'batch_order_reversed', 'grad_enabled']

The factors (one per probe; the study on an H200 found the CUDA verdicts):

=====================  =============================================  =========  ==============
probe                  change                                         CUDA       CPU
=====================  =============================================  =========  ==============
repeat                 the baseline again                             identical  identical
batch_order_reversed   samples [1, 0]                                 identical  identical
grad_enabled           forward under ``torch.enable_grad()``          identical  identical
timestep_bf16          bf16 timestep tensor, same bf16 values         identical  identical
pad_garbage            N(0, 100²) garbage in the masked prompt rows   identical  identical
pad_100 / pad_160      100 / 160 text slots instead of 128            drift      observed
sdpa_math              ``sdpa_kernel([MATH])``                        drift (1)  observed
sdpa_efficient         ``sdpa_kernel([EFFICIENT_ATTENTION])``         drift (1)  pending (2)
ulp_norm_q_gain        ``blocks.0.attn.norm_q`` gain[0] + 1 bf16 ULP  drift (3)  drift (3)
=====================  =============================================  =========  ==============

(1) first at ``joint_attention_fused``, block 0, step 0: nothing before the first attention calls
SDPA. (2) torch has no EFFICIENT_ATTENTION kernel on the CPU. (3) first at ``qk_rmsnorm``, img,
block 0, step 0 (``PLANT``).

CPU expectations that production arithmetic makes machine-dependent are declared ``observed``:
run and reported, never judged (``drifttool.probes.peer``'s docstring says why).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from drifttool.artifact.schema import block_words, names_one
from drifttool.probes.spec import Expectation
from drifttool.probes.spec import select as spec_select

PEER_STEPS = 2
PEER_SLOTS = 128
PAD_VARIANTS = (100, 160)
GARBAGE_SEED = 10_386
PLANT = ("transformer_blocks.0.attn.norm_q.weight", 0)
"""The planted weight of ``ulp_norm_q_gain``: element 0 of block 0's image-stream Q RMSNorm
gain. diffusers multiplies the normalized bf16 row by the bf16 gain in bf16, so a gain one ULP
larger moves the product by at least half an output ULP: rows flip at ``qk_rmsnorm`` (img,
block 0, call 0), whatever the width."""

KINDS = ("invariant", "drifting", "sensitivity")
VERDICTS = ("identical", "drift", "observed")


# -- declarations -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PeerExpect:
    """What the diff of a peer probe against the peer baseline must say on one device type.

    Attributes:
        verdict: ``identical`` (every record of both runs compared and equal), ``drift`` (some
            common record differs) or ``observed`` (reported, not judged: production arithmetic
            that is machine-dependent).
        op, step, block, stream: fields of the first drift, checked when set (``drift`` only).
        why: where the expectation comes from (the study, a measurement, a reason).
    """

    verdict: str
    op: str | None = None
    step: int | None = None
    block: int | None = None
    stream: str | None = None
    why: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} not in {VERDICTS}")
        if self.verdict != "drift" and any(
                getattr(self, k) is not None for k in ("op", "step", "block", "stream")):
            raise ValueError("only a drift expectation names where the first drift is")

    def describe(self) -> str:
        """One line, e.g. ``drift at qk_rmsnorm (img, step 0, block 0)`` or ``observed``: the
        strict matrix's order (``spec.Expectation.describe``)."""
        if self.verdict != "drift" or self.op is None:
            return self.verdict
        where = [f"step {self.step}"] if self.step is not None else []
        where += [block_words(self.block)] if self.block is not None else []
        if names_one(self.stream):
            where.insert(0, self.stream)
        return f"drift at {self.op}" + (f" ({', '.join(where)})" if where else "")

    def as_expectation(self) -> Expectation:
        """The strict matrix's ``Expectation`` (for ``runner.judge``); ``drift`` with an op."""
        return Expectation(verdict=self.verdict, op=self.op, step=self.step, block=self.block,
                           stream=self.stream, origin=True)


@dataclass(frozen=True, kw_only=True)
class PeerCall:
    """How the peer's forward is called: every field at its default is the baseline call.

    Attributes:
        sdpa: names of ``torch.nn.attention.SDPBackend`` members the forward may use
            (``sdpa_kernel([...])`` around it); ``None``: torch's default selection.
        grad: run the forward under ``torch.enable_grad()`` (default ``torch.no_grad()``).
        timestep_dtype: dtype of the timestep tensor handed to diffusers (the values are bf16
            values in either dtype under the ``pipeline_bf16`` policy).
        pad_garbage: overwrite the masked (padded) prompt rows with finite garbage,
            N(0, 100²) from ``GARBAGE_SEED``, in the model dtype.
    """

    sdpa: tuple[str, ...] | None = None
    grad: bool = False
    timestep_dtype: torch.dtype = torch.float32
    pad_garbage: bool = False

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        """Grad mode and SDPA backend selection for one forward."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad() if self.grad else torch.no_grad())
            if self.sdpa is not None:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                stack.enter_context(sdpa_kernel([getattr(SDPBackend, n) for n in self.sdpa]))
            yield


@dataclass(frozen=True, kw_only=True)
class PeerProbe:
    """One row of the peer matrix: one factor against the peer baseline.

    Attributes:
        name, factor, kind (``KINDS``), change: as in the strict matrix.
        expect: ``{device type: PeerExpect}`` (``"cuda"``, ``"cpu"``); a device type without an
            entry makes the probe ``PENDING`` there, with ``pending[device]`` as the reason.
        spec: ``RunSpec`` field overrides (``samples``, ``pad_prompts_to``).
        call: the forward's call (``PeerCall``).
        plant: ``(parameter name, flat index)``: that weight element is raised by one ULP for
            the probe run (restored afterwards).
    """

    name: str
    factor: str
    kind: str
    change: str
    expect: Mapping[str, PeerExpect]
    spec: Mapping[str, Any] = field(default_factory=dict)
    call: PeerCall = PeerCall()
    plant: tuple[str, int] | None = None
    pending: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"peer probe {self.name}: kind {self.kind!r} not in {KINDS}")
        for dev, e in self.expect.items():
            if self.kind == "invariant" and e.verdict == "drift":
                raise ValueError(f"peer probe {self.name}: an invariant cannot expect drift ({dev})")
            if self.kind == "sensitivity" and (e.verdict != "drift" or e.op is None):
                raise ValueError(f"peer probe {self.name}: a sensitivity probe names its operator")

    def expectation(self, device: str) -> PeerExpect | None:
        """The expectation on ``device`` (a device type or ``torch.device`` string)."""
        return self.expect.get(torch.device(device).type)


_STUDY = "H200 study (torch 2.11, diffusers 0.42.1, full width, 1024², 128 slots)"
_SIMD = ("CPU: observed only; the CPU SDPA/GEMM reduction order follows the SIMD width ATen "
         "dispatches to and the blocking follows the sequence length")


def _identical(why_cuda: str = _STUDY, why_cpu: str = "nothing changes the arithmetic's shapes"):
    return {"cuda": PeerExpect(verdict="identical", why=why_cuda),
            "cpu": PeerExpect(verdict="identical", why=why_cpu)}


def peer_catalog(slots: int = PEER_SLOTS, pads: tuple[int, ...] = PAD_VARIANTS,
                 samples: tuple[int, ...] = (0, 1)) -> list[PeerProbe]:
    """The declared peer probes for a baseline of ``slots`` text slots and ``samples``."""
    attn = dict(op="joint_attention_fused", block=0, step=0, stream="joint")
    out = [
        PeerProbe(name="repeat", factor="repetition", kind="invariant",
                  change="the baseline rollout again", expect=_identical()),
        PeerProbe(name="batch_order_reversed", factor="batch position", kind="invariant",
                  change=f"samples {list(samples[::-1])} instead of {list(samples)}",
                  spec={"samples": list(samples[::-1])}, expect=_identical()),
        PeerProbe(name="grad_enabled", factor="grad mode", kind="invariant",
                  change="forward under torch.enable_grad() instead of torch.no_grad()",
                  call=PeerCall(grad=True), expect=_identical()),
        PeerProbe(name="timestep_bf16", factor="timestep dtype", kind="invariant",
                  change="bf16 timestep tensor holding the same bf16 values as the fp32 one",
                  call=PeerCall(timestep_dtype=torch.bfloat16), expect=_identical()),
        PeerProbe(name="pad_garbage", factor="masked pad contents", kind="invariant",
                  change="N(0, 100²) garbage instead of zeros in the masked prompt rows",
                  call=PeerCall(pad_garbage=True),
                  expect=_identical(why_cpu="masked keys get weight exactly 0; rows are "
                                    "independent in every other operator")),
    ]
    for n in pads:
        out.append(PeerProbe(
            name=f"pad_{n}", factor="prompt padding length", kind="drifting",
            change=f"prompts right-padded (masked) to {n} text slots instead of {slots}",
            spec={"pad_prompts_to": n},
            expect={"cuda": PeerExpect(verdict="drift", why=_STUDY),
                    "cpu": PeerExpect(verdict="observed", why=_SIMD)}))
    out += [
        PeerProbe(name="sdpa_math", factor="SDPA backend", kind="drifting",
                  change="sdpa_kernel([MATH]) instead of torch's default selection",
                  call=PeerCall(sdpa=("MATH",)),
                  expect={"cuda": PeerExpect(verdict="drift", **attn, why=_STUDY),
                          "cpu": PeerExpect(verdict="observed", why=_SIMD)}),
        PeerProbe(name="sdpa_efficient", factor="SDPA backend", kind="drifting",
                  change="sdpa_kernel([EFFICIENT_ATTENTION]) instead of torch's default selection",
                  call=PeerCall(sdpa=("EFFICIENT_ATTENTION",)),
                  expect={"cuda": PeerExpect(verdict="drift", **attn, why=_STUDY)},
                  pending={"cpu": "torch has no EFFICIENT_ATTENTION SDPA kernel on the CPU"}),
        PeerProbe(name="ulp_norm_q_gain", factor="sensitivity (planted weight ULP)",
                  kind="sensitivity",
                  change=f"{PLANT[0]}[{PLANT[1]}] raised by one bf16 ULP",
                  plant=PLANT,
                  expect={d: PeerExpect(verdict="drift", op="qk_rmsnorm", stream="img", block=0,
                                        step=0, why="a planted change must be located")
                          for d in ("cuda", "cpu")}),
    ]
    names = [p.name for p in out]
    if len(set(names)) != len(names):  # pragma: no cover - a declaration bug
        raise ValueError(f"duplicate peer probe names in {names}")
    return out


# -- command-line helpers -----------------------------------------------------------------------
PEERS = ("diffusers",)
"""Implementations ``drifttool probe --peer`` runs against."""


def select(probes: list[PeerProbe], only: str | None) -> list[PeerProbe]:
    """The peer probes named in the comma-separated ``only`` (``spec.select``)."""
    return spec_select(probes, only, "peer probe")
