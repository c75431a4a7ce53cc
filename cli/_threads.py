"""``--threads N``: the CPU threads of the commands that compute (``run``, ``replay``,
``recompute``, ``probe``, ``diff``, ``overlay``, ``report``, ``fixture verify``, ``experiment``).

    $ drifttool run --threads 1 -o runs/a        # one intra-op thread
    $ OMP_NUM_THREADS=2 drifttool run -o runs/b  # the environment's count when --threads is absent

torch's default is one intra-op thread per core, each spin-waiting for work between operators
(OpenMP's active wait policy). On a small machine that is shared, or a run whose tensors are
small (the embedded fixture), that burns the other processes' cores: measured on 2 cores with
other jobs running, the embedded default took 19–37 s with two threads against 9–11 s with one,
and used 2.5–4x the CPU time. So the default is deliberate:

- intra-op threads: ``--threads`` if given, else ``OMP_NUM_THREADS`` if set, else
  ``min(4, usable cores)`` (``os.sched_getaffinity``; more rarely pays at this model's widths);
- ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets a policy: idle threads sleep instead
  of spinning, so a busy neighbour costs wall time, not CPU time as well.

The strict operators fix their reduction trees (docs/strict-arithmetic.md), so strict bytes do
not depend on the thread count (``tests/cli/test_threads.py``); the count is recorded nowhere in
an artifact other than the manifest's environment record (``environment.torch_threads``,
provenance that ``diff`` never compares). Setting the threads imports nothing: ``diff``,
``trace`` and ``overlay`` stay free of torch (``tests/cli/test_import_cost.py``).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any, Callable, Optional

import typer

from drifttool.errors import DriftToolError

MAX_DEFAULT_THREADS = 4
THREADS_HELP = ("CPU threads for torch's operators (default: $OMP_NUM_THREADS, else min(4, cores)); "
                "strict bytes do not depend on it.")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def default_threads(environ: Optional[dict] = None) -> int:
    """``OMP_NUM_THREADS`` when it is a positive integer, else ``min(4, usable_cores())``."""
    env = os.environ if environ is None else environ
    value = env.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return min(MAX_DEFAULT_THREADS, usable_cores())


def apply_threads(threads: Optional[int]) -> int:
    """Set torch's intra-op threads to ``threads`` (or ``default_threads()``); returns the count.

    Without torch loaded (the commands import it lazily; ``diff``, ``trace`` and ``overlay``
    never do) the count goes to ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``, which torch reads
    when first imported, so this imports nothing; with torch loaded, ``torch.set_num_threads``.
    ``OMP_WAIT_POLICY=PASSIVE`` is set unless the environment names a policy (read by OpenMP
    when torch is first imported). Inter-op threads are left alone: drifttool runs no inter-op
    work, and torch starts that pool only when some is run.

    Raises:
        DriftToolError: ``threads`` < 1.
    """
    if threads is not None and threads < 1:
        raise DriftToolError(f"--threads {threads}: give a positive number of threads")
    n = default_threads() if threads is None else int(threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    return n


def threads_option() -> Any:
    return typer.Option(None, "--threads", min=1, help=THREADS_HELP, show_default=False)


def threaded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a ``--threads N`` option: the threads are set (``apply_threads``) before
    ``fn`` runs, and ``fn`` itself does not see the option."""
    sig = inspect.signature(fn, eval_str=True)
    param = inspect.Parameter("threads", inspect.Parameter.KEYWORD_ONLY,
                              default=threads_option(), annotation=Optional[int])

    @functools.wraps(fn)
    def wrapper(*args: Any, threads: Optional[int] = None, **kwargs: Any) -> Any:
        apply_threads(threads)
        return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), param])
    wrapper.__annotations__ = {**getattr(fn, "__annotations__", {}), "threads": Optional[int]}
    return wrapper
