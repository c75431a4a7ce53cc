"""A corpus of damaged run directories: each ``DAMAGES[name](run_dir)`` damages a copy of a good
run in place the way a disk, a crash, a hand edit or a hostile sender could.

A uniquely named module (not ``conftest``): other test folders have their own ``conftest.py``.
The good run is a finished one (Parquet tables). Edits of its records re-record the file's digest
in the manifest (``table_files.rewrite_table``), so that they reach the reader's checks of the
records; byte-level damage does not. Damage to Arrow IPC streams applies to the good run turned
into the stream format of schema version 4 (``legacy``): byte-level damage there patches one
record batch where pyarrow's reader puts it: the file is read into one buffer, so every batch
buffer's file offset is its address minus the file buffer's address.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from drifttool.digestcore import digest_bytes
from drifttool.errors import DriftToolError
from tests.artifact.table_files import rewrite_table, to_streams


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _first_batch(path: Path) -> tuple[pa.Buffer, pa.RecordBatch]:
    """The whole file as one buffer and the stream's first batch, whose buffers are slices of it."""
    buf = pa.py_buffer(path.read_bytes())
    return buf, pa.ipc.open_stream(pa.BufferReader(buf)).read_next_batch()


def corrupt_string_offsets(path: Path, column: str = "op") -> None:
    """Set the end offset of row 0 of utf8 ``column`` in the first batch to 2**31 − 1 (far past
    the data buffer)."""
    buf, batch = _first_batch(path)
    offsets = batch.column(column).buffers()[1]
    _patch(path, offsets.address - buf.address + 4, struct.pack("<i", 2**31 - 1))


def corrupt_batch_length(path: Path) -> None:
    """Multiply the declared length of the first batch and of its columns (the ``length`` of the
    RecordBatch message and of every FieldNode) by 1000, leaving the buffers as they are."""
    data = path.read_bytes()
    reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(pa.py_buffer(data)))
    reader.read_next_message()  # schema
    msg = reader.read_next_message()
    n = pa.ipc.read_record_batch(msg, pa.ipc.open_stream(data).schema).num_rows
    meta = msg.metadata.to_pybytes()
    start = data.index(meta)
    old, new = struct.pack("<q", n), struct.pack("<q", n * 1000)
    assert meta.count(old) >= 2, "declared lengths not found"
    _patch(path, start, meta.replace(old, new))


def _to_file_format(path: Path) -> None:
    """Rewrite an IPC stream as an IPC *file* (footer format) with the same table."""
    table = pa.ipc.open_stream(path.read_bytes()).read_all()
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)


def _set_value(column: str, row: int, value) -> Callable[[pa.Table], pa.Table]:
    def edit(t: pa.Table) -> pa.Table:
        vals = t.column(column).to_pylist()
        vals[row] = value
        field = t.schema.field(column)
        return t.set_column(t.schema.get_field_index(column), field,
                            pa.array(vals, type=field.type))
    return edit


def restep(row: int, **fields) -> Callable[[Path], None]:
    """Change ``fields`` (dtype, shape) of step record ``row`` and re-digest it, so that the
    damage passes the digest check and must be caught by what the fields declare."""
    def edit(t: pa.Table) -> pa.Table:
        rows = t.to_pylist()
        r = rows[row]
        r.update(fields)
        try:  # digest v2 of the bytes under the new fields, where they can hold them
            r["digest"] = digest_bytes(r["data"], r["dtype"], r["shape"])
        except (ValueError, DriftToolError):
            pass  # bytes that cannot hold the declared dtype and shape: a later check says so
        return pa.Table.from_pylist(rows, schema=t.schema)
    return lambda d: rewrite_table(d / "steps.rank0.parquet", edit)


def null_in(file: str, column: str, row: int = 0) -> Callable[[Path], None]:
    return lambda d: rewrite_table(d / file, _set_value(column, row, None))


def value_in(file: str, column: str, value, row: int = 0) -> Callable[[Path], None]:
    return lambda d: rewrite_table(d / file, _set_value(column, row, value))


def retype(file: str, column: str, type_: pa.DataType) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        def edit(t: pa.Table) -> pa.Table:
            i = t.schema.get_field_index(column)
            return t.set_column(i, pa.field(column, type_), t.column(column).cast(type_))
        rewrite_table(d / file, edit)
    return damage


def drop_column(file: str, column: str) -> Callable[[Path], None]:
    return lambda d: rewrite_table(d / file, lambda t: t.drop_columns([column]))


def rename_column(file: str, column: str, new: str) -> Callable[[Path], None]:
    return lambda d: rewrite_table(
        d / file, lambda t: t.rename_columns([new if c == column else c for c in t.column_names]))


