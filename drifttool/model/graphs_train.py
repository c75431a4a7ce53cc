"""A training forward and its backward, each replayed from a CUDA graph: the same kernels, the
same bytes, no host.

    >>> fast = GraphedTraining(model)                  # MMDiT with trainable (LoRA) parameters, on CUDA
    >>> with torch.enable_grad():
    ...     v = fast(x, txt, txt_mask, tau, (64, 64), rt)   # 1st call of a signature: eager (warm-up)
    ...     (v.float() * g).sum().backward()                # the parameters' .grad, as eager
    ...     v = fast(x, txt, txt_mask, tau, (64, 64), rt)   # 2nd: captured, then replayed
    ...     (v.float() * g).sum().backward()                # the backward graph replayed

A strict training step at batch 1 launches about 10,000 kernels, and Python launches them more
slowly than the GPU runs them: the step is bound by the host (docs/benchmarks.md, "A LoRA training
step"). A trainer repeats the same shapes at every step, so each input signature's forward
(autograd recording, gradient checkpointing as the model is set) is captured in one
``torch.cuda.CUDAGraph`` and the backward of its output, into every parameter that requires a
gradient, in a second one (the scheme of ``torch.cuda.make_graphed_callables``, whose warm-up and
input handling this wrapper does its own way). The returned velocity is an autograd output: a
loss built on it in eager code backpropagates through the backward graph, and the parameters'
``.grad`` receive what the eager backward gives them, byte for byte
(``tests/gpu/test_graphed_training_cuda.py``).

What a replay keeps of an eager call:

* **inputs** are copied into the graphs' static buffers; the returned velocity is a copy of the
  forward graph's output, and the gradients handed to autograd are copies of the backward
  graph's (autograd accumulates them into ``.grad`` as it would the eager ones);
* **the operator trace and capture records (L1, L2)**: logged at capture; after each forward
  replay the trace is counted again in bulk and the records' digests, computed inside the graph,
  are read back and filed under the replay's scope (``model.replay``), as ``GraphedForward``
  does (the backward's recomputations of checkpointed blocks record nothing, as eagerly);
* **the gradient ledger's atoms** (strict training, ``training.ledger``): the ledger's sinks
  are Python that the backward calls with each adapted weight's per-sample partials. At capture
  they run once, on a tape (``GradLedger.tape``) whose atoms are the backward graph's buffers;
  after each backward replay those are filed, copied, into the ledger of the replayed call's
  runtime (``GradLedger.file_taken``) under the replay's sample ids, as its eager backward would
  have filed them. The CFG branches and the pattern of samples are part of the signature (an
  atom's key; ``graphs.sample_pattern``), so fresh samples of the same shapes replay;
* **one forward, then its backward**: the backward graph reads the activations the last forward
  replay left in the graph's memory. A second call of the same signature before the first
  call's backward ran (sequential CFG branches before one backward, say) runs eagerly, so nothing
  is overwritten that a pending backward still needs; a second backward through one replay
  (``retain_graph=True``) raises ``UnsupportedConfigError`` (the backward graph frees what it reads).

It runs eagerly, never graphed, where a graph would lose something or cannot hold: no autograd
recording, no parameter requiring a gradient, an input that wants a gradient (the backward graph
computes the parameters' only), a hook on a trainable parameter, a parallel plan, probe variants,
a recorder that is not drifttool's, or a device other than CUDA. The graphs run on one stream of the
model's device (a caller's text lane is not used). The first call of a signature runs eagerly
(it compiles the kernels and fills the constant caches); the second runs one more eager forward
and backward on a side stream (the backward kernels' compilation, whatever the caller did with
the first call's output), then captures both graphs and replays them. The model's activation
checkpointing is part of the signature (a checkpointed backward recomputes each block inside the
backward graph). While the autograd graph of a velocity it returned lives (micro-batches run
before one backward, a loss kept), it holds the parameters' gradient accumulators with the stream
they last ran on, and a capture would wait on that stream, which CUDA refuses ("operation would
make the legacy stream depend on a capturing blocking stream"): a signature's capture therefore
waits for a call at which none lives, and the calls until then run eagerly (a warning says so
after ``WAITS_BEFORE_WARNING`` such calls), unless torch can redirect such a stream to the
capturing one (``stale_streams_redirected``: then it captures at once). Graphs the caller keeps
alive otherwise can still make a capture be refused (the wrapper then runs eagerly).

Memory: each signature keeps its own pool (the forward's saved activations live there between a
forward replay and its backward), about the eager step's peak; ``reset()`` frees them. With a
gradient ledger the atoms are held twice, in the pool and as the ledger's copies: small for the
unfused adapter's factors, an FP32 ``[out, in]`` per adapted weight and row for a merged one.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.model.graphs import SignatureGraphs, capture_refused, scope_key, signature, stream_kept
from drifttool.model.replay import ReplayRecords, logging_runtime
from drifttool.runtime import Runtime


@dataclass
class _Graphs:
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor | None, ...]  # x, txt, txt_mask, tau, cond
    out: torch.Tensor
    grad_out: torch.Tensor
    grads: tuple[torch.Tensor | None, ...]  # per trainable parameter; None: unused by the forward
    records: ReplayRecords
    pool: Any
    keep: tuple = field(default=(), repr=False)  # constants the graphs read (RoPE tables)
    taken: list = field(default_factory=list)  # the gradient ledger's atoms: (name, key, family, buffer)
    samples: tuple | None = None  # the capture's sample ids (the atoms' keys), one per batch row
    pending: int = 0  # forward replays whose backward is still to come (0 or 1)
    generation: int = 0  # forward replays so far


class _Replay(torch.autograd.Function):
    """The forward graph's replay as an autograd node whose backward replays the backward graph."""

    @staticmethod
    def forward(ctx, g: _Graphs, ledger: Any, samples: dict | None, *params: torch.Tensor) -> torch.Tensor:
        g.forward.replay()
        g.generation += 1
        g.pending += 1
        ctx.graphs, ctx.generation, ctx.live, ctx.ledger, ctx.samples = g, g.generation, [True], ledger, samples
        weakref.finalize(ctx, _done, g, ctx.live)  # an output dropped without its backward
        return g.out.detach().clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        g = ctx.graphs
        if not ctx.live[0] or ctx.generation != g.generation:  # retain_graph=True, a second backward
            raise UnsupportedConfigError(
                "a second backward through a graphed training forward: the backward graph frees "
                "the activations it reads (run the model itself to backpropagate twice)")
        _done(g, ctx.live)
        g.grad_out.copy_(grad)
        g.backward.replay()
        if ctx.ledger is not None:  # the atoms the eager backward's sinks would have filed
            ctx.ledger.file_taken(g.taken, ctx.samples)
        return None, None, None, *(None if t is None else t.clone() for t in g.grads)


