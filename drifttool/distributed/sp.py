"""Sequence parallelism (SP): image rows and their RoPE positions sharded over the ``sp`` dimension.

    $ torchrun --nproc-per-node 2 -m drifttool run --sp 2 --sp-attention ulysses -o runs/sp2

RFC WS2: "SP shards image rows and their RoPE positions, with text and prompt metadata
replicated." The rank of SP coordinate ``s`` holds the image rows of the image segments
[s·8/S, (s+1)·8/S) of contract v2's key structure (``sp_row_spans``: 64-row blocks, 8 segments
by recursive halving), so every shard is an aligned subtree of the attention merge tree and a
rank's rows keep their query blocks (docs/strict-arithmetic.md, "Attention (contract v2)").
Shards may be unequal (6889 image tokens: 896/832-row segments) or empty (fewer than 8 blocks).

The rules (declared per operator in ``rules.RULES``; the model code is unchanged,
``plan.ParallelPlan.call`` wraps each call):

==========================  =====================================================================
operator (stream)           what the rank does
==========================  =====================================================================
latent_proj_gemm (img, −1)  ``img_in`` on its own rows of the packed latents (``sp_shard_gather``)
multi_axis_rope (img)       its rows' RoPE positions: the rows ``[lo, hi)`` of the image table
joint_attention_fused       every key seen in global key order, by ``--sp-attention``:
                            ``agrs`` all-gathers the image K/V rows (rank order) and attends its
                            queries; ``ulysses`` trades rows for heads (exact all-to-all), attends
                            all rows of H/S heads and trades back; ``ring`` passes K/V shards
                            around the ring and finishes the fixed merge of the ranks' subtrees
                            (``ring.ring_attention``)
latent_proj_gemm (img, N)   ``proj_out`` on its rows, then the rows gathered in rank order: the
                            full ``v_t`` on every rank (CFG combine, the scheduler step and
                            ``logp_t`` run on the full latent, replicated)
==========================  =====================================================================

Every other image-stream operator is row-wise and runs on the rank's rows unchanged (strict
bytes do not depend on the row count); text-stream operators are replicated. No padding is
added: a shard is the rows it holds, so there is nothing to mask. The bytes equal one device
because each row's arithmetic is the same and every collective moves bytes without arithmetic
(``canonical``).

Capture moves no tensor: each rank digests its own rows of an image-stream or joint output
(the axis ``OpRule.rows``) and only the digest partials are combined (``placement``,
``capture.shards``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from drifttool.distributed.canonical import gather_cat, gather_cat_replicated
from drifttool.distributed.ring import ring_attention, sp_row_spans
from drifttool.distributed.sp_grad import (Shard, agrs_attention, all_to_all_grad, head_slice,
                                           ring_attention_grad)
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import spec

if TYPE_CHECKING:  # pragma: no cover
    from drifttool.distributed.plan import ParallelPlan
    from drifttool.runtime import Runtime


def ring_no_l2(level: str = "L2", source: str = "") -> str:
    """Why Ring attention refuses capture ``level`` (L2: the attention internals); ``source``
    names where the level came from (a default)."""
    return (f"--sp-attention ring cannot capture {level}" + (f" ({source})" if source else "")
            + ": a ring rank never holds a whole row of attention scores, so the attention internals "
              f"{level} records do not exist; use --capture L1 (or L0), --no-internals, or "
              f"--sp-attention agrs|ulysses at {level}")


def check(config: Any, dims: Any) -> None:
    """Refuse an SP layout the model does not allow: Ulysses needs the rank's heads (after TP)
    divisible by the SP degree.

    Raises:
        UnsupportedConfigError: naming the heads and degrees.
    """
    heads = int(config.num_attention_heads) // dims.tp
    if dims.sp_attention == "ulysses" and heads % dims.sp:
        raise UnsupportedConfigError(
            f"--sp-attention ulysses: " + (f"{heads} attention heads per TP rank do not" if heads != 1
                                           else "1 attention head per TP rank does not")
            + f" split over --sp {dims.sp} (each SP rank attends a whole number of heads)")


# ---------------------------------------------------------------------------------------------
# where this rank stands in the forward under way


def _spans(plan: "ParallelPlan") -> list[tuple[int, int]]:
    n = plan.state.get("n_img")
    if n is None:
        raise UnsupportedConfigError("SP: an image-stream operator ran before img_in "
                                     "(latent_proj_gemm at block -1) set the image length")
    return sp_row_spans(n, plan.dims.sp)


def _sizes(plan: "ParallelPlan") -> list[int]:
    return [hi - lo for lo, hi in _spans(plan)]


def rank_rows(plan: "ParallelPlan") -> tuple[int, int]:
    """This SP rank's image rows ``[lo, hi)`` in the forward under way."""
    return _spans(plan)[plan.coords["sp"]]


