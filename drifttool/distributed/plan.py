"""The parallel plan: TP, SP and CFG-parallel applied to the single-device model from outside.

    $ torchrun --nproc-per-node 4 -m drifttool run --tp 2 --cfg-parallel 2 -o runs/tp2cfg2
    >>> ctx = init_distributed(mesh_dims=MESH_DIMS, mesh_shape=(dims.cfg, dims.sp, dims.tp))
    >>> plan = ParallelPlan.build(ctx, dims, model.config)
    >>> rt = Runtime(mode="strict", plan=plan, ...)        # the model code is unchanged

The model calls its named operators through ``drifttool.ops.registry.call``; a plan is data: one
**rule** per operator (``rules.RULES``: an ``OpRule`` per RFC operator), whose TP and SP compute
rules wrap the call (slice a weight to the rank's heads, compute a row-parallel partial and
finish the canonical tree over the gathered rank partials, gather the image rows of K/V, …) — as
torchtitan's ``parallelize`` and diffusers' ``_cp_plan`` describe a layout beside the model
instead of forking it. Dispatch (``registry._call``) passes every call through
``ParallelPlan.call``.

Capture records the logical tensors without moving them: where a rule shards an output (the
same ``OpRule``'s ``rows`` and ``heads`` axes say where this rank's block sits:
``ParallelPlan.for_capture``, ``placement``), every rank digests its own block and only the
digest partials are gathered and combined, SP then TP (``capture.shards``: a few words per record at L1, the row digests at L2). One **owning rank**
records: coordinate 0 of the TP and SP dimensions, and for the model's calls the CFG rank that
ran the branch (coordinate 0 for the sampler's calls, which every CFG rank repeats). An output
every rank computes alike (replicated) is digested on every rank as well, and the owning rank's
record carries each rank's digest and the ranks whose copy disagrees (``rank_digests``,
``rank_disagree``), so a fault in a rank that writes nothing is still found, and named. Rank is
an attribute of a record, never part of its identity, so the artifact diffs against a single
device record for record.

Collectives are canonical (``drifttool.distributed.canonical``): ``gather_cat`` concatenates every rank's part in rank order (no
arithmetic); a reduction is finished by the fixed tree over the gathered partials, never by a
plain all-reduce (design.md, "Scale: devices, ranks, runtimes"; RFC WS2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from drifttool import shards
from drifttool.artifact.levels import captures_internals
from drifttool.distributed import placement, sp, tp
from drifttool.distributed.rules import Rule, reduction_splits, rule, tp_row_for
from drifttool.errors import UnsupportedConfigError

if TYPE_CHECKING:  # pragma: no cover
    from drifttool.distributed.context import DistContext
    from drifttool.runtime import Runtime

MESH_DIMS = ("cfg", "sp", "tp")
"""The mesh's dimension names, outermost first: CFG branches, sequence shards, tensor shards
(TP innermost: its collectives are the most frequent and stay on the closest ranks)."""

SHARD_COUNTS = shards.SHARD_COUNTS  # TP/SP degrees whose shards are subtrees of contract v2's trees
SP_ATTENTIONS = ("agrs", "ulysses", "ring")
TP_ROWS = ("auto", "partials", "gather")
"""How a TP row-parallel GEMM (attention out, MLP down) splits its work (``ParallelDims.tp_row``):
``partials`` — each rank reduces its K shard and the partials are finished by contract v2's tree
(the CPU strict family); ``gather`` — the K shards of the input are gathered and each rank
computes its output features over the whole K (no reduction axis split across ranks: the strict
CUDA family, whose contract walks K once, in order); ``auto`` — ``gather`` on CUDA, ``partials``
on the CPU."""
SAMPLER_BLOCK = -2  # artifact.schema.SAMPLER_BLOCK (not imported: distributed/ imports no artifact code)

FAULTS = {
    "tp_allreduce": "row-parallel partials reduced by a plain all-reduce (the library's order) "
                    "instead of contract v2's tree over the gathered partials",
    "tp_bias_every_rank": "row-parallel GEMM bias added by every TP rank instead of once",
    "sp_rope_no_offset": "SP shards rotate their image rows with RoPE positions from 0 instead of "
                         "their global offset",
    "sp_padding_unmasked": "SP K/V shards zero-padded to equal length for the gather and the pads "
                           "left unmasked (agrs)",
    "noise_per_rank": "the SDE noise drawn per rank (seed + rank) instead of per logical sample",
    "cfg_branch_swap": "CFG-parallel ranks run each other's branch under their own branch label",
}
"""The distributed probes' one change each (``ParallelPlan.faults``): mismatches a parallel
layout can introduce, each declared to drift first at a named operator and owning rank
(``probes``)."""


@dataclass(frozen=True)
class ParallelDims:
    """The layout's degrees: ``tp`` (attention heads and MLP channels), ``sp`` (image rows and
    their RoPE positions; ``sp_attention`` says how attention sees every key), ``cfg`` (one CFG
    branch per rank). ``tp·sp·cfg`` is the world size.

    Raises:
        UnsupportedConfigError: a degree outside ``SHARD_COUNTS`` (TP, SP) or ``(1, 2)`` (CFG),
            or an unknown SP attention.
    """

    tp: int = 1
    sp: int = 1
    cfg: int = 1
    sp_attention: str = "agrs"
    tp_row: str = "auto"

    def __post_init__(self) -> None:
        bad = []
        for name in ("tp", "sp"):
            if getattr(self, name) not in SHARD_COUNTS:
                bad.append(f"--{name} {getattr(self, name)} (one of {', '.join(map(str, SHARD_COUNTS))}: "
                           "shards must be subtrees of contract v2's 8-segment trees)")
        if self.cfg not in (1, 2):
            bad.append(f"--cfg-parallel {self.cfg} (1 or 2: one CFG branch per rank)")
        if self.sp_attention not in SP_ATTENTIONS:
            bad.append(f"--sp-attention {self.sp_attention!r} (one of {', '.join(SP_ATTENTIONS)})")
        if self.tp_row not in TP_ROWS:
            bad.append(f"TP row-parallel mode {self.tp_row!r} (one of {', '.join(TP_ROWS)})")
        if bad:
            raise UnsupportedConfigError("parallel layout: unsupported " + "; ".join(bad))

    @property
    def world_size(self) -> int:
        return self.tp * self.sp * self.cfg

    @property
    def parallel(self) -> bool:
        """Whether any dimension is larger than 1."""
        return self.world_size > 1

    def mesh_shape(self) -> tuple[int, int, int]:
        """The mesh's shape in ``MESH_DIMS`` order."""
        return (self.cfg, self.sp, self.tp)

    def layout(self) -> dict[str, Any]:
        """The manifest ``layout`` keys of this plan (``manifest_schema._LAYOUT``)."""
        out: dict[str, Any] = {"kind": "parallel", "tp": self.tp, "sp": self.sp, "cfg_parallel": self.cfg}
        if self.sp > 1:
            out["sp_attention"] = self.sp_attention
        return out


