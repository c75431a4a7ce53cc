"""The summaries of ``run``, ``replay`` and ``recompute`` say whether a GPU run's forwards replayed
CUDA graphs: a ``CUDA graphs`` row with the captures and replays, and one warning line when the
capture was refused (the run went on eagerly). On the CPU no graphs are tried: no row. The GPU
wrapper is stood in for by a ``SignatureGraphs`` whose counters the test sets (the graphs
themselves are ``tests/gpu/test_cuda_graphs.py``'s)."""

from __future__ import annotations

import json

import pytest

import drifttool.runner as runner
from drifttool.cli._summary import graph_rows, graph_warning
from drifttool.model.graphs import SignatureGraphs, graph_use

REASON = "strict forward: an operation synchronised with the host inside the capture"


class _Graphs(SignatureGraphs):
    """A CPU stand-in for ``GraphedForward``: runs the model, counting as a GPU wrapper would
    (the first call eager, then replays), or refusing at its second call."""

    refuse = False

    def __call__(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            if self.refuse:
                self.refused = REASON
            else:
                self.captures += 1
        elif self.calls > 2 and self.refused is None:
            self.replays += 1
        return self.model(*args, **kwargs)


@pytest.fixture(params=[False, True], ids=["captured", "refused"])
def graphs(request, monkeypatch):
    made = []

    def forward(model, device):
        made.append(type("G", (_Graphs,), {"refuse": request.param})(model))
        return made[-1]

    monkeypatch.setattr(runner, "rollout_forward", forward)
    return request.param, made


def test_a_run_says_what_its_graphs_did(cli, tmp_path, graphs):
    refused, made = graphs
    code, out = cli("run", "-o", tmp_path / "r", "--steps", "4", "--capture", "L1")
    assert code == 0, out
    g = made[0]
    flat = " ".join(out.split())
    if refused:
        assert g.refused == REASON and f"CUDA graph capture refused ({REASON})" in flat, out
        assert "refused: ran eagerly" in flat and out.count("warning:") == 1, out
    else:
        calls = g.calls
        assert (g.captures, g.replays) == (1, calls - 2) and calls >= 4, (calls, out)
        assert f"CUDA graphs │ 1 captured, {calls - 2} calls replayed" in out and "refused" not in flat, out


def test_a_replay_says_it_too_and_json_holds_the_counts(cli, tmp_path, graphs):
    refused, made = graphs
    code, out = cli("run", "-o", tmp_path / "r", "--steps", "3", "--capture", "L0")
    assert code == 0, out
    code, out = cli("replay", tmp_path / "r", "-o", tmp_path / "re")
    assert code == 0, out
    assert ("CUDA graph capture refused" in " ".join(out.split())) == refused, out
    code, out = cli("replay", tmp_path / "r", "-o", tmp_path / "re2", "--json")
    assert code == 0, out
    data = json.loads(out[out.index("{"):])
    assert data["cuda_graphs"] == graph_use(made[-1]) and data["cuda_graphs"]["refused"] == (REASON if refused else None)


def test_no_graphs_no_row():
    assert graph_rows({"cuda_graphs": None}) == [] and graph_warning({"cuda_graphs": None}) is None
    assert graph_use(object()) is None


def test_a_wrapper_that_captured_nothing_says_every_call_ran_eagerly():
    """Under a TP/SP layout the wrapper runs every call eagerly (collectives), and a signature met
    once is never captured: the row says so rather than "0 captured, 0 calls replayed"."""
    use = {"captures": 0, "replays": 0, "refused": None}
    assert graph_rows({"cuda_graphs": use}) == [("CUDA graphs", "none captured: every call ran eagerly")]
    assert graph_warning({"cuda_graphs": use}) is None
