"""Tensor parallelism (TP): attention heads and MLP channels sharded over the ``tp`` dimension.

    $ torchrun --nproc-per-node 2 -m drifttool run --tp 2 -o runs/tp2

RFC WS2: "TP shards attention heads and MLP channels." TP rank ``t`` of ``T`` holds heads
[t·H/T, (t+1)·H/T) and MLP channels [t·4d/T, (t+1)·4d/T). The weights stay whole on every rank
(they are parameters of the single-device model); a rule slices them per call, so a LoRA-merged
weight is sliced the same way. The rules (``rules.RULES``):

===================  ====================================================================  =======================
operator             what the rank computes                                                RFC row
===================  ====================================================================  =======================
qkv_bias_gemm        column-parallel: its heads' rows of W_q, W_k, W_v and their biases     ``tp_qkv_bias_gemm``
                     (both streams), ``heads / T`` heads
mlp_up_gemm_gelu     column-parallel: its channels' rows of W and b                         ``tp_mlp_gemm_gelu``
attn_out_bias_gemm,  row-parallel: the contract-v2 partial over its K shard (8/T whole      ``tp_attn_out_bias_gemm``
mlp_down_gemm        segments, ``strict_gemm.linear_partial``); the T partials gathered      ``tp_mlp_gemm_gelu``
                     in rank order and finished by the fixed tree on every rank, the bias
                     added once (``finish_linear``) — never a plain all-reduce.
                     With ``plan.tp_row == "gather"`` (strict on CUDA): the K shards of the
                     input gathered in rank order, the rank's output features computed over
                     the whole K, the features gathered in rank order (``_row_by_gather``)
===================  ====================================================================  =======================

Per-head operators (``qk_rmsnorm``, ``multi_axis_rope``, ``joint_attention_fused``) run on the
rank's heads unchanged; every other operator (input and output projections, timestep,
modulation, norms: ``tp_replicated_modules``) runs replicated on the full hidden state the
row-parallel GEMMs return. The column shard [t·d/T, (t+1)·d/T) of Q/K/V is exactly the K shard
of the attention output projection (``check``), so the heads a rank attends feed its partial.

Bytes equal one device: a column shard computes its columns with the unsharded kernel choice
(``check`` refuses a split whose shard would change the kernel), and a row-parallel shard owns
a subtree of contract v2's K tree (docs/strict-arithmetic.md, "Contract v2").

The rules are declared per operator in ``rules.RULES`` (``qkv``, ``column``, ``row_rule``), with
the output axis of each sharded output's heads or channels (``OpRule.heads``): capture moves no
tensor, each rank digests its own heads or channels and only the digest partials are combined
(``placement``, ``capture.shards``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from drifttool.distributed.canonical import gather_cat, gather_list
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict import act_dtype, cast_like, f32, g32, gelu_tanh_grad32, out
from drifttool.ops.strict_gemm import N_TILE, finish_linear, linear_is_exact, linear_partial, tiled_linear
from drifttool.ops.strict_math import local_spans, segment_spans, shard_spans

if TYPE_CHECKING:  # pragma: no cover
    from drifttool.distributed.plan import ParallelPlan
    from drifttool.runtime import Runtime


def _column_ok(n: int, k: int, tp: int) -> str | None:
    """Why a column-parallel split of the weight [n, k] over ``tp`` ranks would not give the
    unsharded columns' bytes, or None."""
    if n % tp:
        return f"{n} output columns do not split over {tp} ranks"
    if linear_is_exact(n // tp, k) != linear_is_exact(n, k):
        return (f"a [{n // tp}, {k}] shard of the [{n}, {k}] weight would switch the strict GEMM "
                "kernel (exact products vs tiled)")
    if not linear_is_exact(n, k) and (n // tp) % N_TILE:
        return f"a {n // tp}-column shard of the tiled [{n}, {k}] GEMM is not a multiple of {N_TILE} columns"
    return None


def _row_ok(k: int, tp: int) -> str | None:
    """Why the K shards of contract v2's tree over ``tp`` ranks are not the equal column shards
    [t·k/tp, (t+1)·k/tp) of the preceding column-parallel GEMM, or None."""
    spans = segment_spans(k)
    for t in range(tp):
        mine = shard_spans(spans, tp, t)
        if (mine[0][0], mine[-1][1]) != (k * t // tp, k * (t + 1) // tp):
            return f"K = {k} does not split into {tp} equal whole-segment shards (K must be a multiple of 8)"
    return None


def check(config: Any, dims: Any) -> None:
    """Refuse a TP degree the model does not divide, or whose shards would not reproduce the
    unsharded strict bytes.

    Raises:
        UnsupportedConfigError: naming the width and degree.
    """
    tp, d, hidden = dims.tp, int(config.inner_dim), int(config.mlp_dim)
    bad = []
    if int(config.num_attention_heads) % tp:
        bad.append(f"{config.num_attention_heads} attention heads do not split over {tp} ranks")
    rows = ((("attention output", _column_ok(d, d, tp)), ("MLP down", _column_ok(d, hidden, tp)))
            if dims.tp_row == "gather" else
            (("attention output", _row_ok(d, tp)), ("MLP down", _row_ok(hidden, tp))))
    for what, why in (("Q/K/V", _column_ok(d, d, tp)), ("MLP up", _column_ok(hidden, d, tp)), *rows):
        if why:
            bad.append(f"{what}: {why}")
    if bad:
        raise UnsupportedConfigError(f"--tp {tp}: " + "; ".join(bad))


def _cols(plan: "ParallelPlan", n: int) -> tuple[int, int]:
    t, tp = plan.coords["tp"], plan.dims.tp
    return n * t // tp, n * (t + 1) // tp


def _part(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if t is None else t[lo:hi]


def _slices(plan: "ParallelPlan", rt: "Runtime", ws: tuple, dim: int, lo: int, hi: int) -> list:
    """The rank's slices of the weights ``ws`` (rows ``dim=0`` or columns ``dim=1`` [lo, hi));
    under strict training each slice's gradient is routed to its adapted weight's atoms
    (``training.ledger``)."""
    out = [w[lo:hi] if dim == 0 else w[:, lo:hi] for w in ws]
    if rt.grad_ledger is not None:
        for w, part in zip(ws, out):
            rt.grad_ledger.attach_slice(w, part, dim, lo, hi)
    return out


def _training(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def qkv(plan: "ParallelPlan", rt: "Runtime", stream: str, run, args: tuple, kwargs: dict) -> Any:
    x, wq, bq, wk, bk, wv, bv, heads = args
    lo, hi = _cols(plan, wq.shape[0])
    sq, sk, sv = _slices(plan, rt, (wq, wk, wv), 0, lo, hi)
    train = _training(x)
    outs = run(x.detach() if train else x, sq, _part(bq, lo, hi), sk, _part(bk, lo, hi), sv,
               _part(bv, lo, hi), heads // plan.dims.tp, **kwargs)
    if not train:
        return outs
    return _ColumnInputGrad.apply(plan, (sq, sk, sv), tuple(wq.shape), None, False, x, *outs)


def column(plan: "ParallelPlan", rt: "Runtime", stream: str, run, args: tuple, kwargs: dict) -> Any:
    x, w, b = args  # mlp_up_gemm_gelu
    lo, hi = _cols(plan, w.shape[0])
    (ws,) = _slices(plan, rt, (w,), 0, lo, hi)
    train = _training(x)
    y = run(x.detach() if train else x, ws, _part(b, lo, hi), **kwargs)
    if not train:
        return y
    return _ColumnInputGrad.apply(plan, (ws,), tuple(w.shape), _part(b, lo, hi), True, x, y)[0]


class _ColumnInputGrad(torch.autograd.Function):
    """Identity on a column-parallel GEMM's outputs (run on a detached input, so their own
    backward gives the weights' gradients only); its backward adds the input's gradient by
    contract v2 over the sharded N: each rank's partial over its 8/T segments of N
    (``linear_partial``), gathered in rank order and finished by the tree (``finish_linear``);
    for Q/K/V the three products added (dq·Wq + dk·Wk) + dv·Wv as one device does. For
    ``mlp_up_gemm_gelu`` (``gelu``) the pre-activation is recomputed for GELU' first."""

    @staticmethod
    def forward(ctx, plan, ws, full_shape, bias, gelu, x, *outs):
        ctx.plan, ctx.ws, ctx.full_shape = plan, [w.detach() for w in ws], full_shape
        ctx.bias, ctx.gelu = (None if bias is None else bias.detach()), gelu
        ctx.save_for_backward(x)
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        (x,) = ctx.saved_tensors
        plan = ctx.plan
        n, k = ctx.full_shape
        spans = local_spans(shard_spans(segment_spans(n), plan.dims.tp, plan.coords["tp"]))
        exact = linear_is_exact(n, k)
        lead = x.shape[:-1]
        m = lead.numel()
        dx = None
        for g, w in zip(grads, ctx.ws):
            g2 = g32(g).reshape(m, -1)  # [M, N/T]
            if ctx.gelu:
                pre = tiled_linear(f32(x).reshape(m, k), f32(w), f32(ctx.bias), weight_shape=(n, k))
                g2 = g2 * gelu_tanh_grad32(pre)
            part = linear_partial(g2, f32(w).t().contiguous(), spans, exact=exact)
            if part is None:
                part = torch.zeros(m, k, dtype=torch.float32, device=g2.device)
            one = finish_linear(gather_list(part, plan.groups.get("tp")), None, (m, k), g2.device)
            dx = one if dx is None else dx + one
        return (None, None, None, None, None, cast_like(dx.reshape(*lead, k), x), *grads)


def row_rule(op: str):
    """The row-parallel rule of ``op``: ``_row`` (contract v2 partials) or, with
    ``plan.tp_row == "gather"``, ``_row_by_gather``."""
    def rule(plan: "ParallelPlan", rt: "Runtime", stream: str, run, args: tuple, kwargs: dict) -> Any:
        if plan.tp_row == "gather":
            return _row_by_gather(op, plan, rt, run, args, kwargs)
        return _row(op, plan, rt, args)

    return rule


def _row_by_gather(op: str, plan: "ParallelPlan", rt: "Runtime", run, args: tuple, kwargs: dict) -> Any:
    """Row-parallel GEMM that splits no reduction axis: x [..., K/T] (this rank's heads or
    channels) is gathered in rank order into x [..., K] (exact: a concatenation), the rank computes
    its output features [t·N/T, (t+1)·N/T) over the whole K through the operator's own
    implementation (``run``: variants apply), and the features are gathered in rank order into
    [..., N]. Every output element is the one-device kernel's: the strict CUDA family walks K in
    one fixed order per output tile, whatever the tile's column offset. Forward only (the strict
    CUDA family has no backward).

    Raises:
        UnsupportedConfigError: a planted row-parallel fault (it acts on partials, which this rule
            has none of), an input that is not the rank's K shard, or N not divisible by T.
    """
    planted = sorted(plan.faults & {"tp_allreduce", "tp_bias_every_rank"})
    if planted:
        raise UnsupportedConfigError(f"--tp: the row-parallel {op} gathers its input (no partials to "
                                     f"reduce), so the fault(s) {', '.join(planted)} cannot apply")
    x, w, b = args
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, b)):
        raise UnsupportedConfigError(f"--tp: the gathered row-parallel {op} is forward only (strict "
                                     "training under TP runs the contract v2 partials, on the CPU)")
    n, k = w.shape
    tp, group = plan.dims.tp, plan.groups.get("tp")
    if x.shape[-1] * tp != k or n % tp:
        raise UnsupportedConfigError(f"TP row-parallel GEMM ({op}): input has {x.shape[-1]} features "
                                     f"of K = {k} over {tp} ranks; N = {n} must split over them")
    x_full = gather_cat(x, -1, group)  # [..., K]
    lo, hi = _cols(plan, n)
    y = run(x_full, w[lo:hi], _part(b, lo, hi), **kwargs)  # [..., N/T]
    return gather_cat(y, -1, group)  # [..., N]


def _row(op: str, plan: "ParallelPlan", rt: "Runtime", args: tuple) -> Any:
    """Row-parallel GEMM: x [..., K/T] (this rank's heads or channels), w [N, K], b [N] →
    [..., N] replicated, in the activation dtype (``_RowParallel``). It finishes contract v2's
    tree over the ranks' partials itself, so an operator variant of ``op`` (a probe's change)
    cannot apply: refused, never silently dropped.

    Raises:
        UnsupportedConfigError: a variant of ``op``, or an input that is not the rank's K shard.
    """
    if op in rt.variants:
        raise UnsupportedConfigError(
            f"--tp: the row-parallel {op} finishes the ranks' partials by contract v2's tree "
            f"itself; the variant {rt.variants[op][0]!r} of it cannot apply under TP")
    x, w, b = args
    n, k = w.shape
    spans = shard_spans(segment_spans(k), plan.dims.tp, plan.coords["tp"])
    lo, hi = spans[0][0], spans[-1][1]
    if x.shape[-1] != hi - lo:
        raise UnsupportedConfigError(f"TP row-parallel GEMM: input has {x.shape[-1]} features, "
                                     f"the rank's K shard {hi - lo}")
    if not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return _row_forward(plan, x, w, b, spans)
    sink = rt.grad_ledger.slice_sink(w, 1, lo, hi) if rt.grad_ledger is not None else None
    return _RowParallel.apply(x, w, b, plan, spans, sink)


def _row_forward(plan: "ParallelPlan", x, w, b, spans) -> torch.Tensor:
    n, k = w.shape
    lo, hi = spans[0][0], spans[-1][1]
    lead = x.shape[:-1]
    x2 = f32(x).reshape(lead.numel(), hi - lo)
    part = linear_partial(x2, f32(w)[:, lo:hi], local_spans(spans), exact=linear_is_exact(n, k))
    if part is None:
        part = torch.zeros(x2.shape[0], n, dtype=torch.float32, device=x.device)
    y = _reduce(plan, part, f32(b), (x2.shape[0], n), x.device)
    return out(y, act_dtype(x, w, b)).reshape(*lead, n)


class _RowParallel(torch.autograd.Function):
    """The row-parallel GEMM with its backward: the output gradient is replicated, so the rank's
    columns of dX = dY·W[:, lo:hi] are a column shard of one device's dX (``tiled_linear`` with
    the unsharded transposed shape [K, N]); the rank's columns of dW' go to the gradient ledger
    (``sink``). A trainable weight without a ledger, or a trainable bias, is refused."""

    @staticmethod
    def forward(ctx, x, w, b, plan, spans, sink):
        ctx.plan, ctx.spans, ctx.sink = plan, spans, sink
        ctx.bias_grad = b is not None and b.requires_grad
        ctx.save_for_backward(x, w)
        return _row_forward(plan, x, w, b, spans)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        n, k = w.shape
        lo, hi = ctx.spans[0][0], ctx.spans[-1][1]
        if ctx.bias_grad or (ctx.needs_input_grad[1] and ctx.sink is None):
            raise UnsupportedConfigError("TP training trains LoRA adapters through the strict gradient "
                                         "ledger only (a trainable base weight or bias is unsupported)")
        lead = x.shape[:-1]
        dx = None
        if ctx.needs_input_grad[0]:
            g2 = g32(gy).reshape(lead.numel(), n)
            dx = tiled_linear(g2, f32(w)[:, lo:hi].t().contiguous(), weight_shape=(k, n))
            dx = cast_like(dx.reshape(*lead, hi - lo), x)
        if ctx.needs_input_grad[1]:
            ctx.sink(g32(gy), f32(x))
        return dx, None, None, None, None, None


def _reduce(plan: "ParallelPlan", part: torch.Tensor, b: torch.Tensor | None, shape: tuple[int, int],
            device) -> torch.Tensor:
    """The canonical finish of the row-parallel partials: gathered in rank order, contract v2's
    tree, then the bias once (``strict_gemm.finish_linear``). The probe faults ``tp_allreduce``
    (a plain all-reduce of the partials, the library's order) and ``tp_bias_every_rank`` (each
    rank adds the bias to its partial) replace it (``plan.FAULTS``); ``tp_allreduce`` also
    computes the tree and counts the calls whose bytes it changed (``plan.fault_effects``)."""
    group = plan.groups.get("tp")
    if "tp_bias_every_rank" in plan.faults and b is not None:
        part, b = part + b, None
    if "tp_allreduce" in plan.faults:
        y = part.clone()
        torch.distributed.all_reduce(y, group=group)
        y = y if b is None else y + b
        tree = finish_linear(gather_list(part, group), b, shape, device)  # what the contract gives
        seen = plan.fault_effects.setdefault("tp_allreduce", [0, 0])
        seen[0] += 1
        seen[1] += int(not torch.equal(y.view(torch.int32), tree.view(torch.int32)))
        return y
    return finish_linear(gather_list(part, group), b, shape, device)
