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

* **inputs** are copied into the graph's static buffers (``x``, ``txt``, ``txt_mask``, ``tau``);
  the returned velocity is a copy of the graph's output buffer (the next replay rewrites it);
* **the operator trace**: the capture logs every traced call in program order; a replay records
  them again through ``rt.site``, so call counters, sites and counts are those of an eager call;
* **parameters** are read where they lie: a weight changed in place is seen by the next replay;
  a parameter that was replaced (another storage) makes the graphs stale, and they are captured
  anew (the parameters' addresses are compared at every call).

It runs eagerly, never graphed, where a graph would lose something: a recorder that captures
per-operator records (L1, L2: their identities and read-backs are host work per call), a
parallel plan (collectives), probe variants, autograd recording (training), or a device other
than CUDA. The first call of a signature always runs eagerly: it compiles the Triton kernels and
fills the constant caches (RoPE tables, eps scalars, sinusoid frequencies) that the graph then
reads; the RoPE tables of each signature are held alive by its graph.

Memory: each signature keeps its activations' peak in one private pool shared by all graphs of
this wrapper; ``reset()`` frees them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from drifttool.capture.trace import OperatorTrace
from drifttool.errors import UnsupportedConfigError
from drifttool.model.rope import BACKEND_TABLES, rope_tables
from drifttool.runtime import Runtime


class _LoggingTrace(OperatorTrace):
    """An operator trace that also logs every ``record`` call, in order (the capture's)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, int, dict[str, Any]]] = []

    def record(self, *, site: dict[str, Any], **kw: Any) -> None:
        super().record(site=site, **kw)
        self.log.append((site["op"], site["stream"], site["block"], kw))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]
    out: torch.Tensor
    log: list[tuple[str, str, int, dict[str, Any]]]
    keep: tuple = field(default=(), repr=False)  # constants the graph reads (RoPE tables)


class GraphedForward:
    """``model(x, txt, txt_mask, tau, img_grid, rt)`` replayed from one CUDA graph per input
    signature (module docstring).

    Args:
        model: an ``MMDiT`` (or a model with its forward signature, ``dtype`` and ``config``)
            whose parameters lie on one CUDA device.

    Attributes:
        captures: how many graphs were captured (a test and a benchmark read it).
        replays: how many calls were served by a replay.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.captures = 0
        self.replays = 0
        self._seen: set[tuple] = set()
        self._graphs: dict[tuple, _Graph] = {}
        self._pool: Any = None
        self._params: tuple[int, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def reset(self) -> None:
        """Drop every graph and its memory pool (the next call of each signature is eager)."""
        self._seen.clear()
        self._graphs.clear()
        self._pool = None

    @staticmethod
    def eligible(x: torch.Tensor, rt: Runtime) -> bool:
        """Whether a call can be replayed without losing anything (module docstring)."""
        level = getattr(rt.recorder, "level", None)
        return (x.is_cuda and not torch.is_grad_enabled() and rt.plan is None and not rt.variants
                and rt.grad_ledger is None and (rt.recorder is None or level == "L0" or not rt.mode.captures))

    def __call__(self, x: torch.Tensor, txt: torch.Tensor, txt_mask: torch.Tensor | None,
                 tau: torch.Tensor, img_grid: tuple[int, int], rt: Runtime) -> torch.Tensor:
        """The model's forward (``MMDiT.forward``: shapes, dtypes, errors), replayed when
        ``eligible``; returns v ``[B, N, out_dim]`` in the model dtype (a fresh tensor)."""
        if not self.eligible(x, rt):
            return self.model(x, txt, txt_mask, tau, img_grid, rt)
        grid = tuple(int(v) for v in img_grid)
        key = (tuple(x.shape), x.dtype, tuple(txt.shape), txt.dtype,
               None if txt_mask is None else txt_mask.dtype, tuple(tau.shape), tau.dtype, grid,
               str(x.device), rt.mode, rt.family, rt.rank, rt.current_scope()["component"],
               frozenset(rt.unavailable))
        params = tuple(p.data_ptr() for p in self.model.parameters())
        if params != self._params:  # a parameter was replaced: every graph reads stale memory
            self.reset()
            self._params = params
        g = self._graphs.get(key)
        if g is None:
            if key not in self._seen:  # warm-up: compile kernels, fill constant caches
                self._seen.add(key)
                return self.model(x, txt, txt_mask, tau, img_grid, rt)
            g = self._graphs[key] = self._capture(x, txt, txt_mask, tau, grid, rt)
        for static, new in zip(g.inputs, (x, txt, txt_mask, tau)):
            if static is not None:
                static.copy_(new)
        g.graph.replay()
        self.replays += 1
        for op, stream, block, kw in g.log:  # the trace an eager call would leave
            rt.trace.record(site=rt.site(op, stream, block=block), **kw)
        return g.out.clone()

    def _capture(self, x, txt, txt_mask, tau, grid, rt: Runtime) -> _Graph:
        cfg = self.model.config
        keep = rope_tables(grid, txt.shape[1], axes_dims=cfg.axes_dims_rope, theta=cfg.rope_theta,
                           algorithm=BACKEND_TABLES[rt.mode.family], device=x.device)
        inputs = (x.clone(), txt.clone(), None if txt_mask is None else txt_mask.clone(), tau.clone())
        log = _LoggingTrace()
        quiet = dataclasses.replace(rt, recorder=None, trace=log, _scope=rt.current_scope(), _calls={})
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(x.device)
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.model(*inputs, grid, quiet)
        except RuntimeError as e:  # an operation that synchronises with the host mid-forward
            raise UnsupportedConfigError(
                f"CUDA graph capture of the {rt.mode.value} forward failed ({str(e).splitlines()[0]}); "
                "run it eagerly (call the model itself)") from e
        self.captures += 1
        return _Graph(graph, inputs, out, log.log, keep)
