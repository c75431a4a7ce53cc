"""The text lane's dependencies (``drifttool.model.lanes``), checked off a GPU: every text-stream
operator runs on the text lane and every other on the main lane; no tensor is read on one lane
before the other lane's write of it was waited for; a tensor one lane made in a block and the
other reads is kept alive until the block ends; and each block leaves the main lane after both.

``ClockLanes`` stands in for the two CUDA streams with logical clocks (a vector clock per lane),
and a ``TorchFunctionMode`` stamps every storage each torch call writes with (lane, time) and
checks every storage it reads. The bytes of the real two-stream forward are compared on a GPU
(``tests/gpu/test_lanes_cuda.py``)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import drifttool.model.mmdit_block as mmdit_block
from drifttool.capture.recorder import Recorder
from drifttool.model.config import tiny
from drifttool.model.lanes import SERIAL, Lanes, Serial
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runtime import Runtime

LANES = ("main", "txt")
METADATA = {"__get__", "untyped_storage", "data_ptr", "size", "dim", "numel", "stride", "element_size",
            "is_contiguous", "storage_offset"}
"""Calls that read a tensor's metadata, not its data (attributes such as ``shape`` are ``__get__``)."""


class ClockLanes(Serial):
    """``Lanes`` with logical clocks: ``clock[lane]`` counts the lane's torch calls,
    ``seen[a][b]`` is the latest time of lane b that lane a has waited for."""

    def __init__(self) -> None:
        self.lane = "main"
        self.clock = dict.fromkeys(LANES, 0)
        self.seen = {a: dict.fromkeys(LANES, 0) for a in LANES}
        self.shared: set[int] = set()
        self.block_start: dict[str, int] | None = None
        self.events: list[str] = []

    def _wait(self, a: str, b: str) -> None:
        self.seen[a][b] = self.clock[b]
        for c in LANES:  # what b had waited for, a now has too
            self.seen[a][c] = max(self.seen[a][c], self.seen[b][c])

    def fork(self, *shared: torch.Tensor) -> None:
        if self.block_start is None:
            self.block_start = dict(self.clock)
        self._wait("txt", "main")
        self.shared.update(t.untyped_storage().data_ptr() for t in shared)
        self.events.append("fork")

    def join(self, *shared: torch.Tensor) -> None:
        self._wait("main", "txt")
        self.shared.update(t.untyped_storage().data_ptr() for t in shared)
        self.events.append("join")

    def end(self) -> None:
        self._wait("main", "txt")
        self.shared.clear()
        self.block_start = None
        self.events.append("end")

    @contextlib.contextmanager
    def txt(self):
        assert self.lane == "main", "text lane entered twice"
        self.lane = "txt"
        try:
            yield
        finally:
            self.lane = "main"


