"""``run --fixture`` with a fixture ``run`` cannot take (an edit fixture; a chain fixture without
--prompt) is one line naming what the fixture is and the command that runs it."""

import pytest

from tests.cli.scripting import invoke


@pytest.mark.parametrize("args,what", [
    (("--fixture", "tiny-edit"), "an edit fixture"),
    (("--fixture", "tiny-edit", "--prompt", "a red cube"), "an edit fixture"),
    (("--fixture", "tiny-t2i-chain"), "a chain fixture"),
])
def test_a_fixture_run_cannot_take_is_one_line_naming_what_runs_it(tmp_path, args, what):
    res = invoke("run", *args, "-o", tmp_path / "out")
    assert res.exit_code == 2, res.output
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) <= 3 and lines[0].startswith("error:"), res.stderr  # one line, maybe wrapped
    flat = " ".join(res.stderr.split())
    assert what in flat and f"drifttool fixture verify {args[1]}" in flat, flat
    assert "--prompt" in flat or "--condition" in flat
    assert not (tmp_path / "out").exists()
