"""``--json`` on every command that reports: one strict JSON document on stdout and nothing else,
``schema_version`` and ``command`` first, numbers as numbers (a non-finite one as ``null`` beside
a ``<key>_nonfinite`` key), lists whole. Each command's keys and value types are pinned here."""

from __future__ import annotations

import json
import math

import pytest

from drifttool.artifact import open_run
from drifttool.jsondata import SCHEMA_VERSION, plain
from tests.cli.scripting import invoke, json_out, shape

HEAD = {"schema_version": "int", "command": "str"}

RUN_KEYS = {**HEAD, "out": "str", "complete": "bool", "steps": "int", "samples": ["int"],
            "mode": "str", "capture": "str", "nonfinite": "int", "lora": "null", "warnings": [],
            "notes": [], "fault_effects": {}, "cuda_graphs": "null"}
RANKS = {"world_size": "int", "layout": "str", "tp": "int", "sp": "int", "sp_attention": "null",
         "cfg_parallel": "int"}


def test_run_json_shape(tmp_path):
    code, data = json_out("run", "--steps", "2", "--capture", "L0", "-o", tmp_path / "r")
    assert code == 0
    s = shape(data)
    settings = s.pop("settings")
    assert s == {**RUN_KEYS, "ranks": RANKS, "cfg": "bool", "image_px": ["int"], "device": "str"}
    assert data["command"] == "run" and data["schema_version"] == SCHEMA_VERSION
    assert settings["seed"] == "int" and settings["mode"] == "str" and settings["steps"] == "int"
    assert data["ranks"]["layout"] == "one process"


def test_replay_and_recompute_json_shapes(tmp_path, strict_run):
    code, data = json_out("replay", strict_run, "-o", tmp_path / "re")
    assert code == 0
    assert shape(data) == {**RUN_KEYS, "command": "str", "source": "str", "ranks": RANKS,
                           "compare": ["str"]}
    assert data["compare"] == ["drifttool", "diff", str(strict_run), str(tmp_path / "re")]
    code, data = json_out("recompute", strict_run, "-o", tmp_path / "rc")
    assert code == 0
    assert shape(data) == {**HEAD, "out": "str", "complete": "bool", "steps": "int",
                           "samples": ["int"], "mode": "str", "capture": "str",
                           "grad_records": "int", "seconds": "float", "cuda_graphs": "null", "source": "str",
                           "ranks": RANKS, "timestep_policy": "str", "cfg_layout": "str",
                           "stored_latents": "str", "compare": ["str"]}


def test_trace_json_shape_lists_every_site(strict_run):
    code, data = json_out("trace", strict_run)
    assert code == 0
    assert shape(data) == {**HEAD, "run": "str", "mode": "str", "complete": "bool",
                           "call_sites": "int", "fallbacks": "int", "ranks": ["int"],
                           "blocks": {"mmdit": "int"}, "sites": [{"rank": "int", "device": "str", "component": "str",
                                      "op": "str", "block": "int", "stream": "str", "call": "int",
                                      "contract": "str", "requested": "str", "actual": "str",
                                      "kernel": "str", "fallback": "bool", "reason": "str",
                                      "declared": "bool", "calls": "int"}]}
    assert len(data["sites"]) == data["call_sites"] > 20
    after = {s["op"] for s in data["sites"] if s["block"] == data["blocks"]["mmdit"]}  # after the last block
    assert "final_adaln_out" in after and max(s["block"] for s in data["sites"]) \
        == data["blocks"]["mmdit"]


DIFF_KEYS = {"verdict", "reason", "run_a", "run_b", "level", "covers", "incomparable", "context",
             "input_differences", "notes", "counts", "identical_through", "first_drift", "steps",
             "tolerance", "semantic", "clip"}