def check_cfg_parallel(dims: ParallelDims, *, family: str, cfg_on: bool, cfg_layout: str) -> None:
    """Refuse CFG-parallel where it cannot give the run's bytes: CFG off (there is no second
    branch), or a production family with batched CFG — each CFG rank runs its branch in a forward
    of its own, as ``--cfg-layout sequential`` does, and production bytes differ between the two
    layouts (strict bytes do not depend on the CFG layout).

    Raises:
        UnsupportedConfigError: naming the option to change.
    """
    if dims.cfg <= 1:
        return
    if not cfg_on:
        raise UnsupportedConfigError("--cfg-parallel 2 runs one CFG branch per rank, but CFG is off "
                                     "(cfg_scale <= 1 or no negative prompt)")
    if family != "strict" and cfg_layout != "sequential":
        raise UnsupportedConfigError(
            f"--cfg-parallel 2 runs each CFG branch in its own forward, as --cfg-layout sequential "
            f"does; the {family} family's bytes differ between batched and sequential CFG, so the "
            f"run would not be the {cfg_layout} one it records: pass --cfg-layout sequential (or run "
            "strict, whose bytes do not depend on the CFG layout)")


def check_faults(faults: Sequence[str]) -> None:
    """Refuse probe faults that ``FAULTS`` does not declare.

    Raises:
        UnsupportedConfigError: naming the unknown ones and the known ones.
    """
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise UnsupportedConfigError(f"unknown parallel fault(s) {', '.join(unknown)} "
                                     f"(known: {', '.join(FAULTS)})")


def mesh_rank(dims: ParallelDims, coords: dict[str, int]) -> int:
    """The global rank at ``coords`` (``{"cfg": c, "sp": s, "tp": t}``) of the mesh of ``dims``:
    ``(c·sp + s)·tp + t`` (``drifttool.shards.mesh_rank``)."""
    return shards.mesh_rank(dims.tp, dims.sp, coords)


