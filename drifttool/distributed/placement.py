"""Capture under a parallel plan: where each rank's block of an output sits, and what the owning
rank records.

    >>> got = plan.for_capture(rt, site, out, ("BS.",), keep_rows=False)   # every rank, every call
    >>> [(part, pending)], checks = got[0]                                   # on the owning rank

The axes come from the parallel rule table (``rules.RULES``: ``OpRule.rows`` for SP,
``OpRule.heads`` for TP and Ulysses), the same table dispatch wraps the calls with. Capture moves
no tensor: every rank digests its own block (``capture.shards.shard_payload``) and only digest
partials and one digest word per rank travel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from drifttool.capture import shards as capture_shards
from drifttool.capture.shards import AxisShard
from drifttool.distributed.canonical import COMM, gather_list
from drifttool.distributed.rules import OpRule, rule
from drifttool.distributed.sp import rank_rows
from drifttool.errors import UnsupportedConfigError

if TYPE_CHECKING:  # pragma: no cover
    from drifttool.capture.shards import Placement
    from drifttool.distributed.plan import ParallelPlan
    from drifttool.runtime import Runtime


def _ulysses_heads(plan: "ParallelPlan", r: OpRule, stream: str) -> bool:
    """Under ``--sp-attention ulysses`` a joint output with a heads axis is placed by heads (the
    rows were traded for heads)."""
    return stream == "joint" and plan.dims.sp_attention == "ulysses" and r.heads is not None


def place_sp(plan: "ParallelPlan", block: int, op: str, stream: str, tensor: torch.Tensor,
             placement: "Placement") -> "Placement":
    """``placement`` with the axis SP shards in an image-stream or joint output (``OpRule.rows``):
    this rank's image rows at their global offset (joint outputs: the text rows every rank
    repeats are SP rank 0's; Ulysses' attention outputs: this rank's heads, ``OpRule.heads``).
    Unchanged for outputs SP does not shard (text stream, ``rows`` None, the final output an SP
    rule gathered, the sampler's calls)."""
    r = rule(op)
    if not -1 <= block <= plan.num_layers or r.rows is None or stream not in ("img", "joint"):
        return placement
    s = plan.coords["sp"]
    lo, hi = rank_rows(plan)
    n_img = plan.state.get("n_img", 0)
    if stream == "img":
        if r.sp_gathers_final and block == plan.num_layers:
            return placement
        return {**placement, r.rows: AxisShard(n_img, ((0, hi - lo, lo),))}
    if _ulysses_heads(plan, r, stream):  # rows for heads
        per = tensor.shape[r.heads]
        return {**placement, r.heads: AxisShard(per * plan.dims.sp, ((0, per, s * per),))}
    text = int(plan.state.get("text_len", 0))
    pieces = ((0, text, 0),) if s == 0 and text else ()
    pieces += ((text, hi - lo, text + lo),)
    return {**placement, r.rows: AxisShard(text + n_img, pieces)}


def place_tp(plan: "ParallelPlan", block: int, op: str, tensor: torch.Tensor,
             placement: "Placement") -> "Placement":
    """``placement`` with this TP rank's heads or channels of a sharded output (``OpRule.heads``)
    at their global offset (inside what SP placed on the same axis: Ulysses' heads); unchanged
    for replicated outputs and outside the blocks."""
    dim = rule(op).heads
    if dim is None or not 0 <= block < plan.num_layers:
        return placement
    t, tp = plan.coords["tp"], plan.dims.tp
    inner = placement.get(dim)
    if inner is None:
        n = tensor.shape[dim]
        return {**placement, dim: AxisShard(n * tp, ((0, n, t * n),))}
    return {**placement, dim: inner.shifted(t * inner.size, inner.size * tp)}


def place(plan: "ParallelPlan", block: int, op: str, stream: str,
          tensor: torch.Tensor) -> tuple["Placement", list[str]]:
    """Where this rank's block of an output sits in the logical output (SP, then TP), and the
    mesh dimensions that shard it."""
    placement: dict = {}
    placed = []
    for dim, placer in (("sp", lambda p: place_sp(plan, block, op, stream, tensor, p)),
                        ("tp", lambda p: place_tp(plan, block, op, tensor, p))):
        if plan.size(dim) > 1:
            new = placer(placement)
            if new is not placement:
                placed.append(dim)
            placement = new
    return placement, placed


def repeated_rows(plan: "ParallelPlan", op: str, stream: str, placement: "Placement") -> "Placement | None":
    """Where the rows every SP rank repeats sit in a joint output that SP places by rows: the text
    rows (``placement`` of this rank with its row axis narrowed to them), which only SP rank 0's
    block holds; each rank digests its own copy so the ranks' copies are checked. ``None`` for
    other outputs (no text rows, or Ulysses' attention outputs, placed by heads)."""
    r = rule(op)
    if stream != "joint" or r.rows is None or _ulysses_heads(plan, r, stream):
        return None
    text, axis = int(plan.state.get("text_len", 0)), r.rows
    if not text or axis not in placement:
        return None
    return {**placement, axis: AxisShard(placement[axis].size, ((0, text, 0),))}


def capture_source(plan: "ParallelPlan", op: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor capture digests for an output: under ``--sp-attention ulysses`` the attention
    output as this rank computed it (every row of its heads, ``[B, L + N, H/S, Dh]``, before
    the rows are traded back), so its digest partial is the rank's own work and a head slice
    that differs names the rank that computed it; else ``tensor``.

    Raises:
        UnsupportedConfigError: the Ulysses rule kept no output for the call.
    """
    if op == "joint_attention_fused" and plan.dims.sp > 1 and plan.dims.sp_attention == "ulysses":
        heads = plan.state.pop("ulysses_heads", None)
        if heads is None or heads.dim() != tensor.dim() or heads.shape[0] != tensor.shape[0]:
            raise UnsupportedConfigError("SP Ulysses capture: the attention output this rank "
                                         "computed was not kept by the Ulysses rule")
        return heads
    return tensor


def for_capture(plan: "ParallelPlan", rt: "Runtime", site: dict[str, Any], out: Any,
                layouts: tuple[str | None, ...], keep_rows: bool) -> list[Any] | None:
    """What this rank records of a call's outputs (``ParallelPlan.for_capture``; a collective:
    every rank calls it for every captured call, in the same order).

    Every rank digests what it holds of each output (``capture.shards.shard_payload``): its
    block of an output a rule shards (``place``), its whole copy of one it computes like its
    peers (replicated). The payloads of a sharded output are gathered and combined over each
    dimension that shards it (SP, then TP); over each dimension that replicates it (TP and SP;
    CFG too for the sampler's calls) only every rank's digest word travels, so the owning rank
    (``ParallelPlan.owns``) learns what every rank of the record computed
    (``capture.shards.RankCheck``: a replica that differs from its coordinate-0 peer is a
    disagreement, recorded, never dropped); the text rows of a joint output, which every SP rank
    repeats and SP rank 0's block holds, are checked the same way (``repeated_rows``). The
    owning rank gets ``[(part, pending digest)]`` and the checks per output for
    ``Recorder.capture_digested``; ``None`` for ``None`` layouts, and as the whole result on a
    rank that records nothing of the call.
    """
    outs = out if isinstance(out, tuple) else (out,)
    block = int(rt.scope_value("block"))
    owner = plan.owns(block)
    got: list[Any] = []
    for t, lay in zip(outs, layouts):
        if lay is None or not isinstance(t, torch.Tensor):
            got.append(None)
            continue
        t = capture_source(plan, site["op"], t)  # Ulysses: the heads it computed
        placement, placed = place(plan, block, site["op"], site["stream"], t)
        replicated = plan.replicated(block, placed)
        parts, payload = capture_shards.shard_payload(site, t.detach(), lay, placement, keep_rows)
        widths = capture_shards.payload_widths(parts, keep_rows)
        world = plan.dims.world_size
        # [part, rank, (its block, its copy of the rows every SP rank repeats)]
        table = torch.zeros(len(parts), world, 2, dtype=torch.int64, device=payload.device)
        table[:, plan.mesh_rank, 0] = capture_shards.part_words(payload, parts, keep_rows)
        repeated = repeated_rows(plan, site["op"], site["stream"], placement) if "sp" in placed else None
        if repeated is not None:
            _, copy = capture_shards.shard_payload(site, t.detach(), lay, repeated, False)
            table[:, plan.mesh_rank, 1] = capture_shards.part_words(copy, parts, False)
        with COMM.capturing():  # exact in any order; a few words per rank and part
            for dim in [d for d in ("sp", "tp", "cfg") if d in placed or d in replicated]:
                ours = table.reshape(-1)
                if dim in placed:
                    ours = torch.cat([payload, ours])
                rows = torch.stack(gather_list(ours, plan.groups.get(dim)))
                if dim in placed:
                    payload = capture_shards.reduce_payloads(rows[:, :payload.numel()], widths)
                    rows = rows[:, payload.numel():]
                table = rows.reshape(-1, len(parts), world, 2).amax(0)  # V >= 0: each slot once
        if not owner:
            got.append(None)
            continue
        pending = capture_shards.combine_payloads(parts, payload, t.dtype, keep_rows)
        refs = plan.replica_refs(replicated)
        copy_refs = plan.replica_refs([*replicated, "sp"]) if repeated is not None else None
        checks = [capture_shards.RankCheck(table[j, :, 0], refs, table[j, :, 1], copy_refs)
                  for j in range(len(parts))]
        got.append((list(zip(parts, pending)), checks))
    return got if owner else None