def test_diff_json_shape(strict_run, tmp_path):
    assert json_out("run", "--mode", "auto", "-o", tmp_path / "auto")[0] == 0
    code, data = json_out("diff", strict_run, tmp_path / "auto")
    assert code == 1
    assert list(data)[:2] == ["schema_version", "command"] and set(data) == {*HEAD, *DIFF_KEYS}
    fd = shape(data["first_drift"])
    assert fd["op"] == "str" and fd["step"] == "int" and fd["maxabs"] == ["float"]
    assert fd["origin"] == "bool" and fd["digest"] == ["str"]
    for st in data["steps"]:  # the sigma table's "step" has no sigma: null, named as NaN
        assert isinstance(st["sigma"], float) or (st["sigma"] is None and st["sigma_nonfinite"] == "nan")
    q = shape([q for s in data["steps"] for q in s["quantities"]])[0]
    assert q["quantity"] == "str" and q["max_abs"] in ("float", "null") and q["identical"] == "bool"
    assert shape(data["counts"]) == {k: {c: "int" for c in ("a", "b", "matched", "differ",
                                                            "only_a", "only_b")}
                                     for k in ("ops", "steps")}
    # every context line is whole: no "... and N more" in the data
    assert not any("more" in line and line.startswith("...") for line in data["context"])
    # and every value in it (the RoPE tables' descriptions, over 60 characters, were cut to "...")
    tables = [open_run(r).manifest["fingerprint"]["inputs"]["rope_tables"] for r in (strict_run, tmp_path / "auto")]
    assert max(map(len, tables)) > 60
    assert f"fingerprint.inputs.rope_tables: {json.dumps(tables[0])} != {json.dumps(tables[1])}" in data["context"]


def test_fixture_verify_json_shape():
    code, data = json_out("fixture", "verify")
    assert code == 0
    s = shape(data)
    report = s.pop("report")
    assert s == {**HEAD, "fixture": "str", "content_digest": "str", "seal": "str",
                 "replay_dir": "null", "exit_code": "int", "images": [], "note": "null"}
    assert set(report) == {"schema_version", *DIFF_KEYS} and data["report"]["verdict"] == "identical"
    # tests/cli/test_chain_fixtures.py checks "images" of a fixture that decodes one


def test_probe_list_json_shape():
    code, data = json_out("probe", "--list")
    assert code == 0
    assert shape(data) == {**HEAD, "probes": [{"name": "str", "kind": "str", "factor": "str",
                                               "expected": "str", "pending": "null", "layout": "null"}]}
    assert len(data["probes"]) > 10


def test_probe_json_shape(tmp_path, monkeypatch, fake_matrix):
    monkeypatch.setattr("drifttool.probes.runner.run_matrix", lambda *a, **k: fake_matrix)
    monkeypatch.setattr("drifttool.cli.probe._heatmaps", lambda m, out: [])
    res = invoke("probe", "-o", tmp_path / "m", "--json", "--junit", tmp_path / "j.xml")
    assert res.exit_code == 1
    import json

    data = json.loads(res.stdout)
    s = shape(data)
    assert data["results"][1]["v_t"] is None and data["results"][1]["v_t_nonfinite"] == "nan"
    assert {k: s[k] for k in ("schema_version", "command", "matrix_version", "exit_code", "counts",
                              "files")} == {
        **HEAD, "matrix_version": "int", "exit_code": "int",
        "counts": {k: "int" for k in ("PASS", "FINDING", "ERROR", "PENDING", "OBSERVED",
                                      "NOT APPLICABLE")},
        "files": {"matrix_json": "str", "matrix_arrow": "str", "heatmaps": [], "junit": "str"}}


def test_stdout_holds_only_the_document_and_errors_stay_one_line(strict_run, tmp_path):
    res = invoke("diff", strict_run, tmp_path / "missing", "--json")
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.startswith("error:")


def test_nonfinite_numbers_are_null_beside_a_word():
    data = plain({"a": math.nan, "b": [1.0, -math.inf], "c": {"d": math.inf}, "e": 2.5})
    assert data == {"a": None, "a_nonfinite": "nan", "b": [1.0, None], "b_nonfinite": [None, "-inf"],
                    "c": {"d": None, "d_nonfinite": "inf"}, "e": 2.5}
