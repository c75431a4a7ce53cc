"""The step progress bar: steps done/total, samples × CFG branches, elapsed and remaining time;
the branch count the CLI shows is the one the rollout runs."""

import io

import pytest
from rich.console import Console

from drifttool.cli._console import per_step, progress, step_task
from drifttool.runner import execute
from drifttool.settings import RunSpec, resolve


def test_bar_shows_steps_samples_branches_and_time():
    buf = io.StringIO()
    on = Console(file=buf, force_terminal=True, force_interactive=True, width=160)
    bar = progress(on)
    assert not bar.disable
    with bar:
        task = step_task(bar, "auto rollout", 7, 3, 2)
        bar.advance(task, 3)
        bar.refresh()
        text = buf.getvalue()
    assert "auto rollout" in text and "3/7" in text
    assert "3 samples × 2 CFG branches" in text
    assert "left" in text and "0:00:0" in text  # elapsed and remaining clocks
    assert per_step(1, 1) == "1 sample × 1 CFG branch"


def test_bar_is_silent_off_a_terminal():
    buf = io.StringIO()
    bar = progress(Console(file=buf, force_terminal=False, force_interactive=False))
    assert bar.disable
    with bar:
        bar.advance(step_task(bar, "replay", 2, 1, 1))
    assert buf.getvalue() == ""


@pytest.mark.parametrize("spec", [RunSpec(capture="L0", steps=2), RunSpec(capture="L0", steps=2, cfg_scale=1.0),
                                  RunSpec(capture="L0", steps=2, batch=3)])
def test_cfg_branches_is_what_the_rollout_runs(tmp_path, spec):
    _, s = resolve(spec)
    seen = []
    execute(spec, tmp_path / "r", on_step=lambda o: seen.append((o.x.shape[0], o.v_uncond is not None)))
    assert seen and all(n == len(s.samples) for n, _ in seen)
    assert all((2 if cfg else 1) == s.cfg_branches for _, cfg in seen)
