"""Re-executing a step (``drifttool diff --localize``) and the peer model put every tensor an
operator takes on the model's device, checked on the CPU with the ``meta`` device standing in
for a GPU: the replay inputs and stored latents are read on the CPU, the model is elsewhere.

On the meta device nothing has a value, so a correctly placed step fails at its first read of
one (or an operator without a meta implementation); a call that mixes the CPU inputs with the model's device
fails, as it did on CUDA, with "tensor arguments on more than one device (cpu, meta)"."""

from __future__ import annotations

import pytest
import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.runner import execute
from drifttool.settings import RunSpec
from drifttool.training import step_replay
from drifttool.training.stored import load_rollout


def test_replayed_step_runs_its_inputs_on_the_model_device(tmp_path, monkeypatch):
    execute(RunSpec(capture="L0", steps=2), tmp_path / "a")
    stored = load_rollout(tmp_path / "a", need_latents=False)
    model = step_replay.step_model(stored)
    digest = stored.manifest["fingerprint"]["weights"]
    monkeypatch.setattr(step_replay, "weight_digest", lambda m: digest)  # meta has no bytes
    with pytest.raises((UnsupportedConfigError, RuntimeError)) as e:
        step_replay.replay_step(stored, 0, tmp_path / "loc", model=model.to("meta"))
    # placed right, the step stops at the first value meta cannot give (a host read of the
    # prompt mask, or an operator without a meta implementation)
    assert "more than one device" not in str(e.value), e.value
    assert "meta" in str(e.value), e.value


def test_peer_model_returns_the_velocity_where_its_inputs_are(monkeypatch):
    pytest.importorskip("diffusers")
    from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage
    from drifttool.probes import peer as P
    from drifttool.probes import peer_catalog as PC

    model = P.PeerModel(P.load_peer(None), PC.PeerCall(), torch.device("meta"))
    monkeypatch.setattr(DiffusersQwenImage, "forward",
                        lambda self, x, txt, mask, tau, grid, rt: torch.empty(x.shape, device=x.device))
    x = torch.empty(1, 24, 64, device="meta")  # [B, N, Cp], placed by the runner on the device
    v = model(x, torch.empty(1, 5, 32, device="meta"), None, torch.empty(1, device="meta"),
              (4, 6), None)
    assert v.device == x.device and v.shape == x.shape
