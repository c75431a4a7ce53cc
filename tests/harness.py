"""Test harness: the same operator suite on every (backend family, device) target, the same
end-to-end run in every process layout (issue #9 item 6; review §5 "tester config × capability
mixins", §6 item 7).

    @pytest.mark.parametrize("target", targets("strict"))
    def test_x(target):
        gemm = target.impl("mlp_down_gemm")          # skips only off the CPU, see below
        y = gemm(*target.put(x, w, b))               # inputs made on the CPU, moved to the device
        assert_same_bytes(y.cpu(), ...)
        y = target.fn("mlp_down_gemm")(x, w, b)      # the same, CPU tensors in and out

Targets. A ``Target`` is a (family, device type) pair, e.g. ``strict-cpu``, ``production-cuda``.
``targets(*families)`` lists them for ``pytest.mark.parametrize`` (ids ``<family>-<device>``),
each CUDA case marked to skip when no GPU is present ("no CUDA device"). Whether a target has an
implementation is asked of the registry (``drifttool.ops.registry.impls``), which is explicit:

- on the CPU a missing implementation is a **failure** (``Target.impl`` raises the registry's
  ``UnsupportedConfigError``): the CPU families exist and must stay complete — no skip-on-missing;
- on any other device a missing implementation **skips**, naming the operator, family and device
  ("registry has no 'strict' implementation of 'mlp_down_gemm' for device 'cuda'"); the case
  starts running the day that family registers for that device.

Inputs are generated on the CPU from a seeded ``torch.Generator`` and moved (``Target.put``), so
every device sees the same values; results are compared on the CPU.

Fixtures (``tests/conftest.py``): ``target`` (every built-in family × device) and ``device``.
Hypothesis tests take ``@pytest.mark.parametrize("target", targets(...))`` instead: a skip mark
set at collection, no function-scoped fixture under ``@given``.

Layouts. ``LAYOUTS`` are the process layouts of an end-to-end ``drifttool run``: ``single`` (one
process, in-process CLI) and ``sample_parallel`` (2 ranks, ``python -m torch.distributed.run
--standalone --nproc-per-node 2 -m drifttool run ...``, gloo on CPU; marked ``slow``).
``layouts()`` gives the parametrisation, ``run_in_layout`` runs the CLI in one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from typer.testing import CliRunner

import drifttool.ops  # noqa: F401  (registers the strict and production families)
from drifttool.cli.app import app
from drifttool.ops.registry import BUILTIN_FAMILIES, DEVICES, implementation, impls

HAS_CUDA = torch.cuda.is_available()


def device_missing(device: str) -> str | None:
    """Why ``device`` cannot run here (``None`` if it can)."""
    if device == "cuda" and not HAS_CUDA:
        return "no CUDA device"
    return None


@dataclass(frozen=True)
class Target:
    """One (backend family, device type) an operator suite runs on.

    Attributes:
        family: registry family, e.g. ``"strict"``, ``"production"``.
        device: device type, ``"cpu"`` or ``"cuda"``.
    """

    family: str
    device: str

    @property
    def id(self) -> str:
        return f"{self.family}-{self.device}"

    def __str__(self) -> str:
        return self.id

    def missing(self, op: str) -> str | None:
        """Why this target cannot run ``op`` here, or ``None``. Never a reason on the CPU: a
        CPU family lacking an operator is a bug the test must report, not skip."""
        if (why := device_missing(self.device)) is not None:
            return why
        if self.device != "cpu" and not impls(op, self.family, self.device):
            return f"registry has no {self.family!r} implementation of {op!r} for device {self.device!r}"
        return None

    def require(self, *ops: str) -> None:
        """Skip the test (off the CPU only) unless every operator in ``ops`` is registered."""
        for op in ops:
            if (why := self.missing(op)) is not None:
                pytest.skip(why)

    def impl(self, op: str) -> Callable[..., Any]:
        """The registered implementation of ``op`` for this target, behind its declared
        constraints (``registry.implementation``).

        Raises:
            UnsupportedConfigError: on the CPU, nothing registered (the test fails).
            pytest.skip.Exception: off the CPU, no device or nothing registered.
        """
        self.require(op)
        return implementation(op, self.family, self.device)

    def fn(self, op: str) -> Callable[..., Any]:
        """``impl(op)`` behind a CPU interface: tensor arguments are moved to the device, outputs
        moved back to the CPU. Both moves are differentiable, so ``torch.autograd.grad`` on CPU
        leaves returns the device's gradients, copied (bytes unchanged). On the CPU the moves
        are no-ops: the implementation itself runs."""
        impl = self.impl(op)
        device = self.device

        def run(*args: Any, **kwargs: Any) -> Any:
            return to_cpu(impl(*to_device(args, device), **to_device(kwargs, device)))

        run.__name__ = f"{op}@{self.id}"
        return run

    def put(self, *xs: Any) -> Any:
        """``xs`` with every tensor (also inside tuples, lists and dict values) moved to this
        target's device; one argument gives one value back, several a tuple."""
        moved = tuple(to_device(x, self.device) for x in xs)
        return moved[0] if len(moved) == 1 else moved