@dataclass
class ParallelPlan:
    """Where this process stands in the layout and what the layout does to each operator.

    Attributes:
        dims: the degrees.
        coords: this rank's coordinate in each mesh dimension (``{"cfg": c, "sp": s, "tp": t}``).
        groups: the process group of each dimension of size > 1 (ranks that differ only there).
        num_layers: the model's blocks (the last block index + 1 is the final layer).
        faults: probe faults planted in this layout (``FAULTS``; empty for a real run).
        tp_row: how TP row-parallel GEMMs split their work, resolved (``TP_ROWS``: ``partials``
            or ``gather``).
        fault_effects: per planted fault that can check itself, ``[calls, calls whose bytes it
            changed]`` (``tp_allreduce`` compares its plain all-reduce with the contract's tree):
            a fault that changed no byte at any call is a no-op on these weights and inputs.
        state: what the rules learn during one forward (``n_img`` at ``img_in``, ``text_len``
            at attention), read by later rules and the capture placers.
    """

    dims: ParallelDims
    coords: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MESH_DIMS, 0))
    groups: dict[str, Any] = field(default_factory=dict)
    num_layers: int = 0
    faults: frozenset[str] = frozenset()
    tp_row: str = "partials"
    fault_effects: dict[str, list[int]] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, ctx: "DistContext", dims: ParallelDims, config: Any, *,
              family: str = "strict", faults: Sequence[str] = (),
              capture_level: str | None = None, capture_from: str = "",
              internals: bool = True) -> "ParallelPlan":
        """The plan of ``dims`` for the process ``ctx`` (launched with ``mesh_dims=MESH_DIMS`` and
        ``mesh_shape=dims.mesh_shape()``) and the model ``config`` (``MMDiTConfig``).
        ``capture_from`` names where ``capture_level`` came from (a default), for the refusal;
        ``internals``: whether a capture at L2 takes the attention internals (the run setting).

        Raises:
            UnsupportedConfigError: the mesh does not match ``dims``, a TP/SP layout for a
                family other than strict (production TP/SP is not byte-defined here), a model
                the degrees do not divide (``tp.check``, ``sp.check``), Ring attention at
                ``capture_level`` L2 with ``internals``, an unknown fault (``check_faults``), or
                on CUDA a layout that would split a reduction axis across ranks (Ring attention, TP row-parallel
                ``partials``: the strict CUDA family reduces each axis in one sequential order).
        """
        if dims.world_size != ctx.world_size:
            raise UnsupportedConfigError(
                f"parallel layout tp={dims.tp} × sp={dims.sp} × cfg={dims.cfg} = {dims.world_size} "
                f"ranks, but the launch has {ctx.world_size} (torchrun --nproc-per-node)")
        if (dims.tp > 1 or dims.sp > 1) and family != "strict":
            raise UnsupportedConfigError(
                f"TP/SP layouts run the strict family only (the mode asks for the {family!r} "
                "family, whose sharded arithmetic contract v2 does not define: use --mode strict)")
        if dims.sp > 1 and dims.sp_attention == "ring" and internals and captures_internals(capture_level):
            raise UnsupportedConfigError(sp.ring_no_l2(capture_level, capture_from))
        check_faults(faults)
        on_cuda = ctx.device.type == "cuda"
        tp_row = tp_row_for(dims, on_cuda)  # the CUDA rule (``rules``)
        if on_cuda and family == "strict":
            split = reduction_splits(dims, tp_row)
            if split:
                raise UnsupportedConfigError(
                    "strict on CUDA never splits a reduction axis across ranks, but "
                    + " and ".join(split) + " would: use --sp-attention agrs or ulysses")
        if dims.tp > 1:
            tp.check(config, dims)
        if dims.sp > 1:
            sp.check(config, dims)
        plan = cls(dims=dims, num_layers=int(config.num_layers), faults=frozenset(faults), tp_row=tp_row)
        mesh = ctx.mesh
        if mesh is not None:
            names = tuple(mesh.mesh_dim_names or ())
            if names != MESH_DIMS or tuple(mesh.shape) != dims.mesh_shape():
                raise UnsupportedConfigError(
                    f"mesh {names} of shape {tuple(mesh.shape)} does not match the layout "
                    f"{MESH_DIMS} of shape {dims.mesh_shape()}")
            for name in MESH_DIMS:
                plan.coords[name] = mesh.get_local_rank(name)
                if mesh.size(mesh_dim=MESH_DIMS.index(name)) > 1:
                    plan.groups[name] = mesh.get_group(name)
        return plan

    # -- where this rank stands

    def size(self, dim: str) -> int:
        return {"tp": self.dims.tp, "sp": self.dims.sp, "cfg": self.dims.cfg}[dim]

    @property
    def is_root(self) -> bool:
        """Coordinate 0 in every dimension: owns the records every rank repeats (step records,
        the sampler's calls)."""
        return not any(self.coords.values())

    @property
    def mesh_rank(self) -> int:
        """This process's global rank: its coordinates row-major over ``MESH_DIMS`` (the
        ``DeviceMesh`` of ``init_distributed`` lays ranks 0..N-1 out so)."""
        return mesh_rank(self.dims, self.coords)

    def owns(self, block: int) -> bool:
        """Whether this rank records a call of ``block``: TP and SP coordinate 0; for the
        sampler's calls (``SAMPLER_BLOCK``, repeated on every CFG rank) CFG coordinate 0 too."""
        if self.coords["tp"] or self.coords["sp"]:
            return False
        return block != SAMPLER_BLOCK or self.coords["cfg"] == 0

    def replicated(self, block: int, placed: Sequence[str]) -> list[str]:
        """The mesh dimensions over which every rank computes a call's output alike: TP and SP
        (size > 1) unless they shard it (``placed``); CFG too for the sampler's calls
        (``SAMPLER_BLOCK``), which every CFG rank repeats."""
        out = [d for d in ("sp", "tp") if self.size(d) > 1 and d not in placed]
        if block == SAMPLER_BLOCK and self.size("cfg") > 1:
            out.append("cfg")
        return out

    def replica_refs(self, replicated: Sequence[str]) -> tuple[int, ...]:
        """Per global rank, the rank whose digest it must equal: the same coordinates with every
        ``replicated`` dimension at 0 (itself when nothing replicates); −1 for ranks of another
        CFG coordinate in a model call (another branch)."""
        tp_, sp_ = self.dims.tp, self.dims.sp
        refs = []
        for r in range(self.dims.world_size):
            c = {"cfg": r // (tp_ * sp_), "sp": (r // tp_) % sp_, "tp": r % tp_}
            if "cfg" not in replicated and c["cfg"] != self.coords["cfg"]:
                refs.append(-1)
                continue
            refs.append(mesh_rank(self.dims, {k: 0 if k in replicated else v for k, v in c.items()}))
        return tuple(refs)

    # -- dispatch and capture

    def call(self, rt: "Runtime", op: str, stream: str, run: Callable[..., Any], args: tuple,
             kwargs: dict[str, Any]) -> Any:
        """``run(*args, **kwargs)`` under ``op``'s rule (``rules.RULES``): its TP compute rule
        innermost, its SP compute rule around it; unchanged where the rule has none for a
        dimension of size > 1."""
        r = rule(op)
        for dim, compute in (("tp", r.tp), ("sp", r.sp)):
            if compute is not None and self.size(dim) > 1:
                run = _bind(compute, self, rt, stream, run)
        return run(*args, **kwargs)

    def for_capture(self, rt: "Runtime", site: dict[str, Any], out: Any,
                    layouts: tuple[str | None, ...], keep_rows: bool) -> list[Any] | None:
        """What this rank records of a call's outputs (``placement.for_capture``; a collective:
        every rank calls it for every captured call, in the same order)."""
        return placement.for_capture(self, rt, site, out, layouts, keep_rows)

    def check_training(self, model: Any = None) -> None:
        """Refuse what training under this plan cannot give one device's gradient bytes for:
        under TP/SP, trainable parameters other than LoRA adapters (TP/SP weight gradients go
        through the strict gradient ledger, ``training.ledger``, which collects adapted
        weights).

        Raises:
            UnsupportedConfigError: naming what is unsupported.
        """
        if model is not None and (self.dims.tp > 1 or self.dims.sp > 1):
            base = sorted(n for n, p in model.named_parameters()
                          if p.requires_grad and ".lora_A." not in n and ".lora_B." not in n)
            if base:
                raise UnsupportedConfigError(
                    f"training under TP/SP trains LoRA adapters only; {len(base)} base parameters "
                    f"require gradients (first: {base[0]})")


def _bind(compute: Rule, plan: ParallelPlan, rt: "Runtime", stream: str, run: Callable[..., Any]):
    def bound(*args: Any, **kwargs: Any) -> Any:
        return compute(plan, rt, stream, run, args, kwargs)

    return bound
