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


@pytest.mark.parametrize("width", [36, 50, 64, 80, 100, 120])
def test_a_narrow_terminal_keeps_the_counts_and_time_left_whole(width):
    """On a terminal too narrow for the whole line the bar shrinks and what a step runs, the
    elapsed time and the bar go, never a count or the time left: rich had cut them to ``1200…``
    and ``-:--:…`` at 80 columns. Every line fits; the widest layout that fits is taken."""
    from drifttool.cli._console import load_reporter, matrix_progress

    buf = io.StringIO()
    on = Console(file=buf, force_terminal=True, force_interactive=True, width=width)
    bar = progress(on)
    report = load_reporter(bar)
    report(12000 << 20, 38000 << 20)
    bar.advance(step_task(bar, "strict rollout", 10, 3, 2), 3)
    matrix = matrix_progress(24, "probe matrix", on)
    matrix.update(matrix.task_ids[0], advance=5, last="rope_rotate_half pass")
    lines = ["".join(seg.text for seg in line).rstrip()
             for b in (bar, matrix) for line in on.render_lines(b.get_renderable(), on.options)]
    assert len(lines) == 3 and all(len(ln) <= width and "…" not in ln for ln in lines), lines
    load, steps, probes = lines
    assert "12000/38000" in load and "3/10" in steps and "5/24" in probes, lines
    assert all(ln.endswith(("-:--:--", "pass")) for ln in lines), lines
    assert ("3 samples × 2 CFG branches" in steps) is (width >= 100), lines


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


def test_the_load_has_its_own_bar_above_the_steps(tmp_path):
    from drifttool.cli._console import load_reporter
    from drifttool.fixture import load_fixture
    from drifttool.model.checkpoint import load_checkpoint, load_progress

    buf = io.StringIO()
    bar = progress(Console(file=buf, force_terminal=True, force_interactive=True, width=160))
    reports = []
    with bar:
        draw = load_reporter(bar)
        step_task(bar, "strict rollout", 4, 1, 2)
        assert [t.visible for t in bar.tasks] == [False, True]  # nothing loaded yet

        def report(done, total):
            reports.append((done, total))
            draw(done, total)

        with load_progress(report):
            load_checkpoint(load_fixture("tiny-t2i").model_dir)
        bar.refresh()
        text = buf.getvalue()
    done = [d for d, _ in reports]
    assert done == sorted(done) and done[0] == 0 and done[-1] == reports[0][1] > 0
    assert "load checkpoint" in text and "MiB of weights" in text
    assert text.rindex("load checkpoint") < text.rindex("strict rollout")  # the load's line first
    assert [t.visible for t in bar.tasks] == [True, True]
    load = bar.tasks[0]  # the tiny checkpoint, under 1 MiB: done, as 1/1 MiB (it read 0/1 before)
    assert load.finished and (load.completed, load.total) == (1, 1), (load.completed, load.total)
    load_checkpoint(load_fixture("tiny-t2i").model_dir)  # outside the block: nobody is told
    assert len(reports) == len(done)
