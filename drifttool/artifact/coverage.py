"""What a run's records cover, checked against its manifest: the ranks and samples they belong
to, and in a complete run every rank, sample and step.

    >>> check_named_samples(Path("runs/a"), manifest, steps, ops)  # samples the manifest names
    >>> check_owning_ranks(Path("runs/a"), manifest, steps, ops)   # each rank ran its samples
    >>> check_traced_ranks(Path("runs/a"), manifest, steps, trace_rows)

The records are of the samples ``settings.samples`` names (``check_named_samples``: a manifest
that names other samples than its records hold is corrupt); each rank's records are of the
samples the layout gives it and their ``rank_digests`` and
``rank_disagree`` name ranks of the layout (``check_owning_ranks``); a complete run holds step
records of every sample and step it names, operator records of every step at L1 and finer, and
a trace from every rank that wrote step records (``check_traced_ranks``), so a run that lost
records is refused instead of being compared on the records left. Called by
``drifttool.artifact.reader`` (``Run.check``); the checks of single files and batches are in
``drifttool.artifact.checks``. Torch-free. Source: design.md, "Artifact".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from drifttool.artifact import compute as ac
from drifttool.artifact import schema as S
from drifttool.errors import ArtifactError


def _check_rank_columns(path: Path, world: int, ops: pa.Table) -> None:
    """Each op record's ``rank_digests`` holds one digest per rank of the layout, and its
    ``rank_disagree`` names ranks of the layout, ascending, each once (both may be null).

    Raises:
        ArtifactError: naming the first record that breaks it.
    """
    if "rank_digests" not in ops.column_names or not ops.num_rows:
        return
    lens = ac.call("list_value_length", ops.column("rank_digests")).to_pylist()
    bad = [i for i, n in enumerate(lens) if n is not None and n != world]
    if bad:
        raise ArtifactError(f"{path}: ops.rank* record {bad[0]} holds "
                            f"{lens[bad[0]]} rank digests for {world} ranks")
    for i, ranks in enumerate(ops.column("rank_disagree").to_pylist()):
        if ranks and (ranks != sorted(set(ranks)) or ranks[0] < 0 or ranks[-1] >= world):
            raise ArtifactError(f"{path}: ops.rank* record {i} names ranks {ranks} "
                                f"disagreeing, not ranks of the {world}-rank layout in order")


def _ids(ids: list[int]) -> str:
    """Sample ids for a message: the list, or its first five and how many there are."""
    return str(ids) if len(ids) <= 5 else f"[{', '.join(map(str, ids[:5]))}, … ({len(ids)} ids)]"


def _named(manifest: dict[str, Any]) -> tuple[str, list[int]] | None:
    """The key and the ids of the samples the records name: ``settings.sample_labels`` (the ids
    written for each batch row instead of its samples'), else ``settings.samples``; None where
    the manifest names none (a manifest without settings)."""
    settings = manifest.get("settings") or {}
    for key in ("sample_labels", "samples"):
        if isinstance(settings.get(key), list):
            return f"settings.{key}", settings[key]
    return None


def check_named_samples(path: Path, manifest: dict[str, Any], steps: pa.Table,
                        ops: pa.Table) -> None:
    """The records hold no sample the manifest does not name: every sample id ``>= 0`` (−1:
    unbatched) of the step and op records is one of ``settings.samples`` (of
    ``settings.sample_labels`` where the run relabelled its rows). A complete run with step
    records also holds step records of every sample it names (``check_owning_ranks``), so the
    two sets are equal; an incomplete one may lack some (a rank stopped before writing them),
    and a run with no records (mode off, or stopped before its first step) passes. The named
    ids are distinct, non-negative and at least one (``manifest.samples_problem``, at open).

    Raises:
        ArtifactError: a corrupt manifest, naming it, its ids and the records' other ids.
    """
    named = _named(manifest)
    if named is None:
        return
    key, ids = named
    for name, table in (("steps.rank*", steps), ("ops.rank*", ops)):
        if not table.num_rows:
            continue
        held = set(ac.unique(table["sample"]).to_pylist())  # one column, in Arrow
        other = sorted(i for i in held - set(ids) if i >= 0)
        if other:
            raise ArtifactError(f"{path / S.MANIFEST}: corrupt manifest ({key} {_ids(ids)} "
                                f"disagrees with the records: {name} holds sample(s) "
                                f"{_ids(other)}, which it does not name)")


def check_owning_ranks(path: Path, manifest: dict[str, Any], steps: pa.Table,
                       ops: pa.Table) -> None:
    """Each record's owning rank ran its sample: where ``layout.samples`` gives each rank its
    logical sample ids (``drifttool.distributed.samples``), a record of rank ``r`` with
    ``sample >= 0`` (−1: unbatched) has a sample id of ``samples[str(r)]``.

    A run marked complete also holds step records of every sample it names — each rank's
    ``layout.samples``, or without them the ``settings.samples`` of the batch — so a run that lost
    a rank's records is refused instead of being compared on the samples left.

    Raises:
        ArtifactError: naming the file kind, the rank and the first foreign sample id, or the
            samples of a complete run that have no step records.
    """
    layout = manifest.get("layout", {})
    _check_rank_columns(path, int(layout.get("world_size", 1)), ops)
    _check_no_step_beyond(path, manifest, steps)
    if manifest.get("complete"):
        _check_every_sample_recorded(path, manifest, steps)
        _check_every_step_has_ops(path, manifest, steps, ops)
        _check_every_step_recorded(path, manifest, steps)
    if "samples" not in layout:
        return
    for name, table in (("steps.rank*", steps), ("ops.rank*", ops)):
        if not table.num_rows:
            continue
        pairs = table.select(["rank", "sample"]).group_by(["rank", "sample"]).aggregate([])
        for r in pairs.to_pylist():
            if r["sample"] >= 0 and r["sample"] not in layout["samples"].get(str(r["rank"]), ()):
                raise ArtifactError(f"{path}: {name} holds sample {r['sample']} on rank "
                                    f"{r['rank']}, but layout.samples gives rank {r['rank']} "
                                    f"{layout['samples'].get(str(r['rank']))}")


def _check_every_step_has_ops(path: Path, manifest: dict[str, Any], steps: pa.Table,
                              ops: pa.Table) -> None:
    """At L1 and finer, each rank's operator records cover every (phase, step, sample) its step
    records do (the model ran for each step record), so a rank's op file cut at a batch boundary
    or missing a sample — a valid, closed stream — is refused in a complete run."""
    if manifest.get("capture_level") not in ("L1", "L2") or not steps.num_rows:
        return
    cols = ["rank", "phase", "step", "sample"]
    have = set(zip(*(ops[c].to_pylist() for c in cols)))
    want = set(zip(*(steps[c].to_pylist() for c in cols)))
    lost = sorted(w for w in want - have if w[3] >= 0)
    if lost:
        r, phase, step, sample = lost[0]
        raise ArtifactError(f"{path}: marked complete, but ops.rank{r} has no records of "
                            f"{phase} step {step} sample {sample} (its step records do): the run "
                            "lost records")


def _check_every_step_recorded(path: Path, manifest: dict[str, Any], steps: pa.Table) -> None:
    """A complete rollout holds step records of every step (``settings.steps``) of every sample
    it names, so a run cut at a step boundary — every file a valid, closed stream — is refused."""
    n = (manifest.get("settings") or {}).get("steps")
    if manifest.get("kind", "rollout") != "rollout" or not isinstance(n, int) or not steps.num_rows:
        return
    have = set(zip(steps["sample"].to_pylist(), steps["step"].to_pylist()))
    samples = sorted({s for s, _ in have if s >= 0})
    lost = [(s, k) for s in samples for k in range(n) if (s, k) not in have]
    if lost:
        s, k = lost[0]
        raise ArtifactError(f"{path}: marked complete, but no step records of step {k} "
                            f"(settings.steps {n}) for sample {s}: the run lost records")


def _check_no_step_beyond(path: Path, manifest: dict[str, Any], steps: pa.Table) -> None:
    """A rollout, complete or not, holds no step records past its ``settings.steps``: a manifest
    that says fewer steps than its records is refused rather than diffed on part of them."""
    n = (manifest.get("settings") or {}).get("steps")
    if manifest.get("kind", "rollout") != "rollout" or not isinstance(n, int) or not steps.num_rows:
        return
    last = ac.call("max", steps["step"]).as_py()  # in Arrow: no Python list of every step record
    if last >= n:
        raise ArtifactError(f"{path}: step records of step {last}, past settings.steps {n} (steps "
                            f"0..{n - 1}): the manifest and its records disagree")


def _check_every_sample_recorded(path: Path, manifest: dict[str, Any], steps: pa.Table) -> None:
    layout = manifest.get("layout", {})
    if "samples" in layout:
        want = {(int(r), s) for r, ids in layout["samples"].items() for s in ids}
        have = set(zip(steps["rank"].to_pylist(), steps["sample"].to_pylist()))
        lost = sorted(want - have)
        if lost:
            raise ArtifactError(f"{path}: marked complete, but no step records of sample(s) "
                                f"{[s for _, s in lost]} on rank(s) {sorted({r for r, _ in lost})} "
                                "(layout.samples names them): the run lost records")
        return
    named = _named(manifest)
    if named is not None and steps.num_rows:
        lost = sorted(set(named[1]) - set(ac.unique(steps["sample"]).to_pylist()))
        if lost:
            raise ArtifactError(f"{path}: marked complete, but no step records of sample(s) "
                                f"{_ids(lost)} ({named[0]} names them): the run lost records")


def check_traced_ranks(path: Path, manifest: dict[str, Any], steps: pa.Table,
                       trace_rows: list[dict[str, Any]]) -> None:
    """In a complete run (of a mode that traces), every rank that wrote step records ran the
    model and so has call sites in its trace.

    Raises:
        ArtifactError: naming the first rank whose trace is empty.
    """
    if not manifest.get("complete") or (manifest.get("settings") or {}).get("mode") == "off":
        return
    silent = sorted(set(steps["rank"].to_pylist()) - {r["rank"] for r in trace_rows})
    if silent:
        raise ArtifactError(f"{path}: marked complete, but trace.rank{silent[0]} holds no "
                            "call sites although that rank wrote step records")
