"""Checkpoint load time to a device, weight digest included, against diffusers' ``from_pretrained``.

    $ python benchmarks/bench_load.py --folder /dev/shm/qwen                 # a pipeline folder
    $ python benchmarks/bench_load.py --layers 3 --device cpu               # builds one first
    loader                          load s  digest s  total s  GB/s  peak host GiB  peak GPU GiB  × diffusers
    drifttool load_checkpoint       …       …         …        …     …              …             …
    drifttool, digest re-hashed     …
    diffusers from_pretrained       …

Each case runs in a fresh process (what a ``drifttool run`` does; no allocator or pinned-memory
cache carried over), the cases interleaved round by round so that a busy machine slows them
alike; a row is the median over ``--repeat`` rounds (first round = the files' pages warmed, so
every case reads from the page cache). Timed from the call to the device being done (imports
excluded, reported apart):

* ``drifttool load_checkpoint``: ``load_checkpoint(folder, dtype=bf16, device=D)`` then
  ``weight_digest(model)`` — the digest computed while streaming (what ``drifttool run``,
  ``replay`` and ``recompute`` do before their first step);
* ``drifttool, digest re-hashed``: the same load, then the digest hashed from the loaded
  parameters (on a GPU: copied back to the host first): what a model changed after load (a LoRA
  adapter) still pays, and what every run paid before the digest was taken while streaming;
* ``diffusers from_pretrained``: ``QwenImageTransformer2DModel.from_pretrained(folder,
  subfolder="transformer", torch_dtype=bf16, device_map=D)`` (skipped when diffusers is absent);
* ``host side of the GPU path`` (on the CPU only): what ``stream_tensors`` does on the host
  when it loads onto a GPU — every tensor read ahead by ``READERS`` threads through ``STAGES``
  reused ``CHUNK_BYTES`` buffers (``read_ahead``) and hashed on the digest's thread, no device
  copy: the rate at which the host can feed a GPU;
* ``--lora DIR`` adds two cases with an adapter (``unfused-fp32``), the fingerprint's digest
  (``lora_io.fingerprinted``) included: ``load_checkpoint(lora=DIR)``, whose streamed digest
  covers the factors, and a plain load followed by ``load_lora`` (what a run did before), which
  hashes every weight again;
* ``--compare-python PY`` adds the first case run by another interpreter (e.g. one whose
  drifttool is an older checkout: before/after in one run).

The ratio column divides each total by diffusers'; the target is drifttool's ≤ 1.2× on a GPU.
On the CPU diffusers only maps the files (pages are read when a weight is first used), so its
CPU time is not a load's; drifttool's CPU load is bound by faulting in the new memory.
``--device`` defaults to ``cuda`` when available, else ``cpu``. Without ``--folder`` a random
full-width bf16 pipeline folder of ``--layers`` blocks is written to ``--out`` (default under
/dev/shm) by ``make_random_checkpoint.py``'s builder, or reused if already there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LABELS = {"drifttool": "drifttool load_checkpoint", "drifttool-rehash": "drifttool, digest re-hashed",
          "diffusers": "diffusers from_pretrained", "lora": "drifttool + adapter, loaded with it",
          "lora-after": "drifttool + adapter, load_lora after"}

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
case, folder, device, lora = sys.argv[1], sys.argv[2], torch.device(sys.argv[3]), sys.argv[4]
if case == "diffusers":
    from diffusers import QwenImageTransformer2DModel
    from diffusers.utils import logging
    logging.set_verbosity_error()
else:
    from drifttool.model.checkpoint import load_checkpoint
    from drifttool.model.lora_io import fingerprinted, load_lora
    from drifttool.model.weights import weight_digest
imports = time.perf_counter() - t0

def done():
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

def status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))

out = {"imports": imports}
t0 = time.perf_counter()
if case == "diffusers":
    from pathlib import Path
    sub = "transformer" if (Path(folder) / "model_index.json").is_file() else None
    model = QwenImageTransformer2DModel.from_pretrained(folder, subfolder=sub, torch_dtype=torch.bfloat16,
                                                        device_map=str(device))
    out["load"] = done() - t0
    out["digest"] = 0.0
elif case == "host-stages":
    from drifttool.model.checkpoint_files import locate_tensors, transformer_folder, weight_files
    from drifttool.model.checkpoint_stream import CHUNK_BYTES, STAGES, _Files, read_ahead
    from drifttool.model.weights import StreamingDigest, host_bytes
    from contextlib import ExitStack
    buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8) for _ in range(STAGES)]
    hashed = [None] * STAGES
    located = locate_tensors(weight_files(transformer_folder(folder)))
    plan = [(name, where, where.dtype) for name, where in sorted(located.items())]

    def reuse(k):
        if hashed[k] is not None:
            hashed[k].wait()

    with ExitStack() as stack, StreamingDigest() as digest:
        last = -1
        for i, e0, e1, k, host in read_ahead(plan, _Files(stack), buffers, reuse):
            for j in range(last + 1, i + 1):  # tensors of no bytes yield no chunk
                digest.begin(plan[j][0], plan[j][1].dtype, plan[j][1].shape)
            last = i
            hashed[k] = digest.update(host_bytes(host))
        out["weights"] = digest.digest()
    out["load"] = done() - t0
    out["digest"] = 0.0
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"))
                                    for w in located.values()])
elif case in ("lora", "lora-after"):
    if case == "lora":
        model = load_checkpoint(folder, dtype=torch.bfloat16, device=device, lora=lora, lora_mode="unfused-fp32")
    else:
        model = load_checkpoint(folder, dtype=torch.bfloat16, device=device)
        load_lora(model, lora, mode="unfused-fp32")
    out["load"] = done() - t0
    t1 = time.perf_counter()
    out["weights"] = weight_digest(fingerprinted(model))
    out["digest"] = done() - t1
else:
    model = load_checkpoint(folder, dtype=torch.bfloat16, device=device)
    out["load"] = done() - t0
    t1 = time.perf_counter()
    out["weights"] = (weight_digest(model) if case == "drifttool"
                      else weight_digest(dict(model.named_parameters())))
    out["digest"] = done() - t1
out["bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
out["host_peak"] = status_kib("VmHWM") * 1024
out["gpu_peak"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
print(json.dumps(out))
"""