WAITS_BEFORE_WARNING = 16
"""Calls a signature's capture may wait (``GraphedTraining``) before a warning says why."""


def _redirect_api() -> tuple[Any, Any] | None:
    """torch's setter and getter of the stale-stream redirect, where it has them."""
    setter = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    getter = getattr(torch._C, "_override_stale_capture_stream", None)
    return None if setter is None or getter is None else (setter, getter)


@contextlib.contextmanager
def stale_streams_redirected():
    """Around a capture of a training step: the autograd graphs nobody holds are collected first
    (reference cycles included), and, where torch offers it
    (``torch.autograd.graph.set_override_stale_capture_stream``: torch 2.13 has it), a node
    that still holds a stream other than the capturing one (a parameter's gradient accumulator
    kept alive by an earlier step's graph: the default stream) is redirected to the capturing
    stream instead of making the default stream wait on the capture, which CUDA refuses ("would
    make the legacy stream depend on a capturing blocking stream"). The redirect orders that
    node's work on the capturing stream, where its producer ran: the same kernels on the same
    tensors. torch's own setting is restored after."""
    gc.collect()
    api = _redirect_api()
    if api is None:
        yield
        return
    setter, getter = api
    before = bool(getter())
    setter(True)
    try:
        yield
    finally:
        setter(before)


def _done(g: _Graphs, live: list[bool]) -> None:
    """One forward replay's activations are no longer needed (its backward ran, or its autograd
    node was freed)."""
    if live[0]:
        live[0] = False
        g.pending -= 1


class _Alive:
    """A mark on the autograd node of a returned velocity (``GraphedTraining._tracked``)."""