class RaceCheck(TorchFunctionMode):
    """Stamps the storages each torch call writes with (lane, time) — a returned storage it did not
    read (a new tensor, not a view), and the target of an in-place call (``add_``, ``x[i] = …``,
    ``out=``) — and each storage it reads with the time of the read, per lane. Records as a race
    every read of a storage the other lane wrote, and every in-place write to a storage the other
    lane wrote or read, that this lane has not waited for; and, as unkept, every cross-lane read
    of a storage made in the current block that the lanes do not keep until the block's end.
    Storages are known by address, so every stamped one is held until the check ends: a freed
    address taken again by a tensor made where no torch call sees it (``torch.from_numpy``) would
    otherwise carry the old storage's stamp."""

    def __init__(self, lanes: ClockLanes) -> None:
        super().__init__()
        self.lanes = lanes
        self.stamps: dict[int, tuple[str, int]] = {}
        self.held: list[torch.Tensor] = []  # every stamped storage, alive: no address is reused
        self.reads: dict[int, dict[str, int]] = {}
        self.races: list[str] = []
        self.unkept: list[str] = []
        self.cross_reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        lanes, lane = self.lanes, self.lanes.lane
        name = getattr(func, "__name__", str(func))
        read = set()
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor) or name in METADATA:
                continue
            ptr = t.untyped_storage().data_ptr()
            read.add(ptr)
            stamp = self.stamps.get(ptr)
            if stamp is None or stamp[0] == lane:
                continue
            self.cross_reads += 1
            other, time = stamp
            if lanes.seen[lane][other] < time:
                self.races.append(f"{name} on {lane} reads {other}@{time}")
            start = lanes.block_start
            if start is not None and time > start[other] and ptr not in lanes.shared:
                self.unkept.append(f"{name} on {lane} reads {other}@{time}")
        in_place = name == "__setitem__" or (name.endswith("_") and not name.startswith("__")) or (
            name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__", "__invert__"))
        targets = [args[0]] if in_place and args and isinstance(args[0], torch.Tensor) else []
        targets += [t for t in tree_leaves(kwargs.get("out")) if isinstance(t, torch.Tensor)]
        for t in targets:  # the other lane's last write and reads of it must be waited for
            ptr = t.untyped_storage().data_ptr()
            stamp = self.stamps.get(ptr)
            if stamp is not None and stamp[0] != lane and lanes.seen[lane][stamp[0]] < stamp[1]:
                self.races.append(f"{name} on {lane} overwrites {stamp[0]}'s write @{stamp[1]}")
            for other, time in self.reads.get(ptr, {}).items():
                if other != lane and lanes.seen[lane][other] < time:
                    self.races.append(f"{name} on {lane} overwrites what {other} read @{time}")
        out = func(*args, **kwargs)
        lanes.clock[lane] += 1
        now = lanes.clock[lane]
        for ptr in read:
            self.reads.setdefault(ptr, {})[lane] = now
        for t in targets:
            self.stamps[t.untyped_storage().data_ptr()] = (lane, now)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in read:  # a new storage
                    self.stamps[ptr] = (lane, now)
                    self.reads.pop(ptr, None)
                    self.held.append(t)
        return out


def _forward(lanes, level=None, batch=3, seed=0):
    cfg = tiny()
    model = random_init_(MMDiT(cfg, dtype=torch.bfloat16), seed=1)
    g = torch.Generator().manual_seed(seed)
    grid, slots = (5, 7), 9
    x = torch.randn(batch, grid[0] * grid[1], cfg.in_channels, generator=g).bfloat16()
    txt = torch.randn(batch, slots, cfg.joint_attention_dim, generator=g).bfloat16()
    mask = torch.arange(slots)[None, :] < torch.tensor([9, 4, 7][:batch])[:, None]
    tau = torch.rand(batch, generator=g)
    rt = Runtime(mode="strict", recorder=None if level is None else Recorder(level), lanes=lanes)
    with torch.no_grad(), rt.scope(phase="rollout", step=0, samples=list(range(batch)),
                                           txt_lens=[9, 4, 7][:batch], img_grid=grid):
        return model(x, txt, mask, tau, grid, rt), rt


@pytest.fixture
def lane_of_each_call(monkeypatch):
    """(op, stream, lane) of every named operator the blocks call."""
    seen = []
    inner = mmdit_block.call

    def call(rt, op, *args, stream, **kw):
        seen.append((op, stream, getattr(rt.lanes, "lane", "main")))
        return inner(rt, op, *args, stream=stream, **kw)

    monkeypatch.setattr(mmdit_block, "call", call)
    return seen


@pytest.mark.parametrize("level", [None, "L1"])
def test_no_read_races_and_shared_tensors_are_kept(level):
    lanes = ClockLanes()
    check = RaceCheck(lanes)
    with check:
        _forward(lanes, level)
    assert check.cross_reads > 0  # the check saw the lanes meet
    assert check.races == [], check.races[:5]
    assert check.unkept == [], check.unkept[:5]
    assert lanes.seen["main"]["txt"] == lanes.clock["txt"]  # the forward ends joined
    blocks = tiny().num_layers
    assert lanes.events == ["fork", "join", "fork", "end"] * blocks


def test_text_stream_operators_run_on_the_text_lane(lane_of_each_call):
    _forward(ClockLanes(), batch=1)
    assert {s for _, s, _ in lane_of_each_call} >= {"img", "txt", "joint"}
    wrong = [(op, s, lane) for op, s, lane in lane_of_each_call if (s == "txt") != (lane == "txt")]
    assert wrong == []


def test_lanes_change_no_byte_on_the_cpu():
    (a, rt_a), (b, rt_b) = _forward(ClockLanes(), "L1"), _forward(None, "L1")
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    ops = [rt.recorder.ops_table() for rt in (rt_a, rt_b) if not rt.recorder.flush()]
    assert ops[0].select(["op", "stream", "block", "call", "op_pos", "digest"]).equals(
        ops[1].select(["op", "stream", "block", "call", "op_pos", "digest"]))


def test_serial_is_a_no_op_and_lanes_need_cuda():
    with SERIAL.txt():
        SERIAL.fork(torch.zeros(1))
        SERIAL.join()
        SERIAL.end()
    with pytest.raises(ValueError, match="CUDA"):
        Lanes("cpu")
