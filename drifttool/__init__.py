"""drifttool: byte-level train-rollout consistency checks for the Qwen-Image MMDiT.

The Python API, beside the ``drifttool`` command line (README, "Python API"):

    >>> import drifttool
    >>> drifttool.execute(drifttool.RunSpec(), "runs/a")              # strict, embedded default
    >>> drifttool.execute(drifttool.RunSpec(mode="auto"), "runs/auto")
    >>> report = drifttool.diff_runs(drifttool.open_run("runs/a"), drifttool.open_run("runs/auto"))
    >>> report.verdict
    <Verdict.DRIFT: 'drift'>

=====================  ==========================================================================
``execute``            run one trajectory and write its artifact (``drifttool run``)
``RunSpec``            what ``execute`` runs: fixture or checkpoint, sampler, mode, capture level
``Runtime``            the operator runtime (mode, capture sink, trace) for calling the model or
                       sampler directly
``open_run``           open an artifact directory for reading
``diff_runs``          align two opened artifacts and name the first drift (``drifttool diff``)
``capture_pipeline``   run an unmodified diffusers ``QwenImagePipeline`` and write its artifact
``verify_fixture``     check a sealed fixture, re-run it, diff it (``drifttool fixture verify``)
=====================  ==========================================================================

Each name is imported on first use, so ``import drifttool`` loads neither torch nor pyarrow.

Layout follows the data flow (see docs/architecture.md):
``ops/`` named RFC operators -> ``model/`` strict MMDiT -> ``sampling/`` sigma table, CFG, SDE step
-> ``capture/`` identity and digests -> ``artifact/`` Arrow trajectory files -> ``diff/`` first drift;
above them ``settings`` (typed run settings), ``lifecycle`` (one artifact life cycle), ``runner``
(the rollout job) and ``training/`` (replay, recompute, GRPO, experiments).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_FRONT_DOOR = {
    "execute": "drifttool.runner",
    "RunSpec": "drifttool.settings",
    "Runtime": "drifttool.runtime",
    "open_run": "drifttool.artifact.reader",
    "diff_runs": "drifttool.diff.compare",
    "capture_pipeline": "drifttool.adapters.diffusers_pipeline",
    "verify_fixture": "drifttool.verify",
}
"""Public name -> the module that defines it (imported on first use)."""

__all__ = ["__version__", *_FRONT_DOOR]


def __getattr__(name: str) -> Any:
    """Import a front-door name from its module on first use and keep it here.

    Raises:
        AttributeError: ``name`` is not a front-door name (nor a loaded submodule).
        ImportError: ``capture_pipeline`` without diffusers installed.
    """
    home = _FRONT_DOOR.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(home)
    except ModuleNotFoundError as e:  # capture_pipeline drives diffusers (an optional dependency)
        if (e.name or "").split(".")[0] != "diffusers":
            raise
        raise ImportError(f"drifttool.{name} needs diffusers: pip install 'diffusers>=0.42,<0.43'") from e
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
