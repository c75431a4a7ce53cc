"""The WS2 layouts from the command line: ``torchrun -m drifttool run|replay|recompute --tp/--sp/
--sp-attention/--cfg-parallel`` diffs identical to one process, and every layout the model or the
run cannot take is refused in one line before any rank starts.

Fast (no torchrun): the refusals, in this process; under a simulated torchrun environment
(``RANK``/``WORLD_SIZE`` set) where the launch matters — every such refusal comes before the
process group would start (``cli._layout.start`` is made to fail the test if it is reached).

Slow (``torchrun --standalone``, gloo, 2 or 4 ranks): ``run`` in TP 2, SP 2 with each attention
(350 image tokens: unequal shards), TP 2 × SP 2 on 4 ranks, each diffed against the one-process
run; the Ring-at-L2 refusal as one line; ``replay`` of a one-process run under a layout and of a
parallel run in one process; ``recompute`` on 2 ranks (CFG-parallel, sample-parallel) and the
plan's refusal of training under a layout as one line; ``probe`` and ``experiment`` refusing
torchrun by name; an unfused adapter under TP as one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import drifttool
import drifttool.cli
from drifttool.runner import execute
from drifttool.settings import RunSpec
from tests.harness import torchrun_env

IMG = ("--height", "160", "--width", "560")  # 10 × 35 patches = 350 image tokens: SP 2 shards 192/158
SOURCES = (Path(drifttool.__file__).parent, Path(drifttool.cli.__file__).parent)


def _one_line(code: int, out: str, *needles: str) -> None:
    """A refusal: exit 2, exactly one ``error:`` line holding every needle, no traceback."""
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    assert code == 2, out
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert "Traceback" not in out and "internal error" not in out, out
    for n in needles:
        assert n in out.replace("\n", " "), (n, out)


@pytest.fixture
def no_launch(monkeypatch):
    """A refusal must come before the process group: reaching ``start`` fails the test (instead
    of waiting for ranks that never come)."""
    from drifttool.cli import _layout

    def start(*_a, **_k):
        raise AssertionError("the process group was started: the layout was not refused first")

    monkeypatch.setattr(_layout, "start", start)
    monkeypatch.setattr("drifttool.cli._errors.QUIET_RANK_WAIT_S", 0.0)


def _torchrun_env(monkeypatch, rank: int, world: int) -> None:
    """torchrun's variables for ``rank`` of ``world`` on one host (no process group behind them)."""
    for k, v in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world),
                 ("LOCAL_WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 29999)):
        monkeypatch.setenv(k, str(v))


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    """A one-process strict run of the embedded default (L2, CFG on)."""
    return Path(execute(RunSpec(), tmp_path_factory.mktemp("stored") / "one")["out"])


# -- fast: refusals in one line ---------------------------------------------------------------

def test_a_quiet_rank_stopped_by_torchrun_while_it_waits_prints_nothing(cli, tmp_path, no_launch, monkeypatch):
    """Rank 1 leaves an error every rank raises alike to rank 0 and waits; torchrun stops it
    (SIGTERM) when rank 0 exits: it exits 2 without a "terminated (SIGTERM)" line of its own."""
    from drifttool.cli import _errors

    def stopped_by_torchrun(_s):
        _errors.SIGNALS.sigterm = True  # as cli.app's SIGTERM handler does
        raise _errors.Terminated()

    monkeypatch.setattr(_errors.time, "sleep", stopped_by_torchrun)
    _torchrun_env(monkeypatch, 1, 2)
    code, out = cli("run", "-o", tmp_path / "r", "--tp", "4")
    assert code == 2 and out.strip() == "" and not _errors.SIGNALS.sigterm, out


@pytest.mark.parametrize("args, needles", [
    (["--sp", "3"], ["--sp 3 (one of 1, 2, 4, 8"]),
    (["--tp", "2"], ["needs 2 ranks", "torchrun --nproc-per-node 2 -m drifttool run"]),
    (["--tp", "4"], ["--tp 4: 2 attention heads do not split over 4 ranks"]),
    (["--tp", "2", "--sp", "2", "--sp-attention", "ulysses"],
     ["--sp-attention ulysses: 1 attention head per TP rank does not split over --sp 2"]),
    (["--sp-attention", "ring"], ["--sp-attention ring needs --sp 2, 4 or 8"]),
    (["--sp", "2", "--sp-attention", "ring"], ["ring cannot capture L2 (the fixture's default)", "--capture L1"]),
    (["--sp", "2", "--sp-attention", "ring", "--capture", "L2"], ["ring cannot capture L2:"]),
    (["--tp", "2", "--mode", "auto"], ["strict family only"]),
    (["--cfg-parallel", "2", "--cfg-scale", "1"], ["CFG is off"]),
    (["--cfg-parallel", "2", "--mode", "auto"], ["production family's bytes differ",
                                                 "pass --cfg-layout sequential"]),
])
def test_run_refuses_a_layout_in_one_line(cli, tmp_path, no_launch, args, needles):
    _one_line(*cli("run", "-o", tmp_path / "r", *args), *needles)
    assert not (tmp_path / "r").exists()


def test_run_refuses_a_launch_of_another_size(cli, tmp_path, no_launch, monkeypatch):
    _torchrun_env(monkeypatch, 0, 1)  # torchrun --nproc-per-node 1 ... --tp 2
    _one_line(*cli("run", "-o", tmp_path / "r", "--tp", "2"), "needs 2 ranks", "(this launch has 1)")
    _torchrun_env(monkeypatch, 0, 4)
    _one_line(*cli("run", "-o", tmp_path / "r", "--sp", "2"), "needs 2 ranks", "(this launch has 4)")
    assert not (tmp_path / "r").exists()


def test_a_refusal_every_rank_raises_is_printed_once(cli, tmp_path, no_launch, monkeypatch):
    """Under torchrun a layout refusal is one line for the launch (local rank 0, no rank prefix);
    the other ranks exit 2 silently."""
    args = ("run", "-o", tmp_path / "r", "--sp", "2", "--sp-attention", "ring")
    _torchrun_env(monkeypatch, 0, 2)
    _one_line(*cli(*args), "ring cannot capture L2")
    assert "[rank" not in cli(*args)[1]
    _torchrun_env(monkeypatch, 1, 2)
    code, out = cli(*args)
    assert code == 2 and out.strip() == "", out
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, needles", [
    (["--sp", "3"], ["--sp 3 (one of 1, 2, 4, 8"]),
    (["--tp", "2"], ["needs 2 ranks", "torchrun --nproc-per-node 2 -m drifttool replay"]),
    (["--tp", "4"], ["--tp 4: 2 attention heads do not split over 4 ranks"]),
    (["--sp", "2", "--sp-attention", "ring"], ["ring cannot capture L2 (the stored run's level)"]),
    (["--sp-attention", "ulysses"], ["--sp-attention ulysses needs --sp"]),
])
def test_replay_refuses_a_layout_in_one_line(cli, tmp_path, no_launch, stored, args, needles):
    _one_line(*cli("replay", stored, "-o", tmp_path / "r", *args), *needles)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, needles", [
    (["--sp", "2", "--sp-attention", "ring"], ["ring cannot capture L2 (the stored run's level)"]),
    (["--cfg-parallel", "2"], ["needs 2 ranks", "torchrun --nproc-per-node 2 -m drifttool recompute"]),
    (["--sp", "5"], ["--sp 5 (one of"]),
    (["--sp-attention", "agrs"], ["--sp-attention agrs needs --sp"]),
    (["--tp", "2", "--grad"], ["--grad) need trainable LoRA parameters"]),  # the stored run has none
])
def test_recompute_refuses_a_layout_in_one_line(cli, tmp_path, no_launch, stored, args, needles):
    _one_line(*cli("recompute", stored, "-o", tmp_path / "r", *args), *needles)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, needles, world", [
    (["--tp", "2"], ["needs 2 ranks", "torchrun --nproc-per-node 2 -m drifttool probe"], 1),
    (["--tp", "4"], ["--tp 4: 2 attention heads do not split over 4 ranks"], 4),
    (["--sp", "2", "--sp-attention", "ring"], ["ring cannot run the probe matrix", "agrs or ulysses"], 2),
    (["--distributed"], ["--distributed runs in one process", "without torchrun"], 2),
    (["--tp", "2", "-o", "{file}"], ["exists and is not a directory"], 2),
    (["--tp", "2", "-o", "{file}/sub"], ["is not a directory"], 2),
    (["--peer", "diffusers", "--tp", "2"], ["--peer runs in one process"], 2),
])
def test_probe_refuses_a_layout_in_one_line(cli, tmp_path, no_launch, monkeypatch, args, needles, world):
    if world > 1:
        _torchrun_env(monkeypatch, 0, world)
    (tmp_path / "afile").write_text("x")
    args = [a.format(file=tmp_path / "afile") for a in args]
    _one_line(*cli("probe", "-o", tmp_path / "p", *args), *needles)
    assert not (tmp_path / "p").exists() and (tmp_path / "afile").read_text() == "x"
    if world > 1:  # the other ranks are silent: one line for the launch
        _torchrun_env(monkeypatch, 1, world)
        code, out = cli("probe", "-o", tmp_path / "p", *args)
        assert code == 2 and out.strip() == "", out


