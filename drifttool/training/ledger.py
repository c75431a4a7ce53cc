"""The canonical LoRA gradient: one reduction over logical samples, CFG branches, rows and steps,
whatever the trainer's execution layout.

    with GradLedger(model) as ledger:      # its sinks are detached at the end
        rt = Runtime(mode="strict", grad_ledger=ledger, ...)
        ... per SDE step: forward(s) under rt; (-logp_t.mean()).backward(); ledger.finish_step(t)
    # every adapter parameter's .grad now holds the canonical gradient accumulated so far

Why. The strict GEMMs reduce a weight gradient over one sample's rows by contract v2 and then
over the samples of *their batch* by the pairwise tree; autograd then adds the contributions of
every forward that used the weight (micro-batches, sequential CFG branches, steps) in its own
order. So the bytes of a LoRA gradient depended on how the trainer batched the work
(architecture review, 2026-12).

The definition (docs/strict-arithmetic.md, "Canonical gradient"). For every adapted weight W'
(``lora_merge``'s output) and every SDE step t, the **atoms** are the per-(logical sample, CFG
branch) partials of dL_t/dW' — each over that row's own rows by contract v2, exactly what the
strict GEMM backward computes before its batch tree (``grad.sample_weight_grads``), so an atom's
bytes do not depend on its batch companions, micro-batch size, CFG layout or padding. Then:

1. step gradient G_t = ``tree_sum_stack`` of the step's atoms ordered by (sample id, branch:
   cond before uncond) — the pairwise tree over that list, zero-padded to a power of two;
2. accumulated gradient D_t = D_{t−1} + G_t, steps in order (sequential, as a per-step backward
   accumulates);
3. the adapter gradients (dA, dB) = the backward of one strict ``lora_merge`` (W, A, B, α/r) for
   the output gradient D_t, set as ``lora_A.weight.grad`` / ``lora_B.weight.grad``.

How. ``drifttool.model.lora_calls.adapted_weight`` hands every merged weight it builds with autograd on
to ``watch`` with the call's identity scope (the samples and per-row branches of the batch rows);
``watch`` attaches a sink to it (``grad.attach_grad_sink``, by storage: a checkpointed
recomputation's detached aliases find it too), and the strict GEMM backward gives the sink
its per-row partials instead of reducing them (returning no gradient to autograd for W', so
autograd adds nothing for it). Production GEMMs carry no sinks: the ledger is for the strict
family only (``recompute`` uses it in strict mode). On CUDA the strict backward hands the sink
its own per-sample partials (``strict_cuda.backward.sample_weight_grads``, contract
``grad.cuda1``): those are the atoms, reduced by the same tree and steps, and (dA, dB) come from
the strict CUDA ``lora_merge`` backward (``strict_cuda.backward.lora_grads``). TP/SP layouts
are refused there (the CUDA backward splits no reduction across ranks).

LoRA mode ``unfused-fp32`` (strict): there is no merged weight; the strict block GEMMs compute dA
and dB themselves (``ops.strict.lora_linear``), per sample by contract v2 like a weight gradient.
``model.lora_calls.gemm_lora`` hands each forward's factors to ``watch_factors``, which returns
per-call copies (``clone``: their own storage, so every forward — micro-batch, CFG branch,
checkpointed recomputation — has its own sink and scope) whose per-sample partials of dA and dB
become the atoms of ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``; steps 1 and 2 are the
same, and step 3 is the identity (the total is the factor's gradient).

Raises ``DriftToolError`` when an atom arrives twice in a step (one weight used twice for the
same sample and branch: not a layout the ledger can order).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from drifttool.distributed.canonical import gather_cat, gather_list
from drifttool.collectives import all_gather_object
from drifttool.distributed.ring import sp_row_spans
from drifttool.errors import DriftToolError, UnsupportedConfigError
from drifttool.model.lora import lora_modules
from drifttool.ops.lora import lora_merge_strict
from drifttool.ops.strict.attention_blocks import BLOCK
from drifttool.ops.strict_cuda.backward import lora_grads as lora_grads_cuda
from drifttool.ops.strict.grad import (attach_grad_sink, detach_grad_sinks, live_rows, outer_partial,
                                       sample_rows, sample_weight_grads, sink_key)
from drifttool.ops.strict_gemm import linear_is_exact
from drifttool.ops.strict_trees import (local_spans, row_segment_spans, shard_spans, tree_finish,
                                        tree_sum_stack)

BRANCH_ORDER = {"cond": 0, "uncond": 1}
"""Order of a sample's CFG branches among its atoms."""


