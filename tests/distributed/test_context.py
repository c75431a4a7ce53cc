"""``launch_env``/``init_distributed`` outside a process group: the single-process default and the
refusals that come before any process group is started (the multi-rank path is exercised by
``test_multirank_artifact``, which spawns gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from drifttool.distributed import DistContext, init_distributed, launch_env
from drifttool import collectives as C
from drifttool.errors import UnsupportedConfigError

ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
       "MASTER_PORT": "29555"}


def test_single_process_default():
    assert launch_env({}) is None
    ctx = init_distributed(environ={})
    assert ctx == DistContext() and not ctx.distributed
    assert (ctx.rank, ctx.world_size, ctx.device, ctx.mesh) == (0, 1, torch.device("cpu"), None)
    assert ctx.layout() == {"world_size": 1}
    assert not dist.is_initialized()
    assert C.all_gather_object({"x": 1}) == [{"x": 1}]
    assert C.broadcast_object("a") == "a" and (C.rank(), C.world_size()) == (0, 1)
    C.barrier()


def test_launch_env_reads_torchrun_variables():
    e = launch_env(ENV)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port) == (
        1, 2, 1, "127.0.0.1", 29555)


@pytest.mark.parametrize("change,match", [
    ({"WORLD_SIZE": None}, "WORLD_SIZE is not set"),
    ({"RANK": "x"}, "RANK='x' is not an integer"),
    ({"RANK": "2"}, "inconsistent"),
    ({"LOCAL_RANK": "2"}, "inconsistent"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
])
def test_launch_env_refusals(change, match):
    env = {k: v for k, v in {**ENV, **change}.items() if v is not None}
    with pytest.raises(UnsupportedConfigError, match=match):
        launch_env(env)


@pytest.mark.parametrize("kw,match", [
    ({"mesh_dims": ("cfg", "sp", "tp")}, "give mesh_shape"),
    ({"mesh_dims": ("cfg", "tp"), "mesh_shape": (2, 2)}, r"does not cover WORLD_SIZE=2"),
    ({"mesh_dims": ("sp", "sp"), "mesh_shape": (1, 2)}, "distinct"),
    ({"device": "mps"}, "device 'mps'"),
])
def test_mesh_and_device_refusals_start_nothing(kw, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        init_distributed(environ=ENV, **kw)
    assert not dist.is_initialized()
