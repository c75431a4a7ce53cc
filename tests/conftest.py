import contextlib
import importlib.util
import math
import os

# CI runs on 2 cores; keep the thread count fixed so timing noise stays low (bytes must not depend on
# it). Under pytest-xdist every worker already has a core of its own: one thread each, for torch in
# this process, for the CLI's default (``cli._threads`` reads OMP_NUM_THREADS) and for every process
# a test starts (torchrun launches, spawned gloo ranks, ``drifttool`` subprocesses inherit the
# environment). Idle OpenMP threads sleep rather than spin (read when torch is first imported).
_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1)
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(_THREADS)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402 - after the thread environment, which torch reads when imported
import torch  # noqa: E402

# Without CUDA, Triton runs the strict CUDA kernels in its interpreter (tests/ops/strict_cuda). It
# reads TRITON_INTERPRET when its modules and each kernel are first imported, so it is set here,
# before any test module imports Triton (drifttool.capture.gpu_rows does).
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests import interp_dot  # noqa: E402

    interp_dot.install()  # the interpreter's tl.dot, row-invariant on every CPU (its docstring)

from tests import harness  # noqa: E402

torch.set_num_threads(_THREADS)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw-byte view for invariance checks: ±0 and NaN payloads compare unequal."""
    t = t.contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def fixture_copy(dest, name: str = "tiny-t2i", *, sealed: bool = True, **settings):
    """A copy at ``dest`` of the shipped fixture ``name`` whose fixture.json has ``settings``
    changed (a value ``None``: the key removed); ``sealed=False`` drops its seal.json."""
    import json
    import shutil

    from drifttool.fixture import locate

    shutil.copytree(locate(name), dest)
    if not sealed:
        (dest / "seal.json").unlink()
    meta = json.loads((dest / "fixture.json").read_text())
    meta["settings"].update(settings)
    for key in [k for k, v in settings.items() if v is None]:
        del meta["settings"][key]
    (dest / "fixture.json").write_text(json.dumps(meta))
    return dest


def one_error_line(code: int, out: str, *needles: str) -> str:
    """A refusal as the CLI must give it: exit 2 and exactly one line of output (stdout and stderr
    together), ``error: …``, holding every needle. Returns that line."""
    assert code == 2, out
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    for n in needles:
        assert n in lines[0], out
    return lines[0]


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ba, bb = bits(a), bits(b)
    if not torch.equal(ba, bb):
        idx = (ba != bb).nonzero()[0].tolist()
        pytest.fail(f"{what}: bytes differ first at {idx} ({(ba != bb).sum().item()} elements)")


def assert_same_records(a: list[dict], b: list[dict], what: str = "") -> None:
    """Two runs' op records (``ops_table().to_pylist()``) equal in every column but ``l2``, which
    must agree to 1e-12 relative: a summary summed in fp64 in the order of the kernel that read
    the output (a producer's tiles or the row kernel's), not an identity (docs/digest.md)."""
    assert a and len(a) == len(b), f"{what}: {len(a)} records against {len(b)}"
    for ra, rb in zip(a, b):
        la, lb = ra["l2"], rb["l2"]
        other = {k: v for k, v in ra.items() if k != "l2"}, {k: v for k, v in rb.items() if k != "l2"}
        if other[0] != other[1]:
            cols = sorted(k for k in other[0] if other[0][k] != other[1].get(k))
            pytest.fail(f"{what}: records differ first at step {ra.get('step')} block {ra.get('block')} "
                        f"{ra.get('stream')} {ra.get('op')} sample {ra.get('sample')} in {cols}")
        assert la == lb or math.isclose(la, lb, rel_tol=1e-12) or (la != la and lb != lb), \
            (what, ra["op"], ra["step"], la, lb)


@pytest.fixture
def uncapturable():
    """A context manager under which ``MMDiT.forward`` synchronises with the host while a CUDA
    graph is being captured (not permitted there): a forward no graph can hold."""
    from drifttool.model.mmdit import MMDiT

    real = MMDiT.forward

    def syncing(self, *a, **k):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return real(self, *a, **k)

    @contextlib.contextmanager
    def patched():
        with pytest.MonkeyPatch.context() as m:
            m.setattr(MMDiT, "forward", syncing)
            yield

    return patched


@pytest.fixture
def cli(monkeypatch):
    """Invoke the drifttool CLI in-process; returns (exit_code, stdout + stderr). The consoles
    print as they do into a pipe (``PIPE_WIDTH`` columns), whatever ``COLUMNS`` the test process
    inherited (pytest-xdist workers get 80), so tables wrap the same on every machine."""
    from typer.testing import CliRunner

    from drifttool.cli import _console
    from drifttool.cli.app import app

    for con in (_console.console, _console.err):
        monkeypatch.setattr(con, "width", _console.PIPE_WIDTH)
    runner = CliRunner()

    def invoke(*args: str):
        res = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
        return res.exit_code, res.output

    return invoke


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    """Device type a test runs on; the ``cuda`` case skips cleanly without a GPU."""
    if (why := harness.device_missing(request.param)) is not None:
        pytest.skip(why)
    return request.param


@pytest.fixture(params=harness.targets())
def target(request) -> harness.Target:
    """A (backend family, device) pair (``tests/harness.py``): ``target.impl(op)`` fails on the
    CPU when ``op`` is unregistered and skips elsewhere, ``target.put`` moves CPU-made inputs.
    Hypothesis tests and module-scoped cases use ``pytest.mark.parametrize("target",
    harness.targets(...))`` instead (no function-scoped fixture under ``@given``)."""
    return request.param