@pytest.mark.parametrize("command, args, needles, world", [
    # the default combinations have production sides
    ("train-rollout", ["--tp", "2"], ["the production runs under tp 2 × sp 1 × cfg 1", "strict family only",
                                      "give --combos strict/strict"], 2),
    ("train-rollout", ["--tp", "2", "--combos", "strict/strict"],
     ["needs 2 ranks", "torchrun --nproc-per-node 2 -m drifttool experiment train-rollout"], 1),
    ("train-rollout", ["--cfg-parallel", "2", "--combos", "strict/strict", "--tp", "2"], ["needs 4 ranks"], 2),
    ("grpo", ["--tp", "2"], ["the production runs under tp 2", "give --combos strict/strict"], 2),
    ("grpo", [], ["grpo under torchrun runs a TP/SP/CFG-parallel layout"], 2),  # no sample-parallel loop
    ("grpo", ["--tp", "2", "--combos", "strict/strict"], ["needs 2 ranks"], 1),
    ("grpo", ["--tp", "2", "--combos", "strict/strict", "-o", "{file}"], ["exists and is not a directory"], 2),
    ("train-rollout", ["--tp", "2", "--combos", "strict/strict", "-o", "{file}/x"], ["is not a directory"], 2),
])
def test_experiment_refuses_a_layout_in_one_line(cli, tmp_path, no_launch, monkeypatch, command, args,
                                                 needles, world):
    if world > 1:
        _torchrun_env(monkeypatch, 0, world)
    (tmp_path / "afile").write_text("x")
    args = [a.format(file=tmp_path / "afile") for a in args]
    code, out = cli("experiment", command, "-o", tmp_path / "e", *args)
    _one_line(code, out, *needles)
    assert "--mode" not in out  # an experiment has no --mode: its modes come from --combos
    assert not (tmp_path / "e").exists()
    if world > 1:  # the other ranks are silent: one line for the launch
        _torchrun_env(monkeypatch, 1, world)
        code, out = cli("experiment", command, "-o", tmp_path / "e", *args)
        assert code == 2 and out.strip() == "", out


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A LoRA adapter folder of the embedded default's model."""
    from drifttool.fixture import locate
    from drifttool.model.checkpoint import load_checkpoint
    from drifttool.model.lora import add_lora
    from drifttool.model.lora_io import save_lora

    m = load_checkpoint(locate("tiny-t2i") / "transformer")
    add_lora(m, rank=2, alpha=4, init_b_std=0.05)
    return save_lora(m, tmp_path_factory.mktemp("lora") / "ad")


