"""The parallel plan: TP, SP and CFG-parallel applied to the single-device model from outside.

    $ torchrun --nproc-per-node 4 -m drifttool run --tp 2 --cfg-parallel 2 -o runs/tp2cfg2
    >>> ctx = init_distributed(mesh_dims=MESH_DIMS, mesh_shape=(dims.cfg, dims.sp, dims.tp))
    >>> plan = ParallelPlan.build(ctx, dims, model.config)
    >>> rt = Runtime(mode="strict", plan=plan, ...)        # the model code is unchanged

The model calls its named operators through ``drifttool.ops.registry.call``; a plan is data: a
table of **rules** per operator name (``tp.RULES``, ``sp.RULES``), each of which wraps the call
(slices a weight to the rank's heads, computes a row-parallel partial and finishes the canonical
tree over the gathered rank partials, gathers the image rows of K/V, …) — as torchtitan's
``parallelize`` and diffusers' ``_cp_plan`` describe a layout beside the model instead of forking
it. Dispatch (``registry._call``) passes every call through ``ParallelPlan.call``.

Capture records the logical tensors without moving them: where a rule table shards an output
(``ParallelPlan.for_capture``, the ``places`` of each table say where this rank's block sits),
every rank digests its own block and only the digest partials are gathered and combined, SP then
TP (``capture.shards``: a few words per record at L1, the row digests at L2). One **owning rank**
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

import torch

from drifttool import shards
from drifttool.capture import shards as capture_shards
from drifttool.distributed import sp, tp
from drifttool.distributed.canonical import COMM, gather_list
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


Rule = Callable[..., Any]
"""``rule(plan, rt, stream, run, args, kwargs) -> out``: runs one call under the plan, calling
``run(*args, **kwargs)`` (the resolved implementation, or the next rule) on what this rank holds."""

Place = Callable[..., dict]
"""``place(plan, rt, op, stream, index, tensor, placement) -> placement``: ``placement`` with the
axes this rule table shards in the output (``capture.shards.Placement``: where this rank's
block sits in the logical output); unchanged when the table does not shard it."""


@dataclass
class ParallelPlan:
    """Where this process stands in the layout and what the layout does to each operator.

    Attributes:
        dims: the degrees.
        coords: this rank's coordinate in each mesh dimension (``{"cfg": c, "sp": s, "tp": t}``).
        groups: the process group of each dimension of size > 1 (ranks that differ only there).
        num_layers: the model's blocks (the last block index + 1 is the final layer).
        rules: operator name -> rules, applied outermost first.
        places: per rule table, its mesh dimension and output placer for capture (SP before TP).
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
    rules: dict[str, list[Rule]] = field(default_factory=dict)
    places: list[tuple[str, Place]] = field(default_factory=list)
    faults: frozenset[str] = frozenset()
    tp_row: str = "partials"
    fault_effects: dict[str, list[int]] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, ctx: "DistContext", dims: ParallelDims, config: Any, *,
              family: str = "strict", faults: Sequence[str] = (),
              capture_level: str | None = None, capture_from: str = "") -> "ParallelPlan":
        """The plan of ``dims`` for the process ``ctx`` (launched with ``mesh_dims=MESH_DIMS`` and
        ``mesh_shape=dims.mesh_shape()``) and the model ``config`` (``MMDiTConfig``).
        ``capture_from`` names where ``capture_level`` came from (a default), for the refusal.

        Raises:
            UnsupportedConfigError: the mesh does not match ``dims``, a TP/SP layout for a
                family other than strict (production TP/SP is not byte-defined here), a model
                the degrees do not divide (``tp.check``, ``sp.check``), Ring attention at
                ``capture_level`` L2, an unknown fault (``check_faults``), or on CUDA a layout
                that would split a reduction axis across ranks (Ring attention, TP row-parallel
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
        if dims.sp > 1 and dims.sp_attention == "ring" and capture_level == "L2":
            raise UnsupportedConfigError(sp.ring_no_l2(capture_level, capture_from))
        check_faults(faults)
        on_cuda = ctx.device.type == "cuda"
        tp_row = dims.tp_row if dims.tp_row != "auto" else ("gather" if on_cuda else "partials")
        if on_cuda and family == "strict":
            split = []
            if dims.sp > 1 and dims.sp_attention == "ring":
                split.append("--sp-attention ring (each rank reduces its own keys)")
            if dims.tp > 1 and tp_row == "partials":
                split.append("TP row-parallel partials (each rank reduces its K shard)")
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
        if dims.sp > 1:
            plan.add(sp.RULES, ("sp", sp.place_output))
        if dims.tp > 1:
            plan.add(tp.RULES, ("tp", tp.place_output))
        return plan

    def add(self, rules: dict[str, Rule], place: tuple[str, Place] | None = None) -> None:
        """Append a rule table (its rules wrap inside those of earlier tables) and its placer
        (``(mesh dimension, place)``)."""
        for name, rule in rules.items():
            self.rules.setdefault(name, []).append(rule)
        if place is not None:
            self.places.append(place)

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

    # -- dispatch and capture

    def call(self, rt: "Runtime", op: str, stream: str, run: Callable[..., Any], args: tuple,
             kwargs: dict[str, Any]) -> Any:
        """``run(*args, **kwargs)`` under the rules for ``op`` (none: unchanged)."""
        rules = self.rules.get(op)
        if not rules:
            return run(*args, **kwargs)
        for rule in reversed(rules):
            run = _bind(rule, self, rt, stream, run)
        return run(*args, **kwargs)

    def for_capture(self, rt: "Runtime", site: dict[str, Any], out: Any,
                    layouts: tuple[str | None, ...], keep_rows: bool) -> list[Any] | None:
        """What this rank records of a call's outputs (a collective: every rank calls it for
        every captured call, in the same order).

        Every rank digests what it holds of each output (``capture.shards.shard_payload``): its
        block of an output a rule table shards (``places``), its whole copy of one it computes
        like its peers (replicated). The payloads of a sharded output are gathered and combined
        over each dimension that shards it (SP, then TP); over each dimension that replicates it
        (TP and SP; CFG too for the sampler's calls, ``SAMPLER_BLOCK``) only every rank's digest
        word travels, so the owning rank (``owns``) learns what every rank of the record
        computed (``capture.shards.RankCheck``: a replica that differs from its coordinate-0
        peer is a disagreement, recorded, never dropped); the text rows of a joint output, which
        every SP rank repeats and SP rank 0's block holds, are checked the same way
        (``sp.repeated_rows``). The owning rank gets ``[(part,
        pending digest)]`` and the checks per output for ``Recorder.capture_digested``; ``None``
        for ``None`` layouts, and as the whole result on a rank that records nothing of the call.
        """
        outs = out if isinstance(out, tuple) else (out,)
        block = int(rt.scope_value("block"))
        owner = self.owns(block)
        got: list[Any] = []
        for i, (t, lay) in enumerate(zip(outs, layouts)):
            if lay is None or not isinstance(t, torch.Tensor):
                got.append(None)
                continue
            t = sp.capture_source(self, rt, site["op"], i, t)  # Ulysses: the heads it computed
            placement: dict = {}
            placed = []
            for dim, place in self.places:
                before = placement
                placement = place(self, rt, site["op"], site["stream"], i, t, placement)
                if placement is not before:
                    placed.append(dim)
            replicated = [d for d in ("sp", "tp") if self.size(d) > 1 and d not in placed]
            if block == SAMPLER_BLOCK and self.size("cfg") > 1:
                replicated.append("cfg")
            parts, payload = capture_shards.shard_payload(site, t.detach(), lay, placement, keep_rows)
            widths = capture_shards.payload_widths(parts, keep_rows)
            world = self.dims.world_size
            # [part, rank, (its block, its copy of the rows every SP rank repeats)]
            table = torch.zeros(len(parts), world, 2, dtype=torch.int64, device=payload.device)
            table[:, self.mesh_rank, 0] = capture_shards.part_words(payload, parts, keep_rows)
            repeated = sp.repeated_rows(self, site["op"], site["stream"], placement) \
                if "sp" in placed else None
            if repeated is not None:
                _, copy = capture_shards.shard_payload(site, t.detach(), lay, repeated, False)
                table[:, self.mesh_rank, 1] = capture_shards.part_words(copy, parts, False)
            with COMM.capturing():  # exact in any order; a few words per rank and part
                for dim in [d for d in ("sp", "tp", "cfg") if d in placed or d in replicated]:
                    ours = table.reshape(-1)
                    if dim in placed:
                        ours = torch.cat([payload, ours])
                    rows = torch.stack(gather_list(ours, self.groups.get(dim)))
                    if dim in placed:
                        payload = capture_shards.reduce_payloads(rows[:, :payload.numel()], widths)
                        rows = rows[:, payload.numel():]
                    table = rows.reshape(-1, len(parts), world, 2).amax(0)  # V >= 0: each slot once
            if not owner:
                got.append(None)
                continue
            pending = capture_shards.combine_payloads(parts, payload, t.dtype, keep_rows)
            refs = self._refs(replicated, block)
            copy_refs = self._refs([*replicated, "sp"], block) if repeated is not None else None
            checks = [capture_shards.RankCheck(table[j, :, 0], refs, table[j, :, 1], copy_refs)
                      for j in range(len(parts))]
            got.append((list(zip(parts, pending)), checks))
        return got if owner else None

    def _refs(self, replicated: list[str], block: int) -> tuple[int, ...]:
        """Per global rank, the rank whose digest it must equal: the same coordinates with every
        ``replicated`` dimension at 0 (itself when nothing replicates); −1 for ranks of another
        CFG coordinate in a model call (another branch)."""
        tp_, sp_, cfg_ = self.dims.tp, self.dims.sp, self.dims.cfg
        refs = []
        for r in range(self.dims.world_size):
            c = {"cfg": r // (tp_ * sp_), "sp": (r // tp_) % sp_, "tp": r % tp_}
            if "cfg" not in replicated and c["cfg"] != self.coords["cfg"]:
                refs.append(-1)
                continue
            refs.append(mesh_rank(self.dims, {k: 0 if k in replicated else v for k, v in c.items()}))
        return tuple(refs)

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


def _bind(rule: Rule, plan: ParallelPlan, rt: "Runtime", stream: str, run: Callable[..., Any]):
    def bound(*args: Any, **kwargs: Any) -> Any:
        return rule(plan, rt, stream, run, args, kwargs)

    return bound
