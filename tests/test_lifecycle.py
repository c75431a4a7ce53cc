"""The one artifact life cycle (``drifttool.lifecycle``) and the typed settings it records
(``drifttool.settings``, ``drifttool.training.options``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from drifttool.artifact.reader import open_run
from drifttool.artifact.writer import ArtifactWriter
from drifttool.errors import DriftToolError
from drifttool.fixture import load_fixture
from drifttool.lifecycle import ArtifactSession, close_incomplete
from drifttool.probes.sampler_variants import SigmaSeqLenPixels
from drifttool.runner import execute
from drifttool.runtime import Mode
from drifttool.settings import RunSpec, resolve
from drifttool.training.options import RerunOptions, TrainOptions


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


# -- settings ---------------------------------------------------------------------------------
def test_settings_record_is_the_sealed_fixtures_manifest_settings():
    """The typed settings record exactly what the sealed fixture's manifest holds (same keys,
    same JSON values: ``cfg_scale`` 4.0 stays a float, lists stay lists)."""
    fx, s = resolve(RunSpec())
    want = _manifest(load_fixture("tiny-t2i").expected_dir)["settings"]
    got = json.loads(json.dumps(s.record(), sort_keys=True))
    assert got == want
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


def test_optional_settings_are_recorded_only_when_set():
    _, s = resolve(RunSpec(samples=[2, 0], pad_prompts_to=40, sample_labels=[7, 9]))
    r = s.record()
    assert (r["samples"], r["pad_prompts_to"], r["sample_labels"]) == ([2, 0], 40, [7, 9])
    assert "variant" not in r and "lora" not in r
    assert s.labels == [7, 9]


def test_settings_are_frozen_and_typed():
    _, s = resolve(RunSpec(batch=3, mode="auto"))
    assert s.samples == (0, 1, 2) and s.mode is Mode.AUTO
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.steps = 7  # type: ignore[misc]
    with pytest.raises(TypeError):
        RunSpec("tiny-t2i")  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize("spec, message", [
    (RunSpec(batch=2, samples=[0]), "give either a batch size or sample ids, not both"),
    (RunSpec(steps=1), "steps must be an integer from 2 to 1000"),
    (RunSpec(eta=-1.0), "eta must be a finite number >= 0, got -1"),
    (RunSpec(cfg_scale=float("nan")), "cfg_scale must be a finite number >= 0, got nan"),
    (RunSpec(cfg_scale=-0.5), "cfg_scale must be a finite number >= 0, got -0.5"),
    (RunSpec(mode="fast"), "unknown mode 'fast' (strict, audit, auto, off)"),
    (RunSpec(capture="L3"), "unknown capture level 'L3' (L0, L1, L2)"),
    (RunSpec(dtype="float16"), "unsupported dtype 'float16'"),
    (RunSpec(cfg_layout="zigzag"), "unknown cfg_layout 'zigzag'"),
    (RunSpec(samples=[1, 1]), "sample ids must be distinct and >= 0 (1 given more than once)"),
    (RunSpec(samples=[]), "no sample ids: give at least one"),
    (RunSpec(variant="fp16"), "a weight variant needs a checkpoint"),
    (RunSpec(samples=[0, 1], sample_labels=[3]), "must name one id per sample"),
    (RunSpec(samples=[2**31]), "sample ids must be at most 2147483647 (the artifact's int32"),
    (RunSpec(mode="auto", preset="diffusers", seed=-1),
     "seed + sample id must be in [0, 2^63), got seed -1 with sample 0"),
    (RunSpec(mode="auto", preset="diffusers", seed=2**63 - 1),
     "got seed 9223372036854775807 with sample 1"),
    (RunSpec(mode="auto", preset="flow-grpo", seed=2**64), "seed must be an integer in [-2^63, 2^64)"),
])
def test_resolve_refuses_bad_settings_in_one_line(spec, message):
    with pytest.raises(DriftToolError) as e:
        resolve(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_batch_past_the_last_sample_id_is_refused_before_its_ids_are_listed(monkeypatch):
    import drifttool.settings as settings

    monkeypatch.setattr(settings, "MAX_SAMPLE_ID", 7)  # a real 2^31 + 1 would list 2^31 ids
    with pytest.raises(DriftToolError, match=r"^a batch of 9 samples is more than logical sample "
                                             r"ids 0\.\.7 hold"):
        resolve(RunSpec(batch=9))
    assert resolve(RunSpec(batch=8))[1].samples == tuple(range(8))


def test_the_edges_of_sample_ids_and_preset_seeds_resolve():
    assert resolve(RunSpec(samples=[2**31 - 1]))[1].samples == (2**31 - 1,)
    assert resolve(RunSpec(mode="auto", preset="diffusers", seed=2**63 - 2))[1].seed == 2**63 - 2
    assert resolve(RunSpec(mode="auto", preset="flow-grpo", seed=-(2**63)))[1].seed == -(2**63)
    assert resolve(RunSpec(seed=-1))[1].seed == -1  # drifttool's own noise hashes any seed
    assert resolve(RunSpec(cfg_scale=0.0))[1].cfg_branches == 1  # CFG off, as diffusers' <= 1


def test_rerun_options_validate_with_the_lines_run_uses():
    with pytest.raises(DriftToolError, match=r"^unknown mode 'fast' \(strict, audit, auto, off\)$"):
        RerunOptions(mode="fast")
    with pytest.raises(DriftToolError, match=r"^unknown capture level 'L9' \(L0, L1, L2\)$"):
        RerunOptions(capture="L9")
    with pytest.raises(DriftToolError, match="micro-batch size must be >= 1, got 0"):
        TrainOptions(micro_batch=0)
    assert RerunOptions(mode="audit", capture="L2").mode == "audit"


def test_a_capture_level_is_read_in_either_case_and_kept_canonical():
    assert resolve(RunSpec(capture="l2"))[1].capture == "L2"
    assert RerunOptions(capture="l0").capture == "L0"
    with pytest.raises(DriftToolError, match=r"^unknown capture level 'l3' \(L0, L1, L2\)$"):
        resolve(RunSpec(capture="l3"))


def test_a_mode_is_read_in_either_case_and_kept_canonical():
    """As a capture level: ``--mode STRICT`` runs strict mode (it was refused beside ``--capture
    l1``'s acceptance)."""
    assert resolve(RunSpec(mode="STRICT"))[1].mode == "strict"
    assert RerunOptions(mode="Audit").mode == "audit"


def test_a_dtype_cfg_layout_and_timestep_policy_are_read_in_either_case():
    settings = resolve(RunSpec(dtype="FLOAT32", cfg_layout="Sequential", timestep_policy="SIGMA_FP32"))[1]
    assert (settings.dtype, settings.cfg_layout, settings.timestep_policy) == ("float32", "sequential", "sigma_fp32")
    with pytest.raises(DriftToolError, match=r"^unsupported dtype 'float16' "):
        resolve(RunSpec(dtype="Float16"))


def test_a_device_is_read_in_either_case():
    assert resolve(RunSpec(device="CPU"))[1].device == "cpu"
    assert RerunOptions(device="Cpu").device == "cpu"


# -- life cycle -------------------------------------------------------------------------------
class _BrokenTrace:
    def rows(self):
        raise OSError(28, "No space left on device")


class _Rt:
    trace = _BrokenTrace()


def test_close_incomplete_keeps_the_runs_exception_and_notes_the_secondary(tmp_path):
    writer = ArtifactWriter(tmp_path / "a", {"kind": "rollout"})
    own = RuntimeError("the run's own failure")
    close_incomplete(_Rt(), None, writer, own)  # does not raise: the run's exception is the one
    assert writer.closed and _manifest(tmp_path / "a")["complete"] is False
    assert len(own.__notes__) == 1
    assert own.__notes__[0].startswith("while closing the artifact incomplete: ")
    assert "No space left on device" in own.__notes__[0]


def test_close_incomplete_without_an_exception_raises_the_secondary(tmp_path):
    writer = ArtifactWriter(tmp_path / "a", {"kind": "rollout"})
    with pytest.raises(OSError, match="No space left"):
        close_incomplete(_Rt(), None, writer)
    assert writer.closed and _manifest(tmp_path / "a")["complete"] is False


def _session(**kw):
    return ArtifactSession(mode=kw.pop("mode", Mode.STRICT), level="L1", cfg_layout="batched", **kw)


def test_a_failing_run_leaves_the_artifact_incomplete_and_raises_its_own_error(tmp_path):
    session = _session()
    with pytest.raises(ValueError, match="boom"):
        with session.open(tmp_path / "a", {"kind": "rollout"}):
            session.write_inputs({})
            raise ValueError("boom")
    m = _manifest(tmp_path / "a")
    assert m["complete"] is False and m["capture_level"] == "L1" and m["files"]["trace"]


def test_a_block_left_without_finish_is_incomplete(tmp_path):
    session = _session()
    with session.open(tmp_path / "a", {"kind": "rollout"}):
        pass
    assert _manifest(tmp_path / "a")["complete"] is False


def test_finish_closes_complete_with_the_fields(tmp_path):
    session = _session(mode=Mode.OFF)
    with session.open(tmp_path / "a", {"kind": "recompute"}) as s:
        assert s.recorder is None and s.rt.mode is Mode.OFF
        s.finish(complete=True, seconds=1.5)
    m = _manifest(tmp_path / "a")
    assert m["complete"] is True and m["seconds"] == 1.5


def test_the_manifest_layout_comes_from_rank_world_and_layout(tmp_path):
    assert _session().manifest_layout() == {"world_size": 1, "tp": 1, "sp": 1, "cfg_parallel": 1,
                                            "cfg_layout": "batched", "kind": "single"}
    layout = {"kind": "sample_parallel", "world_size": 2, "samples": {"0": [0, 1], "1": [2, 3]}}
    two = _session(rank=1, world_size=2, layout=layout)
    assert two.manifest_layout()["world_size"] == 2 and two.manifest_layout()["samples"] == layout["samples"]
    with pytest.raises(ValueError, match="rank 2 outside"):
        _session(rank=2, world_size=2)
    with pytest.raises(ValueError, match="layout states world_size 2"):
        _session(world_size=1, layout={"kind": "sample_parallel", "world_size": 2})


def test_a_run_records_its_layout(tmp_path):
    execute(RunSpec(steps=2, capture="L0"), tmp_path / "a")
    run = open_run(tmp_path / "a")  # the reader accepts it (schema)
    assert run.manifest["layout"] == {"world_size": 1, "tp": 1, "sp": 1, "cfg_parallel": 1,
                                      "cfg_layout": "batched", "kind": "single"}


def test_the_manifests_sigma_table_is_the_one_the_run_used(tmp_path):
    """Under a ``flow_sigma_table`` variant the manifest pins the variant's table (the step
    records' sigmas), not the strict table (review §2 item 5)."""
    execute(RunSpec(capture="L0"), tmp_path / "plain")
    execute(RunSpec(capture="L0", variants={"flow_sigma_table": SigmaSeqLenPixels().entry()}),
            tmp_path / "v")
    tables = {}
    for name in ("plain", "v"):
        run = open_run(tmp_path / name)
        table = run.manifest["fingerprint"]["scheduler"]["sigma_table"]
        steps = run.steps_table().to_pylist()
        used = {r["step"]: r["sigma"] for r in steps}
        assert [used[i] for i in sorted(used)] == table[:-1], name
        nxt = {r["step"]: r["sigma_next"] for r in steps}
        assert nxt[max(nxt)] == table[-1], name
        tables[name] = table
    assert tables["plain"] != tables["v"]
