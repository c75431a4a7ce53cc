"""A transformer forward replayed from CUDA graphs: the same kernels, the same bytes, no host.

    >>> fast = GraphedForward(model)                  # model: MMDiT on a CUDA device
    >>> v = fast(x, txt, txt_mask, tau, (64, 64), rt) # 1st call of a signature: eager (warm-up)
    >>> v = fast(x, txt, txt_mask, tau, (64, 64), rt) # 2nd: captured, then replayed; later: replayed

A strict forward at batch 1 launches about 3,100 Triton kernels; at 1024² the GPU finishes many of
them faster than Python can launch the next (tens of µs each), so the forward is host-bound.
Rollout steps repeat the same shapes, so each input signature (shapes, dtypes, mask presence,
grid, mode) is captured once in a ``torch.cuda.CUDAGraph`` and replayed: the GPU runs the
recorded launches with the recorded arguments, so its output is byte-equal to the eager forward
(``tests/gpu/test_cuda_graphs.py`` compares raw bytes).

What a replay keeps of an eager forward:

* **inputs** are copied into the graph's static buffers (``x``, ``txt``, ``txt_mask``, ``tau``,
  the edit pipelines' ``cond``);
  the returned velocity is a copy of the graph's output buffer (the next replay rewrites it);
* **the operator trace**: the capture logs every traced call in program order; after a replay
  they are counted again in bulk (``model.replay``), so call counters, sites and counts are
  those of an eager call;
* **capture records (L1, L2)**: the digest kernels of every captured output are part of the graph
  (``capture.recorder.record_parts``: the same row arithmetic on the same tensors, recorded about
  a block's outputs a launch, ``capture.gpu_row_batch``); after a replay the
  digests are read back at once (one host synchronisation per forward) and filed as one block of
  records built from a template of the forward (``model.replay.ReplayRecords``) under the
  replay's scope (step, sigma, branch), with the ``call`` and ``op_pos`` an eager call gets;
* **the text lane**: the captured forward runs each block's text-stream operators on a second
  CUDA stream (``drifttool.model.lanes``), which the graph keeps: a replay overlaps them with
  the image stream's, with the same kernels on the same tensors (``lanes=False``: one stream);
* **parameters** are read where they lie: a weight changed in place is seen by the next replay;
  a parameter that was replaced (another storage) makes the graphs stale, and they are captured
  anew (the parameters' addresses are compared at every call).

It runs eagerly, never graphed, where a graph would lose something: a parallel plan
(collectives), probe variants, autograd recording (training), a recorder that is not drifttool's
``Recorder``, or a device other than CUDA. The graphs are keyed by what the kernels and the
records' parts depend on: the shapes and dtypes, the grid, mode, capture level, and the scope's
pattern of samples (which rows share one; the ids are each replay's own), prompt lengths and text
starts (a trajectory repeats them at every step). The first
call of a signature always runs eagerly: it compiles the Triton kernels and fills the constant
caches (RoPE tables, eps scalars, sinusoid frequencies) that the graph then reads; the RoPE
tables of each signature are held alive by its graph.

Memory: each signature keeps its activations' peak in one private pool shared by all graphs of
this wrapper; ``reset()`` frees them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from drifttool.capture.gpu_row_batch import RowBatch
from drifttool.errors import UnsupportedConfigError
from drifttool.model.lanes import Lanes
from drifttool.model.replay import ReplayRecords, logging_runtime
from drifttool.model.rope import BACKEND_TABLES, rope_tables
from drifttool.runtime import Runtime


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor | None, ...]  # x, txt, txt_mask, tau, cond
    out: torch.Tensor
    records: ReplayRecords
    keep: tuple = field(default=(), repr=False)  # constants the graph reads (RoPE tables)


class SignatureGraphs:
    """Graphs of ``model`` by input signature: a signature's first call runs eagerly (the
    warm-up), its second captures (``_graph``), later ones replay; a replaced parameter (another
    storage) drops them all. Shared by ``GraphedForward`` and ``model.graphs_train.GraphedTraining``.

    Args:
        model: the model the graphs run.
        max_graphs: signatures kept at once; capturing one more drops the least recently
            replayed (its memory goes back; a trainer whose prompt lengths keep changing does not
            hold a graph per length).

    Attributes:
        captures: how many graphs were captured (a test and a benchmark read it).
        replays: how many calls were served by a replay.
        refused: why a capture was refused (an operation that synchronises with the host, say),
            or None. After one refusal this wrapper captures nothing more, ``reset`` included:
            every call runs eagerly (the same bytes), and a ``RuntimeWarning`` says so once. An
            out-of-memory error is raised.
    """

    def __init__(self, model: torch.nn.Module, *, max_graphs: int = 8) -> None:
        self.model = model
        self.max_graphs = int(max_graphs)
        self.captures = 0
        self.replays = 0
        self.refused: str | None = None
        self._seen: set[tuple] = set()
        self._graphs: OrderedDict[tuple, Any] = OrderedDict()
        self._params: tuple[int, ...] = ()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype (``sampling.step.sampler_model`` casts inputs to it)."""
        return self.model.dtype

    def capture_stream(self, device: torch.device) -> "torch.cuda.Stream":
        """The stream this wrapper captures on, one per device (whichever device is current;
        one stream, so graphs sharing a memory pool reuse each other's freed blocks)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    @staticmethod
    def _level(rt: Runtime) -> str | None:
        """The capture level whose records the forward makes: None at L0 or without capture."""
        level = getattr(rt.recorder, "level", None) if rt.mode.captures else None
        return None if level in (None, "L0") else level

    def reset(self) -> None:
        """Drop every graph (the next call of each signature is eager)."""
        self._seen.clear()
        self._graphs.clear()

    @staticmethod
    def _grids(img_grid: tuple[int, int], cond_grids: tuple[tuple[int, int], ...]
               ) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
        """``img_grid`` and ``cond_grids`` as tuples of Python ints (part of a signature)."""
        return tuple(int(v) for v in img_grid), tuple(tuple(int(v) for v in g) for g in cond_grids)

    def _kept_tables(self, grid: tuple[int, int], txt_len: int, cond_grids: tuple[tuple[int, int], ...],
                     rt: Runtime, device: torch.device) -> tuple:
        """The RoPE tables a graph of this signature reads (``model.rope.rope_tables``, from its
        cache after the warm-up), for the graph to hold alive: the cache may drop them, and a
        graph reads the addresses it captured. A model with tables of its own names them
        (``graph_constants(grid, txt_len, cond_grids, device)``: the diffusers adapter's)."""
        own = getattr(self.model, "graph_constants", None)
        if own is not None:
            return tuple(own(grid, txt_len, cond_grids, device))
        cfg = self.model.config
        return rope_tables(grid, txt_len, axes_dims=cfg.axes_dims_rope, theta=cfg.rope_theta,
                           algorithm=BACKEND_TABLES[rt.mode.family], device=device, cond_grids=cond_grids)

    def _graph(self, key: tuple, capture: Callable[[], Any]) -> Any | None:
        """The graph of signature ``key`` (``capture()`` makes it at the second call), or None at
        the first call (the caller runs the model eagerly: kernels compiled, caches filled) and
        after a refused capture."""
        params = tuple(p.data_ptr() for p in self.model.parameters())
        if params != self._params:  # a parameter was replaced: every graph reads stale memory
            if self._params:
                self.reset()
            self._params = params
        if self.refused is not None:
            return None
        g = self._graphs.get(key)
        if g is None:
            if key not in self._seen:
                self._seen.add(key)
                return None
            while len(self._graphs) >= max(1, self.max_graphs):
                self._graphs.popitem(last=False)  # the least recently replayed
            try:
                g = capture()
            except UnsupportedConfigError as e:  # not capturable: eager from now on
                self.refused = str(e)
                warnings.warn(f"{e}; the model runs eagerly from now on (the same bytes, without the "
                              "graphs' speed)", RuntimeWarning, stacklevel=3)
                return None
            self._graphs[key] = g
            self.captures += 1
        self._graphs.move_to_end(key)
        return g


def graph_use(fwd: Any) -> dict[str, Any] | None:
    """What a ``SignatureGraphs`` wrapper (``GraphedForward``, ``GraphedTraining``) did over a
    run, for its summary: ``{"captures": int, "replays": int, "refused": str | None}`` (a refused
    capture: the run went on eagerly, the same bytes, slower). None for anything else (a plain
    model: no graphs were tried, on the CPU say)."""
    if not isinstance(fwd, SignatureGraphs):
        return None
    return {"captures": fwd.captures, "replays": fwd.replays, "refused": fwd.refused}


@contextlib.contextmanager
def device_scalars():
    """Within a CUDA graph capture: ``torch.as_tensor`` and ``torch.tensor`` of one Python
    number (int, float, bool) on a CUDA device are filled there (``torch.full((), value)``, the
    dtype each infers) instead of copied from pageable host memory, a copy that a capture
    refuses. Diffusers' Qwen-Image forward makes one (a prompt length, in
    ``compute_text_seq_len_from_mask``); the value, a Python constant of the signature's shapes,
    is the same at every replay. Anything else is left to torch itself."""
    as_tensor, tensor = torch.as_tensor, torch.tensor

    def filled(make):
        def call(data, *args, dtype=None, device=None, **kwargs):
            if (not args and not kwargs and device is not None and type(data) in (int, float, bool)
                    and torch.device(device).type == "cuda"):
                return torch.full((), data, dtype=dtype, device=device)
            return make(data, *args, dtype=dtype, device=device, **kwargs)
        return call

    torch.as_tensor, torch.tensor = filled(as_tensor), filled(tensor)
    try:
        yield
    finally:
        torch.as_tensor, torch.tensor = as_tensor, tensor


def capture_refused(what: str, e: BaseException) -> UnsupportedConfigError:
    """The error for a refused capture of ``what``: it names the first error raised inside the
    capture (a failed capture often ends with CUDA's "operation failed due to a previous error
    during capture", which hides the operation that broke it), then the last."""
    first = e
    while isinstance(first.__context__, RuntimeError):
        first = first.__context__
    why = str(first).splitlines()[0] if str(first) else type(first).__name__
    if first is not e:
        why += f"; then: {str(e).splitlines()[0]}"
    return UnsupportedConfigError(f"CUDA graph capture of the {what} failed ({why})")


@contextlib.contextmanager
def stream_kept(device: torch.device):
    """Keep the current stream of ``device`` through a CUDA graph capture: when a capture fails,
    ``torch.cuda.graph`` may raise while ending it and leave its capture stream current."""
    before = torch.cuda.current_stream(device)
    try:
        yield
    except BaseException:
        torch.cuda.set_stream(before)
        raise


class GraphedForward(SignatureGraphs):
    """``model(x, txt, txt_mask, tau, img_grid, rt)`` replayed from one CUDA graph per input
    signature (module docstring).

    Args:
        model: an ``MMDiT`` (or a model with its forward signature, ``dtype`` and ``config``)
            whose parameters lie on one CUDA device.
        lanes: capture each block's text stream on a second CUDA stream (module docstring);
            False: on one stream.
        max_graphs: as ``SignatureGraphs``.
        batch_digests: record the row-kernel launches of the captured outputs a batch at a time
            (``capture.gpu_row_batch``: about a block's outputs a launch, the same tables);
            False: a launch per output.

    Attributes: as ``SignatureGraphs``.
    """

    def __init__(self, model: torch.nn.Module, *, lanes: bool = True, max_graphs: int = 8,
                 batch_digests: bool = True) -> None:
        super().__init__(model, max_graphs=max_graphs)
        self.lanes = lanes
        self.batch_digests = batch_digests
        self._lanes: Lanes | None = None
        self._pool: Any = None
        self._words: dict[tuple, int] = {}  # per signature: its batched launches' table words

    def reset(self) -> None:
        """Drop every graph and its memory pool (the next call of each signature is eager)."""
        super().reset()
        self._pool = None
        self._words.clear()

    @staticmethod
    def eligible(x: torch.Tensor, rt: Runtime) -> bool:
        """Whether a call can be replayed without losing anything (module docstring)."""
        rec = rt.recorder
        return (x.is_cuda and not torch.is_grad_enabled() and rt.plan is None and not rt.variants
                and rt.grad_ledger is None
                and (rec is None or not rt.mode.captures or callable(getattr(rec, "capture_digested", None))))

    def __call__(self, x: torch.Tensor, txt: torch.Tensor, txt_mask: torch.Tensor | None,
                 tau: torch.Tensor, img_grid: tuple[int, int], rt: Runtime, *,
                 cond: torch.Tensor | None = None, cond_grids: tuple[tuple[int, int], ...] = ()
                 ) -> torch.Tensor:
        """The model's forward (``MMDiT.forward``: shapes, dtypes, errors; ``cond`` the edit
        pipelines' condition latents), replayed when ``eligible``; returns v ``[B, N, out_dim]``
        in the model dtype (a fresh tensor)."""
        if not self.eligible(x, rt):
            return self.model(x, txt, txt_mask, tau, img_grid, rt, cond=cond, cond_grids=cond_grids)
        grid, cond_grids = self._grids(img_grid, cond_grids)
        key = signature(x, txt, txt_mask, tau, grid, cond, cond_grids, rt, self._level(rt))
        warm_up = self.refused is None and key not in self._seen
        g = self._graph(key, lambda: self._capture(x, txt, txt_mask, tau, grid, rt, cond, cond_grids, key))
        if g is None and warm_up and self._batched(rt):  # the batch's kernels compiled, its tables measured
            with RowBatch(defer=False) as batch:
                out = self.model(x, txt, txt_mask, tau, img_grid, rt, cond=cond, cond_grids=cond_grids)
            self._words[key] = batch.words
            return out
        if g is None:  # warm-up: compile kernels, fill constant caches
            return self.model(x, txt, txt_mask, tau, img_grid, rt, cond=cond, cond_grids=cond_grids)
        for static, new in zip(g.inputs, (x, txt, txt_mask, tau, cond)):
            if static is not None:
                static.copy_(new)
        g.graph.replay()
        self.replays += 1
        g.records.file(rt)  # the trace, counters and records an eager call would leave
        return g.out.clone()

    def _batched(self, rt: Runtime) -> bool:
        """Whether the captured outputs' row kernels are launched a batch at a time."""
        return self.batch_digests and self._level(rt) is not None

    def _capture(self, x, txt, txt_mask, tau, grid, rt: Runtime, cond, cond_grids, key: tuple) -> _Graph:
        keep = self._kept_tables(grid, txt.shape[1], cond_grids, rt, x.device)
        inputs = tuple(None if t is None else t.clone() for t in (x, txt, txt_mask, tau, cond))
        level = self._level(rt)
        quiet, log = logging_runtime(rt, level)
        if self.lanes and self._lanes is None:
            self._lanes = Lanes(x.device)
        quiet = replace(quiet, lanes=self._lanes if self.lanes else None)  # never a caller's lanes
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        words = self._words.get(key) if self._batched(rt) else None
        batch = contextlib.nullcontext() if words is None else \
            RowBatch(torch.empty(max(2, words), dtype=torch.int64, device=x.device))
        torch.cuda.synchronize(x.device)
        try:
            with torch.cuda.device(x.device), stream_kept(x.device), device_scalars(), \
                    torch.cuda.graph(graph, pool=self._pool, stream=self.capture_stream(x.device)), batch:
                out = self.model(*inputs[:4], grid, quiet, cond=inputs[4], cond_grids=cond_grids)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as e:  # an operation that synchronises with the host mid-forward
            raise capture_refused(f"{rt.mode.value} forward", e) from e
        if isinstance(batch, RowBatch):  # the launches' address tables, read at every replay
            batch.fill()
            keep = (*keep, *batch.keep)
        return _Graph(graph, inputs, out, ReplayRecords(log.calls, level), keep)


def graphable(model: Any) -> bool:
    """Whether ``model``'s forward may be replayed from CUDA graphs: it says so with a class
    attribute ``graphable = True`` (drifttool's ``MMDiT``; the diffusers adapter's
    ``adapters.diffusers_qwenimage.DiffusersQwenImage``), meaning its forward synchronises with
    no host and does nothing in Python that a replay, which runs none, would have to repeat
    beyond the trace and records ``GraphedForward`` files. A subclass that overrides ``forward``
    without declaring it again is not graphable (its forward may do what a replay skips)."""
    for cls in type(model).__mro__:
        if "graphable" in vars(cls):
            return bool(vars(cls)["graphable"])
        if "forward" in vars(cls) or "__call__" in vars(cls):
            return False
    return False


def signature(x: torch.Tensor, txt: torch.Tensor, txt_mask: torch.Tensor | None, tau: torch.Tensor,
              grid: tuple[int, int], cond: torch.Tensor | None, cond_grids: tuple[tuple[int, int], ...],
              rt: Runtime, level: str | None) -> tuple:
    """What a recorded forward's kernels and records depend on, as a dict key: the inputs' shapes
    and dtypes, mask presence, grid, device, mode, capture ``level``, whether the fused operators
    expose their internals (``Runtime.wants_internals``) and the scope's pattern of samples
    (``sample_pattern``), prompt lengths and text starts."""
    scope = rt.current_scope()
    return (tuple(x.shape), x.dtype, tuple(txt.shape), txt.dtype,
            None if txt_mask is None else txt_mask.dtype, tuple(tau.shape), tau.dtype, grid,
            None if cond is None else (tuple(cond.shape), cond.dtype), cond_grids,
            str(x.device), rt.mode, rt.family, rt.rank, frozenset(rt.unavailable), level,
            rt.wants_internals(), sample_pattern(scope["samples"]),
            *(scope_key(scope[k]) for k in ("component", "txt_lens", "txt_starts", "img_grid", "cond_grids")))


def sample_pattern(samples: Any) -> tuple[int, ...] | None:
    """Which batch rows of a forward share a logical sample: per row, the first row of its sample
    (``[7, 9, 7]`` → ``(0, 1, 0)``; None without sample ids). The part of the scope's sample
    ids a recorded forward depends on: a replay files its own scope's ids (records,
    ``model.replay``; gradient-ledger atoms, ``model.graphs_train``), so a trainer's or a
    GRPO loop's fresh samples reuse the graphs of the same shapes."""
    if samples is None:
        return None
    first: dict[int, int] = {}
    return tuple(first.setdefault(int(s), i) for i, s in enumerate(samples))


def scope_key(v: Any) -> Any:
    """A scope value as a dict key (lists → tuples)."""
    return tuple(scope_key(x) for x in v) if isinstance(v, (list, tuple)) else v
