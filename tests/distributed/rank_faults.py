"""Rank bodies that plant a fault in rank 1's own computation of a TP/SP layout, for the tests of
every rank's records (``test_rank_agreement``); spawned by ``plan_ranks.on_ranks``.

    run_planted(ParallelDims(tp=2), out, fields, "attn_out_rank1")

``attn_out_rank1``: TP rank 1's result of the row-parallel ``attn_out_bias_gemm`` (a replicated
output: every TP rank finishes the same tree) has its first element's last bit flipped, at the
first call (step 0, block 0); rank 0, which writes the record, computes it right.
``ulysses_rank1``: under ``--sp-attention ulysses``, SP rank 1's attention output of its own
heads has one element's last bit flipped at the first call (step 0, block 0), before the rows
are traded back. ``agrs_text_rank1``: under ``--sp-attention agrs``, SP rank 1's copy of the
attention output's first text row (which SP rank 0's block holds) has one bit flipped at the
first call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from drifttool.distributed import sp, tp
from drifttool.distributed.plan import ParallelDims
from drifttool.runner import execute
from drifttool.settings import RunSpec
from tests.distributed.plan_ranks import on_ranks

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def flip_last_bit(t: torch.Tensor, index: tuple[int, ...]) -> torch.Tensor:
    """A copy of ``t`` with the lowest mantissa bit of ``t[index]`` flipped."""
    out = t.detach().clone()
    cell = out[index].reshape(1)
    bits = cell.view(_BITS[out.dtype])
    bits ^= 1
    out[index] = cell[0]
    return out


def _plant(dims: ParallelDims, rank: int, fault: str) -> None:
    calls = {"n": 0}
    if fault == "attn_out_rank1" and rank == 1:
        row = tp._row

        def planted_row(op, plan, rt, args):
            y = row(op, plan, rt, args)
            if op == "attn_out_bias_gemm":
                calls["n"] += 1
                if calls["n"] == 1:
                    return flip_last_bit(y, (0,) * y.dim())
            return y

        tp._row = planted_row
    elif fault == "ulysses_rank1" and rank == 1:
        ulysses = sp._ulysses

        def planted_ulysses(plan, run, q, k, v, key_mask, text_len, kwargs):
            def run1(*a, **kw):
                o = run(*a, **kw)  # [B, L + N, H/S, Dh]: every row of this rank's heads
                calls["n"] += 1
                return flip_last_bit(o, (0, text_len, 0, 0)) if calls["n"] == 1 else o

            return ulysses(plan, run1, q, k, v, key_mask, text_len, kwargs)

        sp._ulysses = planted_ulysses
    elif fault == "agrs_text_rank1" and rank == 1:
        agrs = sp.agrs_attention

        def planted_agrs(*args):
            o = agrs(*args)  # [B, L + n_r, H, Dh]: the text rows, then this rank's image rows
            calls["n"] += 1
            return flip_last_bit(o, (0, 0, 0, 0)) if calls["n"] == 1 else o

        sp.agrs_attention = planted_agrs
    elif fault not in ("attn_out_rank1", "ulysses_rank1", "agrs_text_rank1", ""):
        raise ValueError(f"unknown planted fault {fault!r}")


def run_rank(ctx, dims: ParallelDims, arg: Any) -> int:
    """Rank body: ``arg = (out, spec fields, fault)``; plants ``fault`` on rank 1, then runs."""
    out, fields, fault = arg
    _plant(dims, ctx.rank, fault)
    execute(RunSpec(**fields), out, dist=ctx, parallel=dims)
    return ctx.rank


def run_planted(dims: ParallelDims, out: Path, fields: dict[str, Any], fault: str) -> Path:
    """Run the layout into ``out`` with ``fault`` planted on rank 1 (``""``: none)."""
    assert on_ranks(dims, "tests.distributed.rank_faults:run_rank", (out, fields, fault)) == \
        list(range(dims.world_size))
    return out