class GraphedTraining(SignatureGraphs):
    """``model(x, txt, txt_mask, tau, img_grid, rt)`` under autograd, its forward and backward
    replayed from one pair of CUDA graphs per input signature (module docstring).

    Args:
        model: an ``MMDiT`` (or a model with its forward signature and ``config``) whose
            parameters lie on one CUDA device; the trainable ones are those with
            ``requires_grad``.
        max_graphs: signatures kept at once, each with its own memory pool (``SignatureGraphs``).

    Attributes: as ``SignatureGraphs`` (``captures`` counts signatures, ``replays`` forward
    replays, ``refused`` why a capture was refused, after which every call runs eagerly);
    ``reset()`` also frees the graphs' memory pools.
    """

    def __init__(self, model: torch.nn.Module, *, max_graphs: int = 8) -> None:
        super().__init__(model, max_graphs=max_graphs)
        self._outputs: list[weakref.ref] = []  # one per returned velocity whose graph may live
        self._waits = 0  # calls whose capture waited (``_waits_for_capture``)

    def _held(self) -> bool:
        """Whether the autograd graph of a velocity this wrapper returned still lives (a loss
        not yet backpropagated, say): it holds the parameters' gradient accumulators with the
        stream they ran on, so a capture now would be refused (module docstring)."""
        self._outputs = [r for r in self._outputs if r() is not None]
        return bool(self._outputs)

    def _waits_for_capture(self, key: tuple) -> bool:
        """Whether the capture of signature ``key``, due at this call, waits: an earlier
        output's graph lives (``_held``) and torch cannot redirect its stream
        (``stale_streams_redirected``). After ``WAITS_BEFORE_WARNING`` waits a warning says so
        once (a loop that keeps the last step's loss while it runs the next never captures)."""
        if key not in self._seen or key in self._graphs or _redirect_api() is not None or not self._held():
            return False
        self._waits += 1
        if self._waits == WAITS_BEFORE_WARNING:
            warnings.warn(
                f"the graphed training step ran {WAITS_BEFORE_WARNING} calls eagerly (the same "
                "bytes) instead of capturing them: at each, the autograd graph of a velocity it "
                "returned earlier was still alive (micro-batches before one backward, or the last "
                "step's loss kept), which this torch cannot capture beside; drop or detach earlier "
                "outputs and losses before the next call to replay graphs",
                RuntimeWarning, stacklevel=3)
        return True

    def _tracked(self, v: torch.Tensor) -> torch.Tensor:
        """``v``, its autograd node marked so that ``_held`` sees while it lives."""
        if v.grad_fn is not None:
            mark = _Alive()
            v.grad_fn.metadata["drifttool.graphs_train"] = mark  # lives and dies with the node
            self._outputs.append(weakref.ref(mark))
        return v

    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters the backward graph computes gradients for, in ``parameters()`` order."""
        return [p for p in self.model.parameters() if p.requires_grad]

    @staticmethod
    def eligible(x: torch.Tensor, rt: Runtime, inputs: tuple = (), params: list = ()) -> bool:
        """Whether a call can be replayed without losing anything (module docstring): also no
        input that wants a gradient (the backward graph computes the parameters' only) and no
        hook on a trainable parameter (a capture would run it into the graph and autograd again
        at each replay)."""
        rec, ledger = rt.recorder, rt.grad_ledger
        return (x.is_cuda and torch.is_grad_enabled() and not torch.is_autocast_enabled("cuda")
                and rt.plan is None and not rt.variants
                and (ledger is None or callable(getattr(ledger, "tape", None)))
                and (rec is None or not rt.mode.captures or callable(getattr(rec, "capture_digested", None)))
                and not any(t is not None and t.requires_grad for t in inputs)
                and not any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
                            for p in params))

    def __call__(self, x: torch.Tensor, txt: torch.Tensor, txt_mask: torch.Tensor | None,
                 tau: torch.Tensor, img_grid: tuple[int, int], rt: Runtime, *,
                 cond: torch.Tensor | None = None, cond_grids: tuple[tuple[int, int], ...] = ()
                 ) -> torch.Tensor:
        """The model's forward (``MMDiT.forward``: shapes, dtypes, errors), replayed when
        ``eligible`` and not pending (module docstring); returns v ``[B, N, out_dim]`` in the
        model dtype (a fresh tensor with an autograd history)."""
        params = self.trainable()
        if not params or not self.eligible(x, rt, (x, txt, tau, cond), params):
            return self.model(x, txt, txt_mask, tau, img_grid, rt, cond=cond, cond_grids=cond_grids)
        grid, cond_grids = self._grids(img_grid, cond_grids)
        key = (*signature(x, txt, txt_mask, tau, grid, cond, cond_grids, rt, self._level(rt)),
               scope_key(rt.current_scope().get("branch")), rt.grad_ledger is not None,
               bool(getattr(self.model, "gradient_checkpointing", False)),
               tuple(id(p) for p in params))
        if self._waits_for_capture(key):  # micro-batches before one backward, say: eager until then
            return self._tracked(self.model(x, txt, txt_mask, tau, img_grid, rt, cond=cond, cond_grids=cond_grids))
        g = self._graph(key, lambda: self._capture(x, txt, txt_mask, tau, grid, rt, cond, cond_grids, params))
        # warm-up (compile kernels, fill constant caches), or the last replay's backward has not
        # run (its activations must stay)
        if g is None or g.pending:
            return self._tracked(self.model(x, txt, txt_mask, tau, img_grid, rt, cond=cond, cond_grids=cond_grids))
        for static, new in zip(g.inputs, (x, txt, txt_mask, tau, cond)):
            if static is not None:
                static.copy_(new)
        ids = rt.current_scope().get("samples")  # the replay's sample ids for the capture's, row by row
        ids = None if g.samples is None else {c: int(r) for c, r in zip(g.samples, ids)}
        v = _Replay.apply(g, rt.grad_ledger, ids, *params)
        self.replays += 1
        g.records.file(rt)  # the trace and counters an eager call would leave
        return self._tracked(v)

    def _capture(self, x, txt, txt_mask, tau, grid, rt: Runtime, cond, cond_grids,
                 params: list[torch.nn.Parameter]) -> _Graphs:
        keep = self._kept_tables(grid, txt.shape[1], cond_grids, rt, x.device)
        inputs = tuple(None if t is None else t.detach().clone() for t in (x, txt, txt_mask, tau, cond))

        def forward(run_rt: Runtime) -> torch.Tensor:
            return self.model(*inputs[:4], grid, run_rt, cond=inputs[4], cond_grids=cond_grids)

        device = x.device
        with torch.cuda.device(device):
            return self._capture_on(device, forward, inputs, rt, params, keep)

    def _capture_on(self, device: torch.device, forward, inputs, rt: Runtime, params, keep) -> _Graphs:
        ledger, level = rt.grad_ledger, self._level(rt)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        warm = None if ledger is None else ledger.tape()  # its atoms are dropped
        try:
            with torch.cuda.stream(side):  # the backward's kernels compiled, its caches filled
                out = forward(replace(logging_runtime(rt, level)[0], lanes=None, grad_ledger=warm))
                torch.autograd.grad(out, params, torch.zeros_like(out), allow_unused=True)
                del out
        finally:
            if warm is not None:
                warm.close()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-ups' cached blocks: a capture's pool cannot take them
        quiet, log = logging_runtime(rt, level)
        tape = None if ledger is None else ledger.tape()
        quiet = replace(quiet, lanes=None, grad_ledger=tape)  # one stream (never a caller's lanes)
        pool = torch.cuda.graph_pool_handle()
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # both on one stream of the model's device: the backward's ops run on their forward ops' stream
        stream = self.capture_stream(device)
        try:
            with stale_streams_redirected():
                with stream_kept(device), torch.cuda.graph(fwd, pool=pool, stream=stream):
                    out = forward(quiet)
                grad_out = torch.empty_like(out)
                with stream_kept(device), torch.cuda.graph(bwd, pool=pool, stream=stream):
                    grads = torch.autograd.grad(out, params, grad_out, allow_unused=True)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as e:  # an operation that synchronises with the host
            raise capture_refused(f"{rt.mode.value} training step", e) from e
        finally:
            if tape is not None:
                tape.close()  # its sinks ran at capture; a replay runs no Python
        samples = rt.current_scope().get("samples")
        return _Graphs(fwd, bwd, inputs, out.detach(), grad_out, grads, ReplayRecords(log.calls, level),
                       pool, keep, [] if tape is None else tape.taken(),
                       None if samples is None else tuple(int(s) for s in samples))