def _group(plan: "ParallelPlan") -> Any:
    return plan.groups.get("sp")


def gather_rows(plan: "ParallelPlan", t: torch.Tensor, dim: int, prefix: int = 0) -> torch.Tensor:
    """The logical tensor of ``t``, whose axis ``dim`` holds ``prefix`` replicated (text)
    positions and then this rank's image rows: the prefix, then every rank's rows in rank order."""
    rows = t.narrow(dim, prefix, t.shape[dim] - prefix)
    full = gather_cat(rows, dim, _group(plan), _sizes(plan))
    return full if prefix == 0 else torch.cat([t.narrow(dim, 0, prefix), full], dim=dim)


# ---------------------------------------------------------------------------------------------
# rules


def latent_proj(plan: "ParallelPlan", rt: "Runtime", stream: str, run, args: tuple, kwargs: dict) -> Any:
    block = int(rt.scope_value("block"))
    if block == -1:  # img_in: this rank's rows of the packed latents [B, N, C]
        x = args[0]
        plan.state["n_img"] = int(x.shape[1])
        lo, hi = rank_rows(plan)
        return run(x[:, lo:hi], *args[1:], **kwargs)
    y = run(*args, **kwargs)  # proj_out: this rank's rows, then every rank's in rank order
    return gather_cat_replicated(y, 1, _group(plan), _sizes(plan))  # the sampler runs replicated


def rope(plan: "ParallelPlan", rt: "Runtime", stream: str, run, args: tuple, kwargs: dict) -> Any:
    if stream != "img":
        return run(*args, **kwargs)
    x, freqs = args
    lo, hi = rank_rows(plan)
    if "sp_rope_no_offset" in plan.faults:  # probe fault: every shard's positions from 0
        lo, hi = 0, hi - lo
    if freqs.shape[0] != plan.state["n_img"]:
        raise UnsupportedConfigError(f"SP: the image RoPE table has {freqs.shape[0]} positions, "
                                     f"the image {plan.state['n_img']}")
    return run(x, freqs[lo:hi], **kwargs)  # the rank's rows keep their global positions


