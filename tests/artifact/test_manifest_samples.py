"""``settings.samples`` checked by the reader: ``open_run`` refuses sample ids no run has (none,
one named twice, a negative one; ``manifest.samples_problem``) before it reads a record, and
``Run.check`` (which diff, report, replay and recompute call) refuses records of a sample the
manifest does not name (``coverage.check_named_samples``). Runs drifttool writes pass: runs
relabelled with ``sample_labels``, incomplete runs, and runs with no step records at all."""

from __future__ import annotations

import json
import shutil

import pyarrow.compute as pc
import pytest

from drifttool.artifact import open_run
from drifttool.artifact import schema as S
from drifttool.errors import ArtifactError
from drifttool.runner import execute
from drifttool.settings import RunSpec
from tests.artifact.table_files import rewrite_table


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Small strict runs of samples 0 and 1 (2 steps): ``whole`` complete, ``cut`` stopped after
    its first step, ``unstarted`` stopped before its first (no step records), shared read-only."""
    root = tmp_path_factory.mktemp("samples")
    execute(RunSpec(steps=2), root / "whole")
    execute(RunSpec(steps=2), root / "cut", max_steps=1)
    execute(RunSpec(steps=2), root / "unstarted", max_steps=0)
    return root


def _copy(src, dst, **settings):
    shutil.copytree(src, dst)
    m = json.loads((dst / S.MANIFEST).read_text())
    m["settings"].update(settings)
    (dst / S.MANIFEST).write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("samples,needle", [
    ([0, 0], "settings.samples has duplicate sample ids: [0] named more than once"),
    ([1, 0, 3, 1, 3], "settings.samples has duplicate sample ids: [1, 3] named more than once"),
    ([], "settings.samples is empty: the run names no sample"),
    ([0, -2], "settings.samples holds negative sample id(s) [-2]: ids are at least 0"),
])
@pytest.mark.parametrize("which", ["whole", "cut", "unstarted"])
def test_open_run_refuses_sample_ids_no_run_has(runs, tmp_path, which, samples, needle):
    """Refused at open, whatever the run holds (an incomplete one, one without step records)."""
    bad = _copy(runs / which, tmp_path / "bad", samples=samples)
    with pytest.raises(ArtifactError) as e:
        open_run(bad)
    assert str(e.value) == f"{bad / S.MANIFEST}: corrupt manifest ({needle})"


@pytest.mark.parametrize("which", ["whole", "cut"])
def test_records_of_a_sample_the_manifest_leaves_out_are_refused(runs, tmp_path, which):
    """Complete or not: records of sample 1 under a manifest naming sample 0 alone."""
    bad = _copy(runs / which, tmp_path / "bad", samples=[0])
    run = open_run(bad)
    with pytest.raises(ArtifactError) as e:
        run.check()
    assert str(e.value) == (f"{bad / S.MANIFEST}: corrupt manifest (settings.samples [0] "
                            "disagrees with the records: steps.rank* holds sample(s) [1], which "
                            "it does not name)")


def test_op_records_of_a_sample_the_manifest_leaves_out_are_refused(runs, tmp_path):
    """The step records agree with the manifest, the op records hold another sample."""
    bad = _copy(runs / "whole", tmp_path / "bad", samples=[0])
    rewrite_table(bad / S.rank_file("steps", 0), lambda t: t.filter(pc.equal(t["sample"], 0)))
    with pytest.raises(ArtifactError, match=r"settings.samples \[0\] disagrees with the records: "
                                            r"ops.rank\* holds sample\(s\) \[1\]"):
        open_run(bad).check()


def test_runs_whose_records_hold_their_samples_pass(runs, tmp_path):
    """Controls: the runs as written; an incomplete run naming a sample it has no records of yet
    (a rank that had not written it); a run with no step records, whatever samples it names."""
    for which in ("whole", "cut", "unstarted"):
        assert open_run(runs / which).check() == []
    assert open_run(runs / "unstarted").steps_table().num_rows == 0
    more = _copy(runs / "cut", tmp_path / "more", samples=[0, 1, 2])
    assert open_run(more).check() == []
    other = _copy(runs / "unstarted", tmp_path / "other", samples=[5])
    assert open_run(other).check() == []


def test_a_complete_run_naming_a_sample_it_has_no_records_of_lost_records(runs, tmp_path):
    bad = _copy(runs / "whole", tmp_path / "bad", samples=[0, 1, 2])
    with pytest.raises(ArtifactError, match=r"marked complete, but no step records of sample\(s\) "
                                            r"\[2\] \(settings.samples names them\)"):
        open_run(bad).check()


def test_a_relabelled_run_is_checked_against_its_labels(tmp_path):
    """``sample_labels`` are the ids its records carry: a run of samples 2 and 5 labelled 7 and 8
    passes (it was refused as having lost samples 2 and 5); labels that disagree with the
    records, or not one per sample, are a corrupt manifest."""
    execute(RunSpec(steps=2, samples=[2, 5], sample_labels=[7, 8]), tmp_path / "r")
    assert open_run(tmp_path / "r").check() == []
    bad = _copy(tmp_path / "r", tmp_path / "bad", sample_labels=[7, 9])
    with pytest.raises(ArtifactError, match=r"corrupt manifest \(settings.sample_labels \[7, 9\] "
                                            r"disagrees with the records: steps.rank\* holds "
                                            r"sample\(s\) \[8\]"):
        open_run(bad).check()
    short = _copy(tmp_path / "r", tmp_path / "short", sample_labels=[7])
    with pytest.raises(ArtifactError, match=r"corrupt manifest \(settings.sample_labels names 1 "
                                            r"id\(s\) for the 2 sample\(s\) of settings.samples"):
        open_run(short)