UNFUSED = "LoRA mode 'unfused-fp32' under TP/SP"


@pytest.mark.parametrize("args, needles, world", [
    (["--tp", "2"], [f"{UNFUSED} (--tp 2 --sp 1)", "--lora-mode merged"], 1),  # before the rank count
    (["--sp", "2"], [f"{UNFUSED} (--tp 1 --sp 2)", "--tp 1 --sp 1"], 2),
    (["--tp", "2", "--sp", "2"], [f"{UNFUSED} (--tp 2 --sp 2)"], 4),
    (["--cfg-parallel", "2"], ["needs 2 ranks"], 1),  # whole CFG branches per rank: allowed
])
def test_run_refuses_an_unfused_adapter_under_tp_sp_before_the_ranks(cli, tmp_path, no_launch, monkeypatch,
                                                                    adapter, args, needles, world):
    """strict + ``--lora-mode unfused-fp32`` + TP or SP > 1: refused from the settings, before any
    process group or artifact, once for the launch (the run would refuse it on every rank)."""
    argv = ("run", "-o", tmp_path / "r", "--lora", adapter, "--lora-mode", "unfused-fp32", *args)
    if world > 1:
        _torchrun_env(monkeypatch, 0, world)
    _one_line(*cli(*argv), *needles)
    if world > 1:  # the other ranks are silent: one line for the launch
        _torchrun_env(monkeypatch, world - 1, world)
        code, out = cli(*argv)
        assert code == 2 and out.strip() == "", out
    assert not (tmp_path / "r").exists()