@dataclass
class _Piece:
    """What this rank holds of one (sample, branch) atom: the per-sample partial (``part``), or
    under SP the image rows of the GEMM backward (``rows`` = (dy, x)) still to be reduced with
    the other SP ranks; ``cut`` = (dim, lo, hi) when it covers a TP slice of W'."""

    part: torch.Tensor | None = None
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
    cut: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class _Watched:
    name: str
    samples: tuple[int, ...]
    branches: tuple[str, ...]
    stream: str


class GradLedger:
    """Per-step atoms and the accumulated canonical gradient of every adapted weight of ``model``.

    Attributes:
        totals: module name → accumulated dL/dW' [out, in] FP32 (D_t after ``finish_step``); in mode
            unfused-fp32 ``<module>.lora_A.weight`` / ``.lora_B.weight`` → the factor's own D_t.
        steps: the steps finished, in order.
        history: with ``keep_atoms``, each finished step's atoms (module name → {(sample,
            branch order): partial}); empty otherwise.
        group: the process group whose ranks hold the other atoms (CFG-parallel branches,
            sample-parallel samples); ``finish_step`` gathers every rank's atoms first (exact
            moves), so every rank reduces the same list. ``None``: one process.
        plan: the TP/SP plan the forward ran under (``distributed.plan.ParallelPlan``) or None.
            Under SP an image-stream atom is finished from the SP ranks' row partials (contract
            v2's row segments: each rank's rows are whole segments, their subtrees gathered in
            rank order and finished by the fixed tree); under TP a rank's slice of W' (rows of a
            column-parallel, columns of a row-parallel GEMM) is gathered in rank order.
    """

    def __init__(self, model: torch.nn.Module, *, keep_atoms: bool = False, group: Any = None,
                 plan: Any = None) -> None:
        self.modules = lora_modules(model)
        self._names = {id(m): n for n, m in self.modules.items()}
        self._atoms: dict[str, dict[tuple[int, int], Any]] = {}
        self.totals: dict[str, torch.Tensor] = {}
        self.steps: list[int] = []
        self._keys: set[tuple] = set()
        self._watched: dict[tuple, _Watched] = {}
        self.group = group
        self.plan = plan
        self.keep_atoms = keep_atoms
        self._family: dict[str, str] = {}  # module name → "cpu" (contract v2) or "cuda1" atoms
        self.history: list[dict[str, dict[tuple[int, int], torch.Tensor]]] = []

    def watch(self, module: torch.nn.Module, merged: torch.Tensor, scope: dict[str, Any],
              stream: str = "img", *, atom: str | None = None) -> None:
        """Collect the per-row gradient of ``merged`` (the adapted weight of ``module``, built in
        the identity ``scope``: ``samples`` one id per batch row, ``branch`` one name or one per
        row; ``stream`` the operator's) as the atoms of ``atom`` (default the module's name;
        ``watch_factors`` names a factor). Nothing is attached when autograd is off or the module
        is not adapted."""
        name = self._names.get(id(module))
        if name is None or not (torch.is_grad_enabled() and merged.requires_grad):
            return
        name = atom or name
        samples = tuple(int(x) for x in (scope.get("samples") or []))
        branch = scope.get("branch")
        branches = (branch,) * len(samples) if isinstance(branch, str) else tuple(branch or ())
        spec = _Watched(name, samples, branches, stream)
        key = attach_grad_sink(merged, self._sink(spec, None))
        self._keys.add(key)
        self._watched[key] = spec

    def watch_factors(self, module: torch.nn.Module, a: torch.Tensor, b: torch.Tensor,
                      scope: dict[str, Any], stream: str = "img") -> tuple[torch.Tensor, torch.Tensor]:
        """The factors ``(lora_A, lora_B)`` of an unfused ``module`` for one strict forward in the
        identity ``scope`` (as ``watch``): per-call copies whose per-sample gradients become the
        atoms of ``<module>.lora_A.weight`` / ``.lora_B.weight`` (module docstring); ``(a, b)``
        themselves when autograd is off or the module is not adapted."""
        name = self._names.get(id(module))
        if name is None or not torch.is_grad_enabled():
            return a, b
        out = []
        for which, f in (("lora_A", a), ("lora_B", b)):
            if f.requires_grad:
                copy = f.clone()  # [r, in] / [out, r]: its own storage, so its own sink
                self.watch(module, copy, scope, stream, atom=f"{name}.{which}.weight")
                f = copy
            out.append(f)
        return out[0], out[1]

    def _param(self, name: str) -> tuple[torch.Tensor, bool]:
        """(the tensor an atom of ``name`` is a gradient of, whether it is a factor): the adapted
        module's weight (merged: atoms of W'), or ``<module>.lora_A.weight`` /
        ``.lora_B.weight`` (unfused: atoms of the factor itself)."""
        for which in ("lora_A", "lora_B"):
            suffix = f".{which}.weight"
            if name.endswith(suffix):
                return getattr(self.modules[name[: -len(suffix)]], which).weight, True
        return self.modules[name].weight, False

    def slice_sink(self, merged: torch.Tensor, dim: int, lo: int, hi: int):
        """The sink for the slice ``[lo, hi)`` along ``dim`` of a watched ``merged`` weight (a TP
        rule's shard), or None when ``merged`` is not watched."""
        spec = self._watched.get(sink_key(merged))
        return None if spec is None else self._sink(spec, (dim, lo, hi))

    def attach_slice(self, merged: torch.Tensor, part: torch.Tensor, dim: int, lo: int, hi: int) -> None:
        """Route the weight gradient of ``part`` (= ``merged`` sliced ``[lo, hi)`` along ``dim``,
        what a TP rank's GEMM receives) to ``merged``'s atoms."""
        sink = self.slice_sink(merged, dim, lo, hi)
        if sink is not None:
            self._keys.add(attach_grad_sink(part, sink))

    def _sink(self, spec: _Watched, cut: tuple[int, int, int] | None):
        shape = tuple(self._param(spec.name)[0].shape)  # the unsharded [N, K]: kernel rule
        sp_rows = self.plan is not None and self.plan.dims.sp > 1 and spec.stream == "img"

        def sink(dy: torch.Tensor, x: torch.Tensor, partials=None) -> None:
            dy3, x3 = sample_rows(dy), sample_rows(x)
            if dy3.shape[0] != len(spec.samples) or len(spec.branches) != len(spec.samples):
                raise DriftToolError(f"gradient ledger: {dy3.shape[0]} batch rows for {spec.name}, but "
                                     f"the scope names {len(spec.samples)} samples and "
                                     f"{len(spec.branches)} branches")
            family = "cpu" if partials is None else "cuda1"
            if family != "cpu" and (sp_rows or cut is not None):
                raise UnsupportedConfigError(
                    f"gradient ledger: {spec.name} under a TP/SP layout on the strict CUDA family: its "
                    "backward does not split a reduction across ranks (train TP/SP strict on the CPU)")
            if sp_rows:
                parts = None
            else:
                parts = sample_weight_grads(dy, x, shape) if partials is None else partials(dy, x)
            for i, (sid, br) in enumerate(zip(spec.samples, spec.branches)):
                self._file(spec.name, (sid, BRANCH_ORDER.get(str(br), 2)), family,
                           _Piece(part=None if parts is None else parts[i],
                                  rows=(dy3[i], x3[i]) if sp_rows else None, cut=cut), br)

        return sink

    def _file(self, name: str, key: tuple[int, int], family: str, piece: _Piece, branch: Any = None) -> None:
        """One atom of ``name`` for (sample, branch order) ``key``, from the CPU (contract v2) or
        the CUDA (``cuda1``) strict backward. Raises ``DriftToolError`` on a second atom of the key
        in one step, or atoms of both families for one weight."""
        if self._family.setdefault(name, family) != family:
            raise DriftToolError(f"gradient ledger: {name} got atoms of both the CPU and the "
                                 "CUDA strict backward")
        atoms = self._atoms.setdefault(name, {})
        if key in atoms:
            raise DriftToolError(f"gradient ledger: {name} got two gradients for sample {key[0]} branch "
                                 f"{branch if branch is not None else key[1]} in one step")
        atoms[key] = piece

    def tape(self) -> "GradLedger":
        """A ledger over the same adapted modules that keeps the atoms its sinks receive and files
        them nowhere: a CUDA graph capture's (``model.graphs_train``). The graph runs its sinks'
        Python once, at capture; the atoms' partials are then the backward graph's buffers, which
        every replay rewrites, and ``file_taken`` files them into the step's ledger after each.
        Raises ``UnsupportedConfigError`` under a TP/SP plan (an atom finished across ranks)."""
        if self.plan is not None:
            raise UnsupportedConfigError("gradient ledger: a graphed backward under a TP/SP plan")
        tape = copy.copy(self)  # the modules and their names, shared
        tape._atoms, tape.totals, tape.steps, tape.history = {}, {}, [], []
        tape._keys, tape._watched, tape._family = set(), {}, {}
        tape.group, tape.keep_atoms = None, False
        return tape

    def taken(self) -> list[tuple[str, tuple[int, int], str, torch.Tensor]]:
        """The atoms received so far, as (name, (sample, branch order), family, partial) (a
        tape's after its capture: the partials are the graph's buffers)."""
        return [(name, key, self._family[name], piece.part) for name in sorted(self._atoms)
                for key, piece in sorted(self._atoms[name].items())]

    def file_taken(self, taken: list[tuple[str, tuple[int, int], str, torch.Tensor]],
                   samples: dict[int, int] | None = None) -> None:
        """File a tape's atoms (``taken``) as this step's, each a copy of its partial (the graph's
        buffer is rewritten by the next replay), with a sink's checks (``_file``); ``samples``
        maps the tape's sample ids to this step's (a replay of the same rows for other samples)."""
        for name, (sid, branch), family, part in taken:
            key = (sid if samples is None else int(samples[sid]), branch)
            self._file(name, key, family, _Piece(part=part.clone()))

    def _finish_sp(self) -> None:
        """Image-stream atoms from the SP ranks' row partials (class docstring)."""
        plan = self.plan
        sp, me, group = plan.dims.sp, plan.coords["sp"], plan.groups.get("sp")
        n_img = int(plan.state["n_img"])
        lo, hi = sp_row_spans(n_img, sp)[me]
        names = sorted(n for n, a in self._atoms.items() if any(p.rows is not None for p in a.values()))
        live = {n: [live_rows(self._atoms[n][k].rows[0]) for k in sorted(self._atoms[n])] for n in names}
        ends = {n: [lo + r if r else 0 for r in rs] for n, rs in live.items()}  # one past the last live row
        every = all_gather_object(ends, group)
        for name in names:
            atoms = self._atoms[name]
            w = self._param(name)[0]
            exact = linear_is_exact(*w.shape)
            parts, owners = [], []
            for i, key in enumerate(sorted(atoms)):
                r = max(e[name][i] for e in every)  # the sample's live rows over every rank
                if -(-r // BLOCK) not in (0, -(-n_img // BLOCK)):
                    raise UnsupportedConfigError(
                        f"SP training: {name} sample {key[0]} has zero gradients in its last image "
                        f"blocks ({r} of {n_img} rows live): the row segments would not be the SP shards")
                spans = [shard_spans(row_segment_spans(r), sp, s) for s in range(sp)]
                owners.append([any(a < b for a, b in sp_) for sp_ in spans])
                dy, x = atoms[key].rows
                n = max(0, min(hi, r) - lo)
                part = outer_partial(dy[:n], x[:n], local_spans(spans[me]), exact=exact) if owners[-1][me] else None
                parts.append(torch.zeros(dy.shape[-1], x.shape[-1], dtype=torch.float32, device=dy.device)
                             if part is None else part)
            every_parts = gather_list(torch.stack(parts), group)
            for i, key in enumerate(sorted(atoms)):
                done = tree_finish([every_parts[s][i] if owners[i][s] else None for s in range(sp)])
                atoms[key] = _Piece(part=every_parts[0][i].new_zeros(every_parts[0][i].shape)
                                    if done is None else done, cut=atoms[key].cut)

    def _finish_tp(self) -> None:
        """Whole atoms from the TP ranks' slices, gathered in rank order (class docstring)."""
        group = self.plan.groups.get("tp")
        for name in sorted(self._atoms):
            atoms = self._atoms[name]
            cuts = {p.cut for p in atoms.values()}
            if cuts == {None}:
                continue
            if len(cuts) != 1:
                raise DriftToolError(f"gradient ledger: {name} got slices of different TP cuts")
            dim = next(iter(cuts))[0]
            keys = sorted(atoms)
            full = gather_cat(torch.stack([atoms[k].part for k in keys]), 1 + dim, group)
            for key, part in zip(keys, full):
                atoms[key] = _Piece(part=part)

    def _gather_atoms(self) -> None:
        """Every rank's atoms of the step on every rank of ``group``: their keys by an object
        gather, the partials by one ordered tensor gather per weight."""
        keys = {n: sorted(a) for n, a in self._atoms.items()}
        every = all_gather_object(keys, self.group)
        merged: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        for name in sorted({n for k in every for n in k}):
            w = self._param(name)[0]
            mine = [self._atoms.get(name, {})[k] for k in keys.get(name, [])]
            local = torch.stack(mine) if mine else torch.zeros(0, *w.shape, dtype=torch.float32, device=w.device)
            counts = [len(k.get(name, [])) for k in every]
            parts = gather_cat(local, 0, self.group, counts)
            atoms: dict[tuple[int, int], torch.Tensor] = {}
            for key, part in zip((tuple(k) for ks in every for k in ks.get(name, [])), parts):
                if key in atoms:
                    raise DriftToolError(f"gradient ledger: ranks hold the same atom {key} of {name}")
                atoms[key] = part
            merged[name] = atoms
        self._atoms = merged

    def close(self) -> None:
        """Detach every sink this ledger attached (``finish_step`` does it for the step's weights;
        a forward without a backward — a deterministic step — leaves its sinks until this call or
        the end of a ``with`` block)."""
        detach_grad_sinks(self._keys)
        self._keys.clear()
        self._watched.clear()  # a later weight on the same storage is not this step's

    def __enter__(self) -> "GradLedger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def finish_step(self, step: int) -> None:
        """Reduce the step's atoms (``tree_sum_stack`` in (sample, branch) order), add them to the
        totals (steps in order) and set every adapter factor's ``.grad`` from its total (one strict
        ``lora_merge`` backward; an unfused factor's total is its gradient). Factors of a weight
        that never got a gradient keep ``.grad``."""
        if self.plan is not None and self.plan.dims.sp > 1:
            self._finish_sp()
        if self.plan is not None and self.plan.dims.tp > 1:
            self._finish_tp()
        self._atoms = {n: {k: p.part for k, p in a.items()} for n, a in self._atoms.items()}
        if self.group is not None:
            self._gather_atoms()
        for name in sorted(self._atoms):
            atoms = self._atoms[name]
            g = tree_sum_stack([atoms[k] for k in sorted(atoms)])
            self.totals[name] = g if name not in self.totals else self.totals[name] + g
        self.close()
        if self.keep_atoms:
            self.history.append(self._atoms)
        self._atoms = {}
        self.steps.append(int(step))
        for name, total in self.totals.items():
            factor, unfused = self._param(name)
            if unfused:
                factor.grad = total.to(factor.dtype)
                continue
            m = self.modules[name]
            a, b = m.lora_A.weight, m.lora_B.weight
            if self._family.get(name) == "cuda1":  # the strict CUDA lora_merge's backward
                da, db = lora_grads_cuda(total, a.detach(), b.detach(), float(m.lora_scale))
            else:
                with torch.enable_grad():
                    merged = lora_merge_strict(m.weight.detach(), a, b, float(m.lora_scale))
                    da, db = torch.autograd.grad(merged, (a, b), total)
            a.grad, b.grad = da.to(a.dtype), db.to(b.dtype)
