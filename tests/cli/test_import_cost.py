"""The commands people run most never import torch (seconds of import for a 0.1 s job):
``--help``, ``diff``, ``trace``, ``overlay`` and the seal check of ``fixture verify``; ``--help``
does not import pyarrow either. ``diff`` imports no other command's module, not ``numpy.ma``
(``drifttool.diff.arrays``), not ``pyarrow.parquet``/``pyarrow.fs``
(``drifttool.artifact.parquet``); ``diff`` and ``trace`` do not import ``pyarrow.compute``
(``drifttool.artifact.compute``); and ``--checkpoint`` support costs it nothing until given.

Each command runs in a fresh interpreter through the console script's entry point
(``drifttool.cli.app:main``), which then reports whether ``torch`` is in ``sys.modules``.
The wall time against ``import pyarrow, numpy`` is measured by ``benchmarks/bench_cli.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from drifttool.fixture import locate

_CLI = """
import sys
from drifttool.cli.app import main
sys.argv = ["drifttool", *sys.argv[1:]]
try:
    main()
    code = 0
except SystemExit as e:
    code = e.code
print(f"torch imported: {'torch' in sys.modules}", file=sys.stderr)
print(f"pyarrow imported: {'pyarrow' in sys.modules}", file=sys.stderr)
print(f"numpy.ma imported: {'numpy.ma' in sys.modules}", file=sys.stderr)
print(f"pyarrow.fs imported: {'pyarrow.fs' in sys.modules or 'pyarrow.parquet' in sys.modules}",
      file=sys.stderr)
print(f"pyarrow.compute imported: {'pyarrow.compute' in sys.modules}", file=sys.stderr)
print("modules: " + " ".join(sorted(m for m in sys.modules if m.startswith("drifttool"))),
      file=sys.stderr)
sys.exit(code)
"""


def drifttool(*args, cwd) -> tuple[int, str, str]:
    """Run ``drifttool ARGS`` in a fresh interpreter: (exit code, stdout, stderr)."""
    r = subprocess.run([sys.executable, "-c", _CLI, *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """A production-mode (auto) run of the embedded default: drifts from the strict one."""
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    out = tmp_path_factory.mktemp("runs") / "auto"
    execute(RunSpec(mode="auto"), out)
    return out


@pytest.mark.parametrize("args, code", [
    (["--help"], 0),
    (["diff", "--help"], 0),
    (["diff", "{a}", "{b}"], 1),
    (["diff", "{a}", "{a}", "--json"], 0),
    (["trace", "{a}"], 0),
    (["overlay", "{a}", "{b}", "-o", "{tmp}/overlay.png"], 0),
], ids=["help", "diff-help", "diff-drift", "diff-identical-json", "trace", "overlay"])
def test_command_does_not_import_torch(args, code, strict_run, auto_run, tmp_path):
    argv = [a.format(a=strict_run, b=auto_run, tmp=tmp_path) for a in args]
    rc, out, err = drifttool(*argv, cwd=tmp_path)
    assert rc == code, out + err
    assert "torch imported: False" in err, err[-2000:]
    if "--help" in args:  # help text needs no artifact reader either
        assert "pyarrow imported: False" in err, err[-2000:]
    if args[0] in ("diff", "trace") and "--help" not in args:
        assert "pyarrow.compute imported: False" in err, err[-2000:]
    if args[0] == "diff":
        loaded = set(err.split("modules: ", 1)[1].split("\n", 1)[0].split())
        others = {f"drifttool.cli.{m}" for m in ("run", "trace", "probe", "overlay", "replay",
                                                 "report", "fixture", "experiment")}
        assert not loaded & others, sorted(loaded & others)
        assert not {"drifttool.model.checkpoint_hub", "huggingface_hub"} & loaded
        if "--help" not in args:
            assert "numpy.ma imported: False" in err, err[-2000:]
            assert "pyarrow.fs imported: False" in err, err[-2000:]


def test_every_command_is_still_listed_and_reachable(tmp_path):
    """Building only the invoked command leaves ``--help`` (all commands) and an unknown name's
    error as they were."""
    from drifttool.cli.app import COMMANDS, GROUPS

    rc, out, err = drifttool("--help", cwd=tmp_path)
    assert rc == 0
    for name in [n for n, *_ in COMMANDS] + [n for n, _ in GROUPS]:
        assert f" {name} " in out, (name, out)
    rc, out, err = drifttool("difff", cwd=tmp_path)
    assert rc == 2 and "No such command 'difff'" in err, out + err


def test_fixture_seal_check_does_not_import_torch(tmp_path):
    """A tampered fixture is refused by its seal, one line, exit 2, before torch is loaded."""
    fx = tmp_path / "fx"
    shutil.copytree(locate("tiny-t2i"), fx)
    meta = json.loads((fx / "fixture.json").read_text())
    meta["settings"]["eta"] = 1.0
    (fx / "fixture.json").write_text(json.dumps(meta))
    rc, out, err = drifttool("fixture", "verify", fx, cwd=tmp_path)
    assert rc == 2 and "seal check failed: modified fixture.json" in err, out + err
    assert "Traceback" not in err
    assert "torch imported: False" in err, err[-2000:]


@pytest.mark.parametrize("name, key, value", [("tiny-t2i", "steps", None), ("tiny-edit", "seed", -5)])
def test_what_seal_rebuild_would_refuse_is_said_without_torch(tmp_path, name, key, value):
    """A tampered fixture that `fixture seal --rebuild` would refuse (an incomplete fixture.json,
    a seed its preset refuses): the seal's line says so, still before torch is loaded."""
    fx = tmp_path / "fx"
    shutil.copytree(locate(name), fx)
    meta = json.loads((fx / "fixture.json").read_text())
    if value is None:
        del meta["settings"][key]
    else:
        meta["settings"][key] = value
    (fx / "fixture.json").write_text(json.dumps(meta))
    rc, out, err = drifttool("fixture", "verify", fx, cwd=tmp_path)
    assert rc == 2 and f"`drifttool fixture seal {fx} --rebuild` would refuse it as it is: " in err, out + err
    assert "Traceback" not in err
    assert "torch imported: False" in err, err[-2000:]