def test_a_merged_adapter_under_tp_passes_the_layout_checks(cli, tmp_path, no_launch, adapter):
    _one_line(*cli("run", "-o", tmp_path / "r", "--lora", adapter, "--tp", "2"), "needs 2 ranks")


@pytest.fixture(scope="module")
def stored_unfused(tmp_path_factory, adapter) -> Path:
    """A one-process strict run with its adapter unfused (FP32 factors)."""
    return Path(execute(RunSpec(lora=adapter, lora_mode="unfused-fp32", steps=2),
                        tmp_path_factory.mktemp("stored") / "unfused")["out"])


@pytest.mark.parametrize("command", ["replay", "recompute"])
@pytest.mark.parametrize("args, needle", [(["--tp", "2"], "(--tp 2 --sp 1)"), (["--sp", "2"], "(--tp 1 --sp 2)")])
def test_rerun_of_an_unfused_adapter_under_tp_sp_is_refused_before_the_ranks(
        cli, tmp_path, no_launch, monkeypatch, stored_unfused, command, args, needle):
    """A replay or recompute runs the rollout's adapter in its mode: refused alike, once."""
    _torchrun_env(monkeypatch, 0, 2)
    _one_line(*cli(command, stored_unfused, "-o", tmp_path / "r", *args), UNFUSED, needle)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, needles", [
    (["fixture", "verify"], ["[rank 0] drifttool fixture verify runs in one process: it re-runs "
                             "the fixture in one process"]),
    (["diff", "{run}", "{run}"], ["drifttool diff runs in one process"]),
])
def test_commands_without_a_layout_refuse_torchrun_by_name(cli, tmp_path, no_launch, monkeypatch,
                                                          stored, args, needles):
    _torchrun_env(monkeypatch, 0, 2)
    argv = [a.format(run=stored, out=tmp_path / "r") for a in args]
    _one_line(*cli(*argv), *needles, "only `drifttool run`, `replay`, `recompute`, `probe` and "
              "`experiment` run under torchrun")
    assert not (tmp_path / "r").exists()


# -- slow: torchrun ---------------------------------------------------------------------------

def _torchrun(n: int, *args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(n), "-m", "drifttool", *(str(a) for a in args)],
                          cwd=cwd, env=torchrun_env(), capture_output=True, text=True, timeout=300)


def _no_drifttool_traceback(out: str) -> None:
    """torchrun adds its own ChildFailedError report for a rank that exits non-zero; no frame
    of drifttool's may appear (a user error is a line, not a traceback)."""
    assert "internal error" not in out, out
    for src in SOURCES:
        assert f'File "{src}' not in out, out


@pytest.fixture(scope="module")
def ones(tmp_path_factory) -> dict[str, Path]:
    """The one-process runs the layouts diff against: the default grid at L2, 350 image tokens
    at L2 and at L1 (Ring)."""
    root = tmp_path_factory.mktemp("ones")
    out = {}
    for name, fields in (("default", {}), ("img350", dict(height=160, width=560)),
                         ("img350-L1", dict(height=160, width=560, capture="L1"))):
        out[name] = Path(execute(RunSpec(**fields), root / name)["out"])
    return out


