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
(review 2026-12; issue #12 item 4).

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

How. ``drifttool.model.lora.adapted_weight`` hands every merged weight it builds with autograd on
to ``watch`` with the call's identity scope (the samples and per-row branches of the batch rows);
``watch`` attaches a sink to it (``grad.attach_grad_sink``, by storage: a checkpointed
recomputation's detached aliases find it too), and the strict GEMM backward gives the sink
its per-row partials instead of reducing them (returning no gradient to autograd for W', so
autograd adds nothing for it). Production GEMMs carry no sinks: the ledger is for the strict
family only (``recompute`` uses it in strict mode).

Raises ``DriftToolError`` when an atom arrives twice in a step (one weight used twice for the
same sample and branch: not a layout the ledger can order).
"""

from __future__ import annotations

from typing import Any

import torch

from drifttool.distributed.canonical import gather_cat
from drifttool.distributed.collectives import all_gather_object
from drifttool.errors import DriftToolError
from drifttool.model.lora import lora_modules
from drifttool.ops.lora import lora_merge_strict
from drifttool.ops.strict.grad import attach_grad_sink, detach_grad_sinks
from drifttool.ops.strict_trees import tree_sum_stack

BRANCH_ORDER = {"cond": 0, "uncond": 1}
"""Order of a sample's CFG branches among its atoms."""


class GradLedger:
    """Per-step atoms and the accumulated canonical gradient of every adapted weight of ``model``.

    Attributes:
        totals: module name → accumulated dL/dW' [out, in] FP32 (D_t after ``finish_step``).
        steps: the steps finished, in order.
        history: with ``keep_atoms``, each finished step's atoms (module name → {(sample,
            branch order): partial}); empty otherwise.
        group: the process group whose ranks hold the other atoms (CFG-parallel branches,
            sample-parallel samples); ``finish_step`` gathers every rank's atoms first (exact
            moves), so every rank reduces the same list. ``None``: one process.
    """

    def __init__(self, model: torch.nn.Module, *, keep_atoms: bool = False, group: Any = None) -> None:
        self.modules = lora_modules(model)
        self._names = {id(m): n for n, m in self.modules.items()}
        self._atoms: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        self.totals: dict[str, torch.Tensor] = {}
        self.steps: list[int] = []
        self._keys: set[tuple] = set()
        self.group = group
        self.keep_atoms = keep_atoms
        self.history: list[dict[str, dict[tuple[int, int], torch.Tensor]]] = []

    def watch(self, module: torch.nn.Module, merged: torch.Tensor, scope: dict[str, Any]) -> None:
        """Collect the per-row gradient partials of ``merged`` (the adapted weight of ``module``,
        built in the identity ``scope``: ``samples`` one id per batch row, ``branch`` one name or
        one per row). Nothing is attached when autograd is off or the module is not adapted."""
        name = self._names.get(id(module))
        if name is None or not (torch.is_grad_enabled() and merged.requires_grad):
            return
        samples = list(scope.get("samples") or [])
        branch = scope.get("branch")
        branches = [branch] * len(samples) if isinstance(branch, str) else list(branch or [])

        def sink(parts: list[torch.Tensor]) -> None:
            if len(parts) != len(samples) or len(branches) != len(samples):
                raise DriftToolError(f"gradient ledger: {len(parts)} batch rows for {name}, but the "
                                     f"scope names {len(samples)} samples and {len(branches)} branches")
            atoms = self._atoms.setdefault(name, {})
            for part, sid, br in zip(parts, samples, branches):
                key = (int(sid), BRANCH_ORDER.get(str(br), 2))
                if key in atoms:
                    raise DriftToolError(f"gradient ledger: {name} got two gradients for sample "
                                         f"{sid} branch {br} in one step")
                atoms[key] = part

        self._keys.add(attach_grad_sink(merged, sink))

    def _gather_atoms(self) -> None:
        """Every rank's atoms of the step on every rank of ``group``: their keys by an object
        gather, the partials by one ordered tensor gather per weight."""
        keys = {n: sorted(a) for n, a in self._atoms.items()}
        every = all_gather_object(keys, self.group)
        merged: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        for name in sorted({n for k in every for n in k}):
            w = self.modules[name].weight
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

    def __enter__(self) -> "GradLedger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def finish_step(self, step: int) -> None:
        """Reduce the step's atoms (``tree_sum_stack`` in (sample, branch) order), add them to the
        totals (steps in order) and set every adapter factor's ``.grad`` from its total (one strict
        ``lora_merge`` backward). Factors of a weight that never got a gradient keep ``.grad``."""
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
            m = self.modules[name]
            a, b = m.lora_A.weight, m.lora_B.weight
            with torch.enable_grad():
                merged = lora_merge_strict(m.weight.detach(), a, b, float(m.lora_scale))
                da, db = torch.autograd.grad(merged, (a, b), total)
            a.grad, b.grad = da.to(a.dtype), db.to(b.dtype)