def duplicate_rows(file: str) -> Callable[[Path], None]:
    return lambda d: rewrite_table(d / file, lambda t: pa.concat_tables([t, t.slice(0, 1)]))


def plant_in_input(key: str, value: float) -> Callable[[Path], None]:
    """Write ``value`` into element 0 of float32 replay input ``key`` of inputs.safetensors, in
    place (header and metadata untouched: 8-byte header length, JSON header, data)."""
    def damage(d: Path) -> None:
        f = d / "inputs.safetensors"
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        assert header[key]["dtype"] == "F32"
        _patch(f, 8 + n + header[key]["data_offsets"][0], np.float32(value).tobytes())
    return damage


def edit_manifest(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        edit(m)
        (d / "manifest.json").write_text(json.dumps(m))
    return damage


def rename_key(path: str, new: str) -> Callable[[Path], None]:
    """Rename the manifest key at dotted ``path`` to ``new`` (a typo in a hand edit)."""
    *parents, key = path.split(".")

    def edit(m: dict) -> None:
        for p in parents:
            m = m[p]
        m[new] = m.pop(key)
    return edit_manifest(edit)


def set_key(path: str, value) -> Callable[[Path], None]:
    """Set the manifest value at dotted ``path``."""
    *parents, key = path.split(".")

    def edit(m: dict) -> None:
        for p in parents:
            m = m[p]
        m[key] = value
    return edit_manifest(edit)


def manifest_text(make: Callable[[str], str]) -> Callable[[Path], None]:
    """Replace manifest.json by ``make(original_text)``."""
    def damage(d: Path) -> None:
        (d / "manifest.json").write_text(make((d / "manifest.json").read_text()))
    return damage


def truncate(file: str, keep: float = 0.5) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        data = (d / file).read_bytes()
        (d / file).write_bytes(data[: int(len(data) * keep)])
    return damage


def swap(a: str, b: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        tmp = d / "swap.tmp"
        os.rename(d / a, tmp)
        os.rename(d / b, d / a)
        os.rename(tmp, d / b)
    return damage


def rename(a: str, b: str) -> Callable[[Path], None]:
    return lambda d: os.rename(d / a, d / b)


def copy(a: str, b: str) -> Callable[[Path], None]:
    return lambda d: shutil.copyfile(d / a, d / b)


def remove(a: str) -> Callable[[Path], None]:
    return lambda d: os.remove(d / a)


def symlink_to_copy(a: str) -> Callable[[Path], None]:
    """Replace ``a`` by a symlink to identical bytes outside the run directory."""
    def damage(d: Path) -> None:
        outside = d.parent / f"{d.name}-{a}"
        shutil.copyfile(d / a, outside)
        os.remove(d / a)
        os.symlink(outside, d / a)
    return damage


def fifo_for(a: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        os.remove(d / a)
        os.mkfifo(d / a)
    return damage


def directory_for(a: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        os.remove(d / a)
        (d / a).mkdir()
    return damage


def legacy(damage: Callable[[Path], None]) -> Callable[[Path], None]:
    """``damage`` applied to the run turned into schema version 4's streams (``*.arrow``)."""
    def both(d: Path) -> None:
        to_streams(d, 4)
        damage(d)
    return both


def append_copy(file: str) -> Callable[[Path], None]:
    """Concatenate a copy of the file after its own end (a stream after its end-of-stream
    marker, a Parquet file after its footer)."""
    def damage(d: Path) -> None:
        data = (d / file).read_bytes()
        (d / file).write_bytes(data + data)
    return damage


DEEP = 100_000
DAMAGES: dict[str, Callable[[Path], None]] = {
    # Arrow record batches
    "ops string offsets": legacy(lambda d: corrupt_string_offsets(d / "ops.rank0.arrow")),
    "steps string offsets": legacy(lambda d: corrupt_string_offsets(d / "steps.rank0.arrow",
                                                                    "quantity")),
    "ops batch length": legacy(lambda d: corrupt_batch_length(d / "ops.rank0.arrow")),
    "steps batch length": legacy(lambda d: corrupt_batch_length(d / "steps.rank0.arrow")),
    "ops bytes flipped": lambda d: _patch(d / "ops.rank0.parquet", 4000, b"\xff\x00\xff"),
    "ops footer bytes flipped": lambda d: _patch(
        d / "ops.rank0.parquet", (d / "ops.rank0.parquet").stat().st_size - 200, b"\x13\x37"),
    "legacy null in ops op": legacy(null_in("ops.rank0.arrow", "op")),
    "legacy truncated ops": legacy(truncate("ops.rank0.arrow")),
    "legacy steps of version 5": legacy(edit_manifest(lambda m: m.update(schema_version=5))),
    "stream listed in a complete run": lambda d: (
        os.rename(d / "ops.rank0.parquet", d / "ops.rank0.arrows"),
        edit_manifest(lambda m: m["files"].update(ops=["ops.rank0.arrows"]))(d)),
    "digest of another file": edit_manifest(lambda m: m["files"]["digests"].update(
        {"ops.rank0.parquet": m["files"]["digests"]["steps.rank0.parquet"]})),
    "digest dropped": edit_manifest(lambda m: m["files"]["digests"].pop("ops.rank0.parquet")),
    "digest of an unlisted file": edit_manifest(lambda m: m["files"]["digests"].update(
        {"ops.rank1.parquet": "0" * 32})),
    "null in ops op": null_in("ops.rank0.parquet", "op"),
    "null in ops sample": null_in("ops.rank0.parquet", "sample", 5),
    "negative op_pos": value_in("ops.rank0.parquet", "op_pos", -1, 3),
    "unknown component in ops": value_in("ops.rank0.parquet", "component", "unet", 2),
    "unknown component in steps": value_in("steps.rank0.parquet", "component", "unet", 1),
    "null component in steps": null_in("steps.rank0.parquet", "component", 1),
    "null in steps quantity": null_in("steps.rank0.parquet", "quantity"),
    "null in steps digest": null_in("steps.rank0.parquet", "digest", 2),
    "NaN sigma in steps": value_in("steps.rank0.parquet", "sigma", float("nan")),
    "inf sigma in steps": value_in("steps.rank0.parquet", "sigma", float("inf")),
    "-inf sigma_next in steps": value_in("steps.rank0.parquet", "sigma_next", float("-inf"), 3),
    "NaN sigma in ops": value_in("ops.rank0.parquet", "sigma", float("nan"), 5),
    "finite sigma changed in steps": value_in("steps.rank0.parquet", "sigma", 0.5, 3),
    "finite sigma_next changed in steps": value_in("steps.rank0.parquet", "sigma_next", 0.5, 3),
    "finite sigma changed in ops": value_in("ops.rank0.parquet", "sigma", 0.5, 9),
    "sigma of a whole step changed in steps": lambda d: rewrite_table(
        d / "steps.rank0.parquet", lambda t: t.set_column(
            t.schema.get_field_index("sigma"), t.schema.field("sigma"),
            pc.if_else(pc.equal(t["step"], 1), 0.5, t["sigma"]))),
    "inf sigma in ops step -1": value_in("ops.rank0.parquet", "sigma", float("inf"), 0),
    "retyped ops sample": retype("ops.rank0.parquet", "sample", pa.int64()),
    "retyped steps sigma": retype("steps.rank0.parquet", "sigma", pa.float32()),
    "unknown dtype in a step record": restep(3, dtype="float99"),
    "shape of a step record not its bytes": restep(3, shape=[7, 1000]),
    "negative shape in a step record": restep(3, shape=[-1, -1536]),
    "unknown dtype in an op record": value_in("ops.rank0.parquet", "dtype", "float99", 4),
    "op record shape under its digest": value_in("ops.rank0.parquet", "shape", [1, 2, 3], 7),
    "op record maxabs under its digest": value_in("ops.rank0.parquet", "maxabs", 123.0, 7),
    "op record nonfinite under its digest": value_in("ops.rank0.parquet", "nonfinite", 3, 7),
    "op record row digests under their digest": lambda d: rewrite_table(
        d / "ops.rank0.parquet", lambda t: _set_value("row_digests", 9, [
            v ^ 1 for v in t.column("row_digests")[9].as_py()])(t)),
    "step record maxabs under its digest": value_in("steps.rank0.parquet", "maxabs", 0.5, 2),
    "op record disagreeing rank outside the layout": value_in("ops.rank0.parquet", "rank_disagree",
                                                              [3], 5),
    "op record rank digests not one per rank": value_in("ops.rank0.parquet", "rank_digests",
                                                        [1, 2, 3], 5),
    "dropped ops column": drop_column("ops.rank0.parquet", "call"),
    "extra ops column": lambda d: rewrite_table(
        d / "ops.rank0.parquet", lambda t: t.append_column("note", pa.array(["x"] * t.num_rows))),
    "dictionary-encoded steps column": lambda d: rewrite_table(
        d / "steps.rank0.parquet", lambda t: t.set_column(t.schema.get_field_index("phase"), "phase",
                                                  t.column("phase").dictionary_encode())),
    "renamed steps column": rename_column("steps.rank0.parquet", "sample", "samples"),
    "second stream after the end": legacy(append_copy("ops.rank0.arrow")),
    "second copy after the Parquet footer": append_copy("ops.rank0.parquet"),
    "truncated ops": truncate("ops.rank0.parquet"),
    "truncated steps": truncate("steps.rank0.parquet", 0.9),
    "truncated trace": truncate("trace.rank0.parquet", 0.7),
    "truncated inputs": truncate("inputs.safetensors", 0.8),
    "empty steps": truncate("steps.rank0.parquet", 0.0),
    # replay inputs
    "NaN in x0": plant_in_input("x0", float("nan")),
    "inf in noise": plant_in_input("noise", float("inf")),
    "changed x0": plant_in_input("x0", 0.25),
    # files
    "extra ops.rank7": copy("ops.rank0.parquet", "ops.rank7.parquet"),
    "extra ops.rank7 listed": lambda d: (copy("ops.rank0.parquet", "ops.rank7.parquet")(d),
                                         edit_manifest(lambda m: m["files"]["ops"].append(
                                             "ops.rank7.parquet"))(d)),
    "renamed ops to rank1 (listed)": lambda d: (rename("ops.rank0.parquet", "ops.rank1.parquet")(d),
                                                edit_manifest(lambda m: m["files"].update(
                                                    ops=["ops.rank1.parquet"]))(d)),
    "extra notes file": lambda d: (d / "notes.txt").write_text("hello"),
    "extra dot file": lambda d: (d / ".hidden").write_text("x"),
    "missing steps": remove("steps.rank0.parquet"),
    "missing trace": remove("trace.rank0.parquet"),
    "missing inputs": remove("inputs.safetensors"),
    "inputs removed with their manifest entry": lambda d: (
        remove("inputs.safetensors")(d), edit_manifest(lambda m: m["files"].update(inputs=None))(d)),
    "inputs unlisted in the manifest": edit_manifest(lambda m: m["files"].update(inputs=None)),
    "empty run directory": lambda d: [os.remove(p) for p in list(d.iterdir())],
    "steps in Arrow file format": legacy(lambda d: _to_file_format(d / "steps.rank0.arrow")),
    "missing ops": remove("ops.rank0.parquet"),
    "renamed steps": rename("steps.rank0.parquet", "steps.rank0.parquet.bak"),
    "swapped steps and trace": swap("steps.rank0.parquet", "trace.rank0.parquet"),
    "swapped steps and ops": swap("steps.rank0.parquet", "ops.rank0.parquet"),
    "duplicated steps rows": duplicate_rows("steps.rank0.parquet"),
    "symlinked steps": symlink_to_copy("steps.rank0.parquet"),
    "symlinked manifest": symlink_to_copy("manifest.json"),
    "symlinked inputs": symlink_to_copy("inputs.safetensors"),
    "FIFO for ops": fifo_for("ops.rank0.parquet"),
    "FIFO for manifest": fifo_for("manifest.json"),
    "directory for trace": directory_for("trace.rank0.parquet"),
    "subdirectory": lambda d: (d / "sub").mkdir(),
    # manifest
    "deeply nested manifest": manifest_text(lambda t: t[:-1] + ', "x": ' + "[" * DEEP + "]" * DEEP + "}"),
    "moderately nested manifest": manifest_text(lambda t: t.replace(
        '"fingerprint": {', '"fingerprint": {"deep": ' + '{"a": ' * 900 + "1" + "}" * 900 + ", ", 1)),
    "5000-digit integer": manifest_text(lambda t: t[:-1] + ', "x": ' + "7" * 5000 + "}"),
    "NaN in manifest": manifest_text(lambda t: t[:-1] + ', "x": NaN}'),
    "1e999 in manifest": manifest_text(lambda t: t[:-1] + ', "x": -1e999}'),
    "duplicate manifest key": manifest_text(lambda t: t[:-1] + ', "complete": true}'),
    "not UTF-8 manifest": lambda d: (d / "manifest.json").write_bytes(
        b"\xff\xfe" + (d / "manifest.json").read_bytes()),
    "schema_version 2 (older)": edit_manifest(lambda m: m.update(schema_version=2)),
    "schema_version string": edit_manifest(lambda m: m.update(schema_version="1")),
    "schema_version float": edit_manifest(lambda m: m.update(schema_version=1.0)),
    "schema_version bool": edit_manifest(lambda m: m.update(schema_version=True)),
    "schema_version list": edit_manifest(lambda m: m.update(schema_version=[1])),
    "schema_version object": edit_manifest(lambda m: m.update(schema_version={"v": 1})),
    "complete as string": edit_manifest(lambda m: m.update(complete="true")),
    "kind as list": edit_manifest(lambda m: m.update(kind=["rollout"])),
    "capture_level as list": edit_manifest(lambda m: m.update(capture_level=["L2"])),
    "capture_level unknown": edit_manifest(lambda m: m.update(capture_level="L9")),
    "files.steps points at trace": edit_manifest(lambda m: m["files"].update(steps=["trace.rank0.parquet"])),
    "files.ops duplicated": edit_manifest(lambda m: m["files"].update(
        ops=["ops.rank0.parquet", "ops.rank0.parquet"])),
    "files.ops absolute": edit_manifest(lambda m: m["files"].update(
        ops=[str(Path("/etc/passwd"))])),
    "files unknown key": edit_manifest(lambda m: m["files"].update(extra="notes.txt")),
    "input_digests dropped one": edit_manifest(lambda m: m["replay"]["input_digests"].pop("x0")),
    "input_digests as list": edit_manifest(lambda m: m["replay"].update(input_digests=["x"])),
    # manifest values and keys the schema does not account for (MANIFEST_SCHEMA)
    "settings.cfg_layout invalid": set_key("settings.cfg_layout", "b`tched"),
    "settings.mode invalid": set_key("settings.mode", "fast"),
    "settings.dtype invalid": set_key("settings.dtype", "float16"),
    "settings.capture invalid": set_key("settings.capture", "L3"),
    "settings.steps as string": set_key("settings.steps", "2"),
    "settings.steps as bool": set_key("settings.steps", True),
    "settings.mode missing": edit_manifest(lambda m: m["settings"].pop("mode")),
    "fingerprint.cfg.cfg_layout invalid": set_key("fingerprint.cfg.cfg_layout", "b`tched"),
    "fingerprint.runtime.mode invalid": set_key("fingerprint.runtime.mode", "fast"),
    "environment.cpu_capability renamed": rename_key("environment.cpu_capability",
                                                     "cpt_capability"),
    "replay.noise.generator_device renamed": rename_key("replay.noise.generator_device",
                                                        "generator^device"),
    "replay.prompt_lengths renamed": rename_key("replay.prompt_lengths", "promqt_lengths"),
    "layout.cfg_layout renamed": rename_key("layout.cfg_layout", "cfg_layuot"),
    "layout unknown key": set_key("layout.prompt_lengths", [7, 13]),
    # the layout and the per-rank files (issue #9 item 4)
    "layout.world_size 2 without rank 1's files": set_key("layout.world_size", 2),
    "layout.world_size 0": set_key("layout.world_size", 0),
    "layout.world_size missing": edit_manifest(lambda m: m["layout"].pop("world_size")),
    "layout.samples of another rank": set_key("layout.samples", {"1": [0, 1]}),
    "layout.samples without the run's samples": set_key("layout.samples", {"0": [5]}),
    "layout.mesh of another size": set_key("layout.mesh", {"dims": ["sample"], "shape": [2]}),
    "files.steps a bare name": set_key("files.steps", "steps.rank0.parquet"),
    "files.trace of rank 1": edit_manifest(lambda m: m["files"].update(
        trace=["trace.rank1.parquet"])),
    "steps of rank 1 copied in": copy("steps.rank0.parquet", "steps.rank1.parquet"),
    "unknown top-level key": set_key("notes", "hand edit"),
    "files.ops not a list": set_key("files.ops", "ops.rank0.parquet"),
    "kind unknown": set_key("kind", "training"),
    "kind recompute on a rollout": set_key("kind", "recompute"),
    "policy record on a rollout": set_key("policy", {"timestep_policy": "sigma_fp32",
                                                     "cfg_layout": "batched", "cfg_scale": 4.0,
                                                     "eta": 1.2}),
    "fingerprint deleted": edit_manifest(lambda m: m.pop("fingerprint")),
    "fingerprint null": set_key("fingerprint", None),
    # manifest and files disagree
    "capture_level lowered to L0": set_key("capture_level", "L0"),
    "capture_level lowered to L1": set_key("capture_level", "L1"),
    # settings.samples (the good run's records hold samples 0 and 1)
    "settings.samples empty": set_key("settings.samples", []),
    "settings.samples duplicated": set_key("settings.samples", [0, 0]),
    "settings.samples negative": set_key("settings.samples", [-1, 0, 1]),
    "settings.samples without a recorded sample": set_key("settings.samples", [0]),
    "settings.samples another sample": set_key("settings.samples", [0, 2]),
    "manifest is an array": manifest_text(lambda t: "[" + t + "]"),
    "empty manifest": manifest_text(lambda t: ""),
}