RUNS = [
    ("tp2", 2, ["--tp", "2"], "default", "2 (tp 2 × sp 1 × cfg 1)"),
    ("sp2-agrs", 2, ["--sp", "2", "--sp-attention", "agrs", *IMG], "img350", "2 (tp 1 × sp 2 agrs × cfg 1)"),
    ("sp2-ulysses", 2, ["--sp", "2", "--sp-attention", "ulysses", *IMG], "img350",
     "2 (tp 1 × sp 2 ulysses × cfg 1)"),
    ("sp2-ring", 2, ["--sp", "2", "--sp-attention", "ring", "--capture", "L1", *IMG], "img350-L1",
     "2 (tp 1 × sp 2 ring × cfg 1)"),
    # L2 without the attention internals, which a ring rank cannot hold: every other L2 record
    ("sp2-ring-L2", 2, ["--sp", "2", "--sp-attention", "ring", "--no-internals", *IMG], "img350",
     "2 (tp 1 × sp 2 ring × cfg 1)"),
    ("tp2xsp2", 4, ["--tp", "2", "--sp", "2"], "default", "4 (tp 2 × sp 2 agrs × cfg 1)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, n, args, one, row", RUNS, ids=[r[0] for r in RUNS])
def test_run_layout_under_torchrun_is_identical(cli, tmp_path, ones, name, n, args, one, row):
    p = _torchrun(n, "run", "-o", tmp_path / name, *args, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert row in p.stdout and p.stdout.count("drifttool run →") == 1, p.stdout  # rank 0 prints
    manifest = json.loads((tmp_path / name / "manifest.json").read_text())
    layout = manifest["layout"]
    assert manifest["complete"] and layout["kind"] == "parallel" and layout["world_size"] == n
    code, out = cli("diff", ones[one], tmp_path / name)
    assert code == 0 and "IDENTICAL" in out and f"B parallel over {n} ranks" in out, out


@pytest.mark.slow
def test_ring_at_l2_under_torchrun_is_one_line(tmp_path):
    p = _torchrun(2, "run", "-o", tmp_path / "ring", "--sp", "2", "--sp-attention", "ring", *IMG,
                  cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert errors == ["error: --sp-attention ring cannot capture L2 (the fixture's default): a ring "
                      "rank never holds a whole row of attention scores, so the attention internals "
                      "L2 records do not exist; use --capture L1 (or L0), --no-internals, or "
                      "--sp-attention agrs|ulysses at L2"], out
    _no_drifttool_traceback(out)
    assert not (tmp_path / "ring").exists()  # refused before the artifact opened


@pytest.mark.slow
def test_unfused_adapter_under_tp_under_torchrun_is_one_line(tmp_path, adapter):
    p = _torchrun(2, "run", "-o", tmp_path / "u", "--tp", "2", "--lora", adapter, "--lora-mode",
                  "unfused-fp32", cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"{UNFUSED} (--tp 2 --sp 1)" in errors[0], out
    _no_drifttool_traceback(out)
    assert not (tmp_path / "u").exists()  # refused before the artifact opened


REPLAYS = [
    ("tp2", 2, ["--tp", "2"], "default", "2 (tp 2 × sp 1 × cfg 1)"),
    ("sp2-ring", 2, ["--sp", "2", "--sp-attention", "ring"], "img350-L1", "2 (tp 1 × sp 2 ring × cfg 1)"),
    ("cfg2", 2, ["--cfg-parallel", "2"], "default", "2 (tp 1 × sp 1 × cfg 2)"),
    ("sample-parallel", 2, [], "default", "2 (sample-parallel)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, n, args, one, row", REPLAYS, ids=[r[0] for r in REPLAYS])
def test_replay_under_a_layout_is_identical(cli, tmp_path, ones, name, n, args, one, row):
    """A one-process run replayed under a layout diffs identical to it."""
    p = _torchrun(n, "replay", ones[one], "-o", tmp_path / name, *args, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert row in p.stdout and p.stdout.count("drifttool replay") == 1, p.stdout
    manifest = json.loads((tmp_path / name / "manifest.json").read_text())
    assert manifest["complete"] and manifest["replay_of"]["path"] == str(ones[one])
    code, out = cli("diff", ones[one], tmp_path / name)
    assert code == 0 and "IDENTICAL" in out, out


@pytest.mark.slow
def test_a_parallel_run_replays_identical_in_one_process(cli, tmp_path, ones):
    """Vice versa: a TP 2 × SP 2 run replayed in one process (and under another layout) diffs
    identical to it, and to the one-process run."""
    p = _torchrun(4, "run", "-o", tmp_path / "par", "--tp", "2", "--sp", "2", "--sp-attention", "agrs",
                  "--capture", "L1", *IMG, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    code, out = cli("replay", tmp_path / "par", "-o", tmp_path / "par-one")
    assert code == 0 and "│ ranks" not in out, out  # one process: no ranks row
    code, out = cli("diff", tmp_path / "par", tmp_path / "par-one")
    assert code == 0 and "IDENTICAL" in out and "A parallel over 4 ranks" in out, out
    p = _torchrun(2, "replay", tmp_path / "par", "-o", tmp_path / "par-sp2", "--sp", "2",
                  "--sp-attention", "ring", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    for a, b in ((tmp_path / "par", tmp_path / "par-sp2"), (ones["img350-L1"], tmp_path / "par-one")):
        code, out = cli("diff", a, b)
        assert code == 0 and "IDENTICAL" in out, out


RECOMPUTES = [
    ("cfg2", ["--cfg-parallel", "2"], "2 (tp 1 × sp 1 × cfg 2)"),
    ("sample-parallel", [], "2 (sample-parallel)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, args, row", RECOMPUTES, ids=[r[0] for r in RECOMPUTES])
def test_recompute_under_a_layout_is_identical(cli, tmp_path, ones, name, args, row):
    """A one-process rollout recomputed on 2 ranks: phase train diffs identical to it."""
    p = _torchrun(2, "recompute", ones["default"], "-o", tmp_path / name, *args, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert row in p.stdout and p.stdout.count("drifttool recompute") == 1, p.stdout
    code, out = cli("diff", ones["default"], tmp_path / name)
    assert code == 0 and "IDENTICAL" in out, out


@pytest.mark.slow
def test_recompute_under_ring_attention_is_identical(cli, tmp_path, ones):
    """Ring attention in phase train (autograd on: the Ring forward, AG/RS's backward)."""
    p = _torchrun(2, "recompute", ones["img350-L1"], "-o", tmp_path / "ring", "--sp", "2",
                  "--sp-attention", "ring", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    code, out = cli("diff", ones["img350-L1"], tmp_path / "ring")
    assert code == 0 and "IDENTICAL" in out, out


@pytest.mark.slow
def test_train_rollout_under_torchrun(tmp_path):
    p = _torchrun(2, "experiment", "train-rollout", "--tp", "2", "--combos", "strict/strict",
                  "-o", tmp_path / "e", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads((tmp_path / "e" / "train_rollout.json").read_text())
    assert [(r["combo"], r["identical"]) for r in rows] == [("strict/strict", True)]
    assert p.stdout.count("first drift") == 1, p.stdout  # the tables are printed once


@pytest.mark.slow
def test_grpo_under_torchrun(tmp_path):
    p = _torchrun(2, "experiment", "grpo", "--tp", "2", "--combos", "strict/strict", "--steps", "1",
                  "-o", tmp_path / "g", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads((tmp_path / "g" / "grpo.json").read_text())
    assert rows[0]["ratio_exactly_one"] and p.stdout.count("Flow-GRPO strict/strict") == 1, p.stdout


@pytest.mark.slow
def test_probe_matrix_under_torchrun(tmp_path):
    """``torchrun ... probe --tp 2``: every run on both ranks, one matrix written and printed once."""
    p = _torchrun(2, "probe", "--tp", "2", "--only", "gelu_exact,replay", "--no-heatmaps",
                  "-o", tmp_path / "m", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    matrix = json.loads((tmp_path / "m" / "matrix.json").read_text())
    assert {r["name"]: r["status"] for r in matrix["results"]} == {"gelu_exact": "PASS", "replay": "PASS"}
    assert p.stdout.count("gelu_exact") == 1, p.stdout
    layout = json.loads((tmp_path / "m" / "runs" / "baseline" / "manifest.json").read_text())["layout"]
    assert (layout["kind"], layout["tp"]) == ("parallel", 2)


@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (["overlay", "{out}", "{out}", "-o", "{out}.png"], "drifttool overlay runs in one process"),
])
def test_commands_without_a_layout_refuse_torchrun(tmp_path, args, needle):
    p = _torchrun(2, *[a.format(out=tmp_path / "out") for a in args], cwd=tmp_path)
    out = p.stdout + p.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert p.returncode != 0 and errors and all(needle in ln for ln in errors), out
    _no_drifttool_traceback(out)
    assert not (tmp_path / "out").exists()
