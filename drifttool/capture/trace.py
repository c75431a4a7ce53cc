"""Operator trace (``qwenimage_operator_trace``): one entry per call site.

A call site is (rank, component, op, block, stream, call occurrence) — the same site across
steps and branches is one entry with a call count; each rank keeps its own entries. Each entry
keeps the device the operator ran on, the requested and actual backend, kernel identity,
arithmetic contract id, and fallback state with its reason.

    rank device site                                requested actual kernel               fallback
    0    cpu    block=3 stream=img op=qkv_bias_gemm strict    strict cpu.tiled_bmm16.k128 False
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from drifttool.errors import UnsupportedConfigError


@dataclass(kw_only=True)
class TraceEntry:
    rank: int
    device: str
    component: str
    op: str
    block: int
    stream: str
    call: int
    contract: str
    requested: str
    actual: str
    kernel: str
    fallback: bool
    reason: str
    declared: bool
    calls: int = 1


def _same_backend(e: TraceEntry, actual: str, kernel: str, fallback: bool, device: str) -> bool:
    """Whether a call of ``e``'s site ran where and as ``e`` says (then it only counts)."""
    return (e.actual, e.kernel, e.fallback, e.device) == (actual, kernel, fallback, device)


class OperatorTrace:
    """Accumulates trace entries keyed by call site."""

    def __init__(self) -> None:
        self._entries: dict[tuple, TraceEntry] = {}

    def record(
        self,
        *,
        site: dict[str, Any],
        contract: str,
        requested: str,
        actual: str,
        kernel: str,
        fallback: bool,
        reason: str,
        declared: bool,
        device: str = "cpu",
        rank: int | None = None,
    ) -> None:
        """Count one call of ``site`` (``Runtime.site``).

        Args:
            device: where the operator ran (``str(tensor.device)``: ``"cpu"``, ``"cuda:0"``).
            rank: the calling rank; ``None`` takes ``site["rank"]`` (0 when absent).
        """
        rank = int(site.get("rank", 0) if rank is None else rank)
        key = (rank, site.get("component", "mmdit"), site.get("op"), site.get("block", -1),
               site.get("stream", "none"), site.get("call", 0))
        self._count(key, contract=contract, requested=requested, actual=actual, kernel=kernel,
                    fallback=fallback, reason=reason, declared=declared, device=device)

    def record_calls(self, keys: list[tuple], fields: list[dict[str, Any]]) -> None:
        """Count many calls at once, as ``record`` would one by one (a replayed forward's,
        ``drifttool.model.replay``): ``keys`` the sites ``(rank, component, op, block, stream,
        call)``, ``fields`` each call's other arguments of ``record`` (``device`` included)."""
        entries = self._entries
        for key, kw in zip(keys, fields, strict=True):
            e = entries.get(key)
            if e is not None and _same_backend(e, kw["actual"], kw["kernel"], kw["fallback"],
                                               kw.get("device", "cpu")):
                e.calls += 1  # the common case, without ``_count``'s argument binding
            else:
                self._count(key, **kw)

    def _count(self, key: tuple, *, contract: str, requested: str, actual: str, kernel: str,
               fallback: bool, reason: str, declared: bool, device: str = "cpu") -> None:
        entry = self._entries.get(key)
        if entry is None:
            rank, component, op, block, stream, call = key
            self._entries[key] = TraceEntry(
                rank=rank, device=device, component=component, op=op, block=block,
                stream=stream, call=call, contract=contract, requested=requested,
                actual=actual, kernel=kernel, fallback=fallback, reason=reason,
                declared=declared,
            )
            return
        entry.calls += 1
        if not _same_backend(entry, actual, kernel, fallback, device):
            # A site that changes backend or device between calls is itself a finding: keep the
            # latest backend and device, and the worst fallback state.
            entry.actual, entry.kernel, entry.device = actual, kernel, device
            entry.fallback = entry.fallback or fallback
            entry.reason = entry.reason or reason

    def entries(self) -> list[TraceEntry]:
        return list(self._entries.values())

    def rows(self) -> list[dict[str, Any]]:
        """Entries as ``TRACE_SCHEMA`` rows (rank, device, component, site, backend, kernel, …)."""
        return [asdict(e) for e in self._entries.values()]

    def check_strict(self) -> None:
        """Raise if the trace holds an undeclared fallback (RFC: "Strict traces contain no
        undeclared fallback")."""
        bad = [e for e in self._entries.values() if e.fallback and not e.declared]
        if bad:
            e = bad[0]
            raise UnsupportedConfigError(
                f"strict trace holds {len(bad)} undeclared fallback(s); first: op={e.op} "
                f"block={e.block} stream={e.stream} (rank {e.rank}, {e.device}): {e.reason}"
            )
