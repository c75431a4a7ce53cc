"""Who this process is in a distributed run: read torchrun's environment, start the process group,
name the mesh.

    $ torchrun --nproc-per-node 2 -m drifttool run --batch 4 -o runs/sp2
    >>> ctx = init_distributed(mesh_dims=("sample",))       # in each rank
    >>> ctx
    DistContext(rank=1, world_size=2, local_rank=1, device=device(type='cpu'), mesh=DeviceMesh(...))
    >>> close_distributed(ctx)

Without torchrun's variables (``RANK``/``WORLD_SIZE``) this is one process: ``DistContext()``,
rank 0 of world 1 with no mesh, and nothing is initialised. Under torchrun the process group is
gloo on CPU and nccl on CUDA (``BACKENDS``), and a ``DeviceMesh`` names its dimensions:
``("sample",)`` for sample-parallel rollout today, ``("cfg", "sp", "tp")`` (shape given) when
CFG-parallel, sequence- and tensor-parallel plans come. The rank, world size and mesh decide where
records are written, never bytes: the device is an argument, not read from the environment, and
the run's layout is recorded in the manifest. Source: design.md, "Scale: devices, ranks,
runtimes"; torchrun's environment variables (torch.distributed.elastic).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from drifttool.errors import UnsupportedConfigError

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
"""Process-group backend per device type."""

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""How long a collective waits for a missing rank before it raises (a rank that died)."""


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """torchrun's description of this process: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise UnsupportedConfigError(
            f"distributed launch: {name} is not set (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT)") from None
    except ValueError:
        raise UnsupportedConfigError(f"distributed launch: {name}={env[name]!r} is not an "
                                     "integer") from None


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """torchrun's variables from ``environ`` (default ``os.environ``), or ``None`` when neither
    ``RANK`` nor ``WORLD_SIZE`` is set (a plain single process).

    Raises:
        UnsupportedConfigError: a variable is missing or not an integer, or the ranks are
            inconsistent (``RANK`` outside ``[0, WORLD_SIZE)``, ``LOCAL_RANK`` > ``RANK``).
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    rank, world, local = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK")
    port = _int(env, "MASTER_PORT")
    addr = env.get("MASTER_ADDR")
    if not addr:
        raise UnsupportedConfigError("distributed launch: MASTER_ADDR is not set")
    if world < 1 or not 0 <= rank < world or not 0 <= local <= rank:
        raise UnsupportedConfigError(f"distributed launch: RANK={rank} LOCAL_RANK={local} "
                                     f"WORLD_SIZE={world} are inconsistent")
    return LaunchEnv(rank=rank, world_size=world, local_rank=local, master_addr=addr,
                     master_port=port)


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """This process in a run: ``rank`` of ``world_size`` (``local_rank`` on its host), the
    ``device`` it computes on, and the ``DeviceMesh`` over all ranks (``None`` in a single
    process). The default is one process on the CPU.

    ``owns_group``: ``init_distributed`` started the process group (``close_distributed`` then
    destroys it)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: DeviceMesh | None = None
    owns_group: bool = field(default=False, repr=False)

    @property
    def distributed(self) -> bool:
        """Whether a process group and mesh exist (launched by torchrun, even as world 1)."""
        return self.mesh is not None

    def layout(self) -> dict[str, object]:
        """The mesh part of a manifest ``layout`` (``manifest_schema._LAYOUT``): ``world_size`` and, when
        distributed, ``{"mesh": {"dims": [...], "shape": [...]}}``."""
        out: dict[str, object] = {"world_size": self.world_size}
        if self.mesh is not None:
            out["mesh"] = {"dims": list(self.mesh.mesh_dim_names or ()),
                           "shape": list(self.mesh.shape)}
        return out


def _device(kind: str, local_rank: int) -> torch.device:
    if kind not in BACKENDS:
        raise UnsupportedConfigError(f"distributed run on device {kind!r}: supported devices are "
                                     f"{', '.join(BACKENDS)}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedConfigError("distributed run on cuda: no CUDA device is available")
        if local_rank >= torch.cuda.device_count():
            raise UnsupportedConfigError(f"distributed run on cuda: LOCAL_RANK {local_rank} but "
                                         f"{torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(*, device: str = "cpu", mesh_dims: tuple[str, ...] = ("sample",),
                     mesh_shape: tuple[int, ...] | None = None,
                     timeout: timedelta = DEFAULT_TIMEOUT,
                     environ: Mapping[str, str] | None = None) -> DistContext:
    """This process's ``DistContext``: one process (``DistContext(device=...)``) without
    torchrun's variables; else the process group (``BACKENDS[device]``; an already initialised
    one is reused and must agree with the environment) and a ``DeviceMesh`` over every rank.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (rank ``r`` uses ``cuda:LOCAL_RANK``).
        mesh_dims: the mesh's dimension names, outermost first.
        mesh_shape: size of each dimension; default ``(WORLD_SIZE,)`` for one dimension. Its
            product must be ``WORLD_SIZE``.
        timeout: how long collectives wait for a missing rank.
        environ: torchrun's variables (default ``os.environ``).

    Raises:
        UnsupportedConfigError: an unsupported device, no CUDA device, a mesh that does not
            cover the world (several dimensions without a shape, a product other than
            ``WORLD_SIZE``, repeated or empty names), a process group that disagrees with the
            environment, or inconsistent torchrun variables (``launch_env``).
    """
    env = launch_env(environ)
    if env is None:
        return DistContext(device=_device(device, 0))
    dims = tuple(mesh_dims)
    if not dims or len(set(dims)) != len(dims) or not all(isinstance(d, str) and d for d in dims):
        raise UnsupportedConfigError(f"mesh dimension names must be distinct non-empty strings, "
                                     f"got {mesh_dims!r}")
    if mesh_shape is None:
        if len(dims) != 1:
            raise UnsupportedConfigError(f"mesh {dims}: give mesh_shape for a mesh of "
                                         f"{len(dims)} dimensions")
        mesh_shape = (env.world_size,)
    shape = tuple(mesh_shape)
    if len(shape) != len(dims) or any(type(n) is not int or n < 1 for n in shape) \
            or math.prod(shape) != env.world_size:
        raise UnsupportedConfigError(f"mesh {dims} of shape {shape} does not cover WORLD_SIZE="
                                     f"{env.world_size} ranks")
    dev = _device(device, env.local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # object collectives on nccl run on the current device
    owns = not dist.is_initialized()
    if owns:
        host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr  # IPv6
        dist.init_process_group(BACKENDS[dev.type], init_method=f"tcp://{host}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size, timeout=timeout)
    elif (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
        raise UnsupportedConfigError(
            f"an initialised process group is rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but RANK={env.rank} WORLD_SIZE={env.world_size}")
    mesh = init_device_mesh(dev.type, shape, mesh_dim_names=dims)
    return DistContext(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                       device=dev, mesh=mesh, owns_group=owns)


def close_distributed(ctx: DistContext) -> None:
    """Destroy the process group ``init_distributed`` started for ``ctx`` (nothing otherwise)."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()
