"""Synthetic runs for the diff tests: a tiny two-block "MMDiT" and SDE sampler that capture through
the real ``Recorder`` and ``ArtifactWriter`` (the model in ``drifttool.model`` is not used).
``owners`` splits the samples across ranks as sample-parallel rollout does: each rank's
``Recorder`` captures the rows of its samples (one ``ops.rank<r>.arrow`` per rank), with the same
program positions (``op_pos``) on every rank.

A uniquely named module (not ``conftest``): other test folders have their own ``conftest.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import torch

from drifttool.artifact import schema as S
from drifttool.artifact.parquet import file_digest, write_parquet
from drifttool.artifact.writer import ArtifactWriter
from drifttool.capture.recorder import Recorder

GRID = (2, 3)  # image patch grid: 6 image rows
TXT_LENS = [3, 5]  # valid prompt lengths of samples 0 and 1 (padded to 5)
ARCH = {"depth": 2, "dim": 8, "patch": 2}


def _bump(t: torch.Tensor, b: int, row: int, add: float | None) -> torch.Tensor:
    """Copy of ``t`` with element [b, row, 0] moved by one ULP, or by ``add`` (planted drift)."""
    t = t.clone()
    t[b, row, 0] = torch.nextafter(t[b, row, 0], torch.tensor(math.inf)) if add is None else (
        t[b, row, 0] + add)
    return t


def build_run(path: Path, *, steps: int = 3, level: str = "L2", plant: dict | None = None,
              crash_after: int | None = None, fingerprint: dict | None = None,
              noise_seed: int = 1, pad: int = 5, between: dict | None = None,
              x_seed: int | None = None, txt_bump: dict | None = None,
              owners: dict[int, int] | None = None, sigma_table: bool = False,
              sigma_bump_rank: int | None = None) -> Path:
    """Write a synthetic run. ``plant={"step", "block", "op", "sample", "row"[, "add"]}`` moves one
    element of that op's output by one ULP (or by ``add``) and lets it propagate (``row``
    indexes the padded sequence axis); a list of such dicts plants several.
    ``owners={sample: rank}`` owns each sample's records on that rank (default: all on rank 0).
    ``sigma_table`` records the sigma table (an unbatched sampler op at step −1) on every rank,
    as each rank of a sample-parallel rollout computes it; ``sigma_bump_rank`` moves one of
    its elements by one ULP on that rank only (replicas that disagree). ``between={"step", "sample", "row"}`` moves one element
    of the latent by one ULP after that step's records were written and before the next step
    reads it (a change between steps, outside every recorded operator). ``x_seed`` draws the
    initial latent from its own seed (a replay-input difference); ``txt_bump={"sample", "row"[, "add"]}``
    moves one element of the prompt embeddings by one ULP or by ``add`` (a prompt difference,
    x_t unchanged).
    ``crash_after=k`` stops after k steps without closing (complete=false, streams unclosed)."""
    fp = fingerprint or {"arch": dict(ARCH), "weights": "w0", "scheduler": {"num_steps": steps}}
    writer = ArtifactWriter(path, manifest={"fingerprint": fp, "environment": {"machine": "test"}})
    owner = {0: 0, 1: 0, **(owners or {})}
    # rank 0 writes through the writer; other ranks' records are kept and written as their own
    # per-rank files at the end (one process stands in for the ranks of a sample-parallel run)
    recs = {r: Recorder(level, writer if r == 0 else None, rank=r)
            for r in sorted(set(owner.values()) | {0})}
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=g) / 3
    x = torch.randn(2, 6, 8, generator=g)  # [B, h*w, C]
    txt = torch.randn(2, pad, 8, generator=g)  # [B, L_pad, C], rows >= txt_len are padding
    if x_seed is not None:
        x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(x_seed))
    if txt_bump is not None:
        txt = _bump(txt, txt_bump["sample"], txt_bump["row"], txt_bump.get("add"))
    noise = torch.randn(steps, 2, 6, 8, generator=torch.Generator().manual_seed(noise_seed))
    writer.write_inputs({"x_T": x, "txt": txt, "noise": noise})
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()

    plants = plant if isinstance(plant, list) else [plant or {}]
    positions: dict[tuple, int] = {}

    def op(site: dict, name: str, stream: str, out: torch.Tensor) -> torch.Tensor:
        for p in plants:
            if (p.get("step"), p.get("block"), p.get("op")) == (site["step"], site["block"], name):
                out = _bump(out, p["sample"], p["row"], p.get("add"))
        scope = (site["phase"], site["step"], site["branch"], site["block"])
        pos = positions.get(scope, 0)
        positions[scope] = pos + 1
        for r, rec in recs.items():  # each rank captures its samples' rows
            rows = [b for b in range(2) if owner[b] == r]
            part = {**site, "samples": [site["samples"][b] for b in rows],
                    "txt_lens": [site["txt_lens"][b] for b in rows], "rank": r}
            rec.capture({**part, "op": name, "stream": stream, "call": 0, "op_pos": pos},
                        out[rows], "BS.")
        return out

    def flush() -> None:
        for rec in recs.values():
            rec.flush()

    if sigma_table:
        for r, rec in recs.items():
            t = torch.tensor(sigmas, dtype=torch.float32)
            if r == sigma_bump_rank:
                t[1] = torch.nextafter(t[1], torch.tensor(math.inf))
            rec.capture({"phase": "rollout", "step": -1, "sigma": math.nan, "branch": "none",
                         "block": -2, "samples": None, "txt_lens": None, "img_grid": GRID,
                         "rank": r, "op": "flow_sigma_table", "stream": "none", "call": 0,
                         "op_pos": 0}, t, ".")
    for i in range(steps):
        if crash_after is not None and i == crash_after:
            flush()
            return path  # no close: complete stays false, streams have no end marker
        s, s_next = sigmas[i], sigmas[i + 1]
        vs = {}
        for branch in ("cond", "uncond"):
            img, t = x, txt * (1.0 if branch == "cond" else 0.5)
            for block in range(2):
                site = dict(phase="rollout", step=i, sigma=s, branch=branch, block=block,
                            samples=[0, 1], txt_lens=TXT_LENS, img_grid=GRID, rank=0)
                img = op(site, "img_mlp", "img", torch.tanh(img @ w))
                t = op(site, "txt_mlp", "txt", torch.tanh(t @ w))
                joint = op(site, "joint_attn", "joint", torch.cat([t, img], 1) * 0.5)
                img = joint[:, pad:]
            vs[branch] = img
        v = vs["uncond"] + 4.0 * (vs["cond"] - vs["uncond"])
        std_t = torch.tensor(0.7 * math.sqrt(s / (1 - sigmas[1])) if s < 1 else 0.7)
        mu = x + (s_next - s) * v
        scale = std_t * math.sqrt(s - s_next)
        x_next = mu + scale * noise[i]
        logp = (-(x_next - mu) ** 2 / (2 * scale**2)).mean(dim=(1, 2))
        for b in range(2):
            rec = recs[owner[b]]
            rec.record_step(phase="rollout", step=i, sigma=s, sigma_next=s_next, sample=b,
                            branch="cfg", rank=owner[b],
                            quantities={"x_t": x[b], "v_t": v[b], "x_next": x_next[b],
                                        "mu": mu[b], "std_t": std_t, "logp_t": logp[b]})
            for branch in ("cond", "uncond"):
                rec.record_step(phase="rollout", step=i, sigma=s, sigma_next=s_next, sample=b,
                                branch=branch, rank=owner[b], quantities={"v_t": vs[branch][b]})
        flush()
        x = x_next
        if between is not None and between["step"] == i:
            x = _bump(x, between["sample"], between["row"], None)
    def trace_row(r: int) -> dict:
        return {"rank": r, "device": "cpu", "component": "mmdit", "op": "img_mlp", "block": 0,
                "stream": "img", "call": 0, "contract": "c.v1", "requested": "strict",
                "actual": "strict", "kernel": "cpu", "fallback": False, "reason": "",
                "declared": False, "calls": 1}

    writer.write_trace([trace_row(0)])
    flush()
    recs[0].close(complete=True)  # closes rank 0's writer
    ranks = sorted(r for r in recs if r)
    if ranks:
        m = json.loads((path / S.MANIFEST).read_text())
        for r in ranks:
            trace = pa.Table.from_pylist([trace_row(r)], schema=S.TRACE_SCHEMA)
            for table, kept in (("ops", recs[r].ops_table()), ("steps", recs[r].steps_table()),
                                ("trace", trace)):
                name = S.rank_file(table, r)
                write_parquet(path / name, kept.to_batches(), kept.schema)
                m["files"][table].append(name)
                m["files"]["digests"][name] = file_digest(path / name)
        m["layout"]["world_size"] = 1 + len(ranks)
        (path / S.MANIFEST).write_text(json.dumps(m))
    return path