def attention(plan: "ParallelPlan", rt: "Runtime", stream: str, run, args: tuple, kwargs: dict) -> Any:
    q, k, v, key_mask = args
    text_len = int(kwargs.get("text_len") or 0)
    plan.state["text_len"] = text_len
    how = plan.dims.sp_attention
    if how == "agrs":
        if "sp_padding_unmasked" in plan.faults:
            return _padded_unmasked(plan, run, q, k, v, key_mask, text_len, kwargs)
        lo, hi = rank_rows(plan)
        shard = Shard(lo, hi, plan.coords["sp"], plan.dims.sp, _group(plan))
        return agrs_attention(shard, lambda t: gather_rows(plan, t, 1, text_len), run, q, k, v,
                              key_mask, text_len, kwargs)
    if how == "ulysses":
        return _ulysses(plan, run, q, k, v, key_mask, text_len, kwargs)
    if rt.wants_internals():
        raise UnsupportedConfigError(ring_no_l2())
    attention_ops = ("joint_attention_fused", *spec("joint_attention_fused").decomposition.ops)
    planted = sorted(op for op in attention_ops if op in rt.variants)
    if planted:
        raise UnsupportedConfigError(f"--sp-attention ring runs its own blocked kernel: a variant "
                                     f"of {', '.join(planted)} cannot apply")
    lo, hi = rank_rows(plan)
    shard = Shard(lo, hi, plan.coords["sp"], plan.dims.sp, _group(plan))
    return ring_attention_grad(
        shard, lambda t: gather_rows(plan, t, 1, text_len),
        lambda q_, k_, v_: ring_attention(q_, k_, v_, key_mask, text_len=text_len,
                                          n_img=plan.state["n_img"], group=_group(plan)),
        q, k, v, key_mask, text_len)


def _ulysses(plan: "ParallelPlan", run, q, k, v, key_mask, text_len: int, kwargs: dict) -> torch.Tensor:
    """Rows for heads: each rank attends every row of its H/S heads (text rows are replicated,
    so sliced; image rows arrive from every rank by an exact all-to-all in rank order), then
    the output trades back and the text rows' heads are gathered."""
    sp, me = plan.dims.sp, plan.coords["sp"]
    group = _group(plan)
    heads = q.shape[2]
    per = heads // sp
    sizes = _sizes(plan)

    def to_heads(t: torch.Tensor) -> torch.Tensor:  # [B, L + n_r, H, Dh] -> [B, L + N, H/S, Dh]
        img = t[:, text_len:]
        got = all_to_all_grad([img[:, :, j * per:(j + 1) * per].contiguous() for j in range(sp)],
                              [(t.shape[0], n, per, t.shape[3]) for n in sizes], group)
        return torch.cat([head_slice(t[:, :text_len], me * per, (me + 1) * per, group), *got], dim=1)

    o = run(to_heads(q), to_heads(k), to_heads(v), key_mask, **kwargs)  # [B, L + N, H/S, Dh]
    plan.state["ulysses_heads"] = o  # what this rank computed: every row of its heads (capture)
    starts = [sum(sizes[:j]) for j in range(sp)]
    img = o[:, text_len:]
    mine = sizes[me]
    got = all_to_all_grad([img[:, s0:s0 + n].contiguous() for s0, n in zip(starts, sizes)],
                          [(o.shape[0], mine, per, o.shape[3])] * sp, group)
    text = gather_cat_replicated(o[:, :text_len].contiguous(), 2, group, [per] * sp)
    return torch.cat([text, torch.cat(got, dim=2)], dim=1)


def _padded_unmasked(plan: "ParallelPlan", run, q, k, v, key_mask, text_len: int, kwargs: dict) -> torch.Tensor:
    """Probe fault ``sp_padding_unmasked``: the image K/V shards zero-padded to the longest shard
    for the gather (as peers pad for equal collectives) and the pads left in as valid keys."""
    sizes = _sizes(plan)
    longest = max(sizes)
    group = _group(plan)

    def padded(t: torch.Tensor) -> torch.Tensor:
        img = t[:, text_len:]
        pad = t.new_zeros((t.shape[0], longest - img.shape[1], *t.shape[2:]))
        return torch.cat([t[:, :text_len], gather_cat(torch.cat([img, pad], 1), 1, group)], 1)

    kf, vf = padded(k), padded(v)
    mask = key_mask
    if mask is None:
        mask = torch.ones(q.shape[0], text_len + sum(sizes), dtype=torch.bool, device=q.device)
    mask = torch.cat([mask[:, :text_len], torch.ones(q.shape[0], longest * len(sizes), dtype=torch.bool,
                                                     device=q.device)], 1)
    return run(q, kf, vf, mask, **kwargs)