def run_case(python: str, case: str, folder: Path, device: str, lora: Path | None = None) -> dict:
    r = subprocess.run([python, "-c", _CHILD, case, str(folder), device, str(lora or "")], cwd="/",  # its own drifttool
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{case} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def ensure_folder(args) -> Path:
    if args.folder is not None:
        return args.folder
    out = args.out or Path(f"/dev/shm/drifttool-bench-load-{args.layers}")
    if not (out / "transformer" / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_random_checkpoint.py"),
                        "--layers", str(args.layers), "--out", str(out), "--device", args.build_device,
                        "--shard-gb", str(args.shard_gb)], check=True)
    return out


def warm(folder: Path) -> int:
    """Read every file once (page cache), returns the folder's bytes."""
    total = 0
    for f in sorted(folder.rglob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 * 2**20):
                total += len(chunk)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, default=None, help="a transformer or pipeline folder")
    ap.add_argument("--layers", type=int, default=3, help="blocks of the random folder built without --folder")
    ap.add_argument("--out", type=Path, default=None, help="where to build it (default /dev/shm/…)")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--device", default=None, help="cuda when available, else cpu")
    ap.add_argument("--build-device", default=None, help="where the random weights are drawn (default --device)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compare-python", default=None, help="also run drifttool's case under this interpreter")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--lora", type=Path, default=None,
                    help="also load this adapter (unfused-fp32): with the weights, and after them")
    args = ap.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.build_device = args.build_device or device
    folder = ensure_folder(args)
    cases = {LABELS[c]: (sys.executable, c) for c in ("drifttool", "drifttool-rehash")}
    if device == "cpu":
        cases["host side of the GPU path"] = (sys.executable, "host-stages")
    if args.lora is not None:
        cases.update({LABELS[c]: (sys.executable, c) for c in ("lora", "lora-after")})
    if args.compare_python:
        cases[f"drifttool under {args.compare_python}"] = (args.compare_python, "drifttool")
    try:
        import diffusers  # noqa: F401
        cases[LABELS["diffusers"]] = (sys.executable, "diffusers")
    except ImportError:
        pass
    t0 = time.perf_counter()
    size = warm(folder)
    print(f"{folder}: {size / 2**30:.2f} GiB of safetensors, read once in {time.perf_counter() - t0:.1f} s; "
          f"device {device}, {args.repeat} round(s)")
    results: dict[str, list[dict]] = {c: [] for c in cases}
    for _ in range(args.repeat):
        for label, (python, case) in cases.items():
            results[label].append(run_case(python, case, folder, device, args.lora))
    adapted = {LABELS["lora"], LABELS["lora-after"]}
    for group in (set(results) - adapted, adapted & set(results)):
        digests = {r["weights"] for c in group for r in results[c] if "weights" in r}
        assert len(digests) <= 1, f"the digests differ: {digests}"
    plain = {r["weights"] for c in set(results) - adapted for r in results[c] if "weights" in r}
    render(results, device, plain.pop())
    if args.json is not None:
        args.json.write_text(json.dumps({"folder": str(folder), "device": device, "results": results}, indent=2))


def render(results: dict[str, list[dict]], device: str, digest: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def med(c, k):
        return statistics.median(r[k] for r in results[c])

    d = LABELS["diffusers"]
    base = med(d, "load") + med(d, "digest") if d in results else None
    table = Table(title=f"checkpoint load to {device}, weight digest included (median of "
                        f"{len(next(iter(results.values())))}; digest {digest})")
    for col in ("loader", "imports s", "load s", "digest s", "total s", "GB/s", "peak host GiB",
                "peak GPU GiB", "× diffusers"):
        table.add_column(col, justify="left" if col == "loader" else "right")
    for c in results:
        total = med(c, "load") + med(c, "digest")
        nbytes = results[c][0]["bytes"]
        table.add_row(c, f"{med(c, 'imports'):.2f}", f"{med(c, 'load'):.2f}", f"{med(c, 'digest'):.2f}",
                      f"{total:.2f}", f"{nbytes / total / 1e9:.2f}", f"{med(c, 'host_peak') / 2**30:.2f}",
                      f"{med(c, 'gpu_peak') / 2**30:.2f}", f"{total / base:.2f}" if base else "-")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
