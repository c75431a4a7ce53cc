"""The weight digest that pins a model in the fingerprint (and an adapter in its record).

    >>> weight_digest(model)                       # or a state dict
    'xxh3_128:…'

The digest is ``xxh3_128`` over every tensor in sorted name order: a header line (name, dtype,
shape), then the tensor's raw bytes. A checkpoint loader computes it while streaming
(``StreamingDigest``: the host bytes each parameter is filled from, hashed on a background
thread) and pins it to the model it built (``StreamingDigest.pin``); ``weight_digest(model)``
then returns the pinned value as long as no parameter changed since, and otherwise hashes the
parameters as they are (a weight copied back from a GPU to the host first). Both give the same
value for the same bytes: the pinned one is only kept when the names, dtypes and shapes it hashed
are the model's.

Kept apart from ``checkpoint`` (which builds an ``MMDiT``) so that ``lora`` can digest adapter
weights without importing the model it adapts.
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass

import torch
import xxhash

PREFIX = "xxh3_128:"


def entry_header(name: str, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> bytes:
    """The line hashed before a tensor's bytes: ``name|dtype|[shape]\\n`` (dtype without the
    ``torch.`` prefix)."""
    return f"{name}|{str(dtype).removeprefix('torch.')}|{list(shape)}\n".encode()


def host_bytes(t: torch.Tensor):
    """A contiguous CPU tensor's raw bytes as a read-only-by-convention numpy ``uint8`` array
    (no copy): what the digest hashes."""
    return t.reshape(-1).view(torch.uint8).numpy()


# ---------------------------------------------------------------------------------------------
# digests pinned at load


@dataclass(frozen=True)
class _Pinned:
    """A model's digest as its loader computed it, and the state of each parameter then: the
    parameter object (weakly), its in-place version counter and its storage address."""

    digest: str
    params: tuple[tuple[str, weakref.ref, int, int], ...]


_PINNED: "weakref.WeakKeyDictionary[torch.nn.Module, _Pinned]" = weakref.WeakKeyDictionary()


def _param_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return sorted(model.named_parameters())


def _pinned_digest(model: torch.nn.Module) -> str | None:
    """The digest pinned to ``model`` at load, if every parameter is still the very tensor it
    was then (same object, storage address and version counter: any in-place write through the
    parameter — ``copy_``, an optimizer step, ``load_state_dict`` — bumps the counter) and no
    parameter was added or removed (an attached LoRA adapter adds some). ``None`` otherwise.

    Writes that bypass the parameter's version counter (through ``p.data`` or the storage
    itself) are not seen; drifttool writes weights only through the parameters."""
    pinned = _PINNED.get(model)
    if pinned is None:
        return None
    now = _param_state(model)
    if len(now) != len(pinned.params):
        return None
    for (name, p), (pname, ref, version, ptr) in zip(now, pinned.params):
        if name != pname or ref() is not p or p._version != version or p.data_ptr() != ptr:
            return None
    return pinned.digest


# ---------------------------------------------------------------------------------------------
# the digest


def weight_digest(model: torch.nn.Module | dict[str, torch.Tensor]) -> str:
    """``xxh3_128`` over every tensor in sorted key order: name, dtype, shape, then raw bytes.

    Equal digests ⇔ same names, dtypes, shapes and bytes (to the hash's collision bound); the same
    on every device. Accepts a model or a state dict. A model loaded by
    ``drifttool.model.checkpoint.load_checkpoint`` and unchanged since returns the digest its
    loader computed while streaming (no tensor is read again); any other model (one with a LoRA
    adapter, or changed after load) or a state dict is hashed here: a CPU tensor in place, a GPU
    tensor copied back through a few pinned buffers, each chunk hashed on the digest's thread
    while the next one is copied. Returns ``"xxh3_128:<32 hex>"``.
    """
    if isinstance(model, torch.nn.Module) and (pinned := _pinned_digest(model)) is not None:
        return pinned
    state = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else model
    readback = _Readback()
    with StreamingDigest() as digest:
        try:
            for name in sorted(state):
                t = state[name].detach()
                digest.begin(name, t.dtype, t.shape)
                if t.device.type == "cuda":
                    readback.hash(t.contiguous(), digest)
                else:
                    digest.update(host_bytes(t.to("cpu").contiguous())).wait()  # no copy on the CPU
        finally:
            readback.close()
        return digest.digest()


class PinnedStage:
    """A pinned host buffer of ``size`` bytes between the host and a GPU, with what must finish
    before it is refilled: its copy (a CUDA event) and its hashing (a ``threading.Event``)."""

    def __init__(self, size: int) -> None:
        self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.copied = torch.cuda.Event()
        self.hashed: threading.Event | None = None

    def wait(self) -> None:
        self.copied.synchronize()  # an event never recorded counts as done
        if self.hashed is not None:
            self.hashed.wait()


READBACK_STAGES = 3
READBACK_BYTES = 64 * 2**20


class _Readback:
    """GPU tensors copied back in ``READBACK_BYTES`` chunks through ``READBACK_STAGES`` pinned
    stages on a side stream: the copy of one chunk overlaps the hashing of the previous one."""

    def __init__(self) -> None:
        self.stages: list[PinnedStage] = []  # allocated at the first GPU tensor
        self.sides: dict[torch.device, torch.cuda.Stream] = {}
        self.turn = 0

    def hash(self, t: torch.Tensor, digest: "StreamingDigest") -> None:
        """Hand the bytes of the contiguous GPU tensor ``t`` to ``digest`` in order; every copy
        of it has finished when this returns."""
        if not self.stages:
            self.stages = [PinnedStage(READBACK_BYTES) for _ in range(READBACK_STAGES)]
        flat = t.reshape(-1).view(torch.uint8)
        side = self.sides.get(t.device) or self.sides.setdefault(t.device, torch.cuda.Stream(t.device))
        side.wait_stream(torch.cuda.current_stream(t.device))  # ``t`` as the current stream left it
        pending: list[tuple[PinnedStage, int]] = []
        for b0 in range(0, flat.numel(), READBACK_BYTES):
            n = min(READBACK_BYTES, flat.numel() - b0)
            stage = self.stages[self.turn % READBACK_STAGES]
            self.turn += 1
            stage.wait()
            with torch.cuda.stream(side):
                stage.buffer[:n].copy_(flat[b0:b0 + n], non_blocking=True)
                stage.copied.record(side)
            pending.append((stage, n))
            if len(pending) > 1:  # hash the previous chunk while this one copies
                self._hand_over(*pending.pop(0), digest)
        for stage, n in pending:
            self._hand_over(stage, n, digest)

    @staticmethod
    def _hand_over(stage: PinnedStage, n: int, digest: "StreamingDigest") -> None:
        stage.copied.synchronize()
        stage.hashed = digest.update(host_bytes(stage.buffer[:n]))

    def close(self) -> None:
        """Wait until every stage is copied and hashed (the buffers may then be freed)."""
        for stage in self.stages:
            stage.wait()


class StreamingDigest:
    """``weight_digest`` of tensors handed over as a loader fills them, hashed on a background
    thread (xxhash releases the GIL while it hashes, so reading the next tensor overlaps).

        >>> with StreamingDigest() as d:
        ...     d.begin("a.weight", torch.bfloat16, (4, 8))
        ...     done = d.update(host_bytes(stage))     # a threading.Event: set once hashed
        ...     done.wait()                            # only then may ``stage`` be refilled
        ...     d.pin(model)                           # 'xxh3_128:…', pinned to ``model``

    Tensors must begin in strictly increasing name order (the digest's sorted order), each
    followed by ``update`` calls that together give its raw bytes in order. ``pin`` keeps the
    digest only for a model whose parameters are exactly the names, dtypes and shapes hashed;
    otherwise ``weight_digest(model)`` hashes the parameters as before.

    ``extra``: tensors already on the host that the model will hold beside the streamed ones (an
    adapter's factors, ``load_checkpoint(lora=)``), by parameter name: each is hashed in its
    sorted place, before the first streamed name after it (the rest when the digest ends), so the
    digest is the one of every parameter together. They must stay unchanged until it ends.

    Raises:
        ValueError: a name out of sorted order, or streamed and given in ``extra``; ``update``
            before ``begin``; an ``extra`` tensor that is not a contiguous CPU tensor.
    """

    def __init__(self, extra: "dict[str, torch.Tensor] | None" = None) -> None:
        self._hash = xxhash.xxh3_128()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self._error: BaseException | None = None
        extra = dict(extra or {})
        odd = [n for n, t in extra.items() if t.device.type != "cpu" or not t.is_contiguous()]
        if odd:
            raise ValueError(f"extra tensors must be contiguous CPU tensors: {', '.join(sorted(odd)[:4])}")
        self._extra = sorted(extra.items(), reverse=True)  # popped from the end: ascending names
        self._thread = threading.Thread(target=self._work, name="weight-digest", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            data, done = item
            try:
                if self._error is None:
                    self._hash.update(data)
            except BaseException as e:  # noqa: BLE001 - re-raised by digest()
                self._error = e
            finally:
                if done is not None:
                    done.set()

    def begin(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Start the tensor ``name`` of ``dtype`` and ``shape`` (its header line), after the
        ``extra`` tensors whose names sort before it."""
        if self._extra and self._extra[-1][0] == name:
            raise ValueError(f"weight {name!r} is both streamed and given as an extra tensor")
        self._hash_extra(before=name)
        self._begin(name, dtype, shape)

    def _begin(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if self._entries and name <= self._entries[-1][0]:
            raise ValueError(f"weight {name!r} comes after {self._entries[-1][0]!r}: the digest "
                             "needs sorted names")
        self._entries.append((name, dtype, tuple(shape)))
        self._queue.put((entry_header(name, dtype, shape), None))

    def _hash_extra(self, before: str | None) -> None:
        """Hand over the ``extra`` tensors whose names sort before ``before`` (None: all left)."""
        while self._extra and (before is None or self._extra[-1][0] < before):
            name, t = self._extra.pop()
            self._begin(name, t.dtype, tuple(t.shape))
            self._queue.put((host_bytes(t), None))  # ``t`` is the caller's, unchanged until the end

    def update(self, data) -> threading.Event:
        """Hash the next raw bytes of the current tensor (a buffer: ``host_bytes(t)``). The
        buffer must not change until the returned event is set."""
        if not self._entries:
            raise ValueError("update() before begin()")
        done = threading.Event()
        self._queue.put((data, done))
        return done

    def close(self) -> None:
        """Hand over the ``extra`` tensors left, then stop the hashing thread (idempotent); waits
        for what was queued."""
        if self._thread.is_alive():
            self._hash_extra(before=None)
            self._queue.put(None)
            self._thread.join()

    def digest(self) -> str:
        """``"xxh3_128:<32 hex>"`` of everything handed over and every ``extra`` tensor; closes
        the digest."""
        self.close()
        if self._error is not None:
            raise self._error
        return PREFIX + self._hash.hexdigest()

    def pin(self, model: torch.nn.Module) -> str:
        """The digest, pinned to ``model`` when its parameters are the tensors hashed (sorted
        names, dtypes, shapes), so that ``weight_digest(model)`` returns it while they stay
        unchanged; a model with other parameters is left unpinned. Returns the digest."""
        digest = self.digest()
        params = _param_state(model)
        if [(n, p.dtype, tuple(p.shape)) for n, p in params] == self._entries and all(
                p.is_contiguous() for _, p in params):
            _PINNED[model] = _Pinned(digest, tuple((n, weakref.ref(p), p._version, p.data_ptr())
                                                   for n, p in params))
        return digest

    def __enter__(self) -> "StreamingDigest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