def to_device(x: Any, device: str) -> Any:
    """``x`` with its tensors moved to ``device`` (containers rebuilt; other values unchanged)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(to_device(v, device) for v in x)
    if isinstance(x, list):
        return [to_device(v, device) for v in x]
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def to_cpu(x: Any) -> Any:
    """``x`` with its tensors moved to the CPU (for comparison)."""
    return to_device(x, "cpu")


def target_param(target: Target, *marks: Any) -> Any:
    """``target`` as a ``pytest.param`` with its id, skipping at collection when its device is
    absent (cheap, and safe under hypothesis, whose examples must not meet a skip fixture)."""
    why = device_missing(target.device)
    skip = [pytest.mark.skip(reason=why)] if why else []
    return pytest.param(target, id=target.id, marks=[*skip, *marks])


def targets(*families: str, devices: tuple[str, ...] = DEVICES) -> list[Any]:
    """Parametrisation over (family, device) for ``families`` (default: the built-in ones)."""
    return [target_param(Target(f, d)) for f in (families or BUILTIN_FAMILIES) for d in devices]


# ---------------------------------------------------------------------------------------------
# layouts of an end-to-end run

LAYOUTS = ("single", "sample_parallel")
"""Process layouts of ``drifttool run``: one process; the batch's samples split across 2 ranks."""

SAMPLE_PARALLEL_RANKS = 2


def layouts() -> list[Any]:
    """Parametrisation over ``LAYOUTS``; the multi-process ones are marked ``slow``."""
    return [pytest.param("single", id="single"),
            pytest.param("sample_parallel", id="sample_parallel", marks=pytest.mark.slow)]


def torchrun_env(extra_path: Path | None = None) -> dict[str, str]:
    """The environment of a test's ``torch.distributed.run`` launch: this interpreter's path,
    one thread per rank, no inherited rendezvous variables."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*([str(extra_path)] if extra_path else []), *sys.path]),
           "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run_in_layout(layout: str, *args: Any, cwd: Path) -> tuple[int, str]:
    """``drifttool <args>`` in ``layout``; returns (exit code, stdout + stderr).

    ``single`` runs the CLI in this process (typer's ``CliRunner``, as the ``cli`` fixture);
    ``sample_parallel`` launches ``SAMPLE_PARALLEL_RANKS`` ranks with ``python -m
    torch.distributed.run --standalone ... -m drifttool`` (gloo on CPU) in ``cwd``.

    Raises:
        ValueError: unknown layout.
    """
    if layout == "single":
        res = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
        return res.exit_code, res.output
    if layout != "sample_parallel":
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(SAMPLE_PARALLEL_RANKS), "-m", "drifttool",
                        *(str(a) for a in args)], cwd=cwd, env=torchrun_env(),
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr
