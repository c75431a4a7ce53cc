"""Why the diffusers adapter's CUDA graph capture fails inside drifttool's runner (``run_diffusers``
on a GPU) while ``GraphedForward(DiffusersQwenImage(tr))`` driven by ``rollout`` alone captures.
Run one variant per process, from the repository root, on a CUDA machine with diffusers 0.42.1:

    for v in asis nodigest emptyhost thread_local relaxed warm eagerfirst mmdit; do
        python3 tools/debug_adapter_capture.py $v; done

The adapter is declared graphable here whatever the branch says. asis: the runner as it is
(twice in one process); nodigest: the weight digest (which copies a GPU model's weights back
through pinned host buffers before the first capture) replaced by a constant; emptyhost: the
digest, then the pinned-memory cache emptied (passes where nodigest does: the pinned buffers'
pending events broke the capture); thread_local / relaxed: the capture in that
``capture_error_mode`` (passes under thread_local: another thread broke the global capture);
warm: one eager forward through the capture's logging runtime on the capture stream first
(passes: a kernel compiled or loaded during the capture); eagerfirst: an eager run first in the
same process; mmdit: the runner with drifttool's own model (the control). Each prints the
wrapper's replays, captures and refusal, and the threads alive at each capture."""
import sys, threading, warnings, traceback
import torch
sys.path.insert(0, ".")
import drifttool.runner as runner
import drifttool.model.graphs as graphs
from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage, load_transformer, run_diffusers
from drifttool.settings import RunSpec

DiffusersQwenImage.graphable = True

V = sys.argv[1]
real_graph = torch.cuda.graph
def patched(*a, **k):
    if V in ("thread_local", "relaxed"):
        k["capture_error_mode"] = V
    print("   threads at capture:", sorted(t.name for t in threading.enumerate()), flush=True)
    return real_graph(*a, **k)
torch.cuda.graph = patched
if V == "warm":
    real_capture = graphs.GraphedForward._capture
    def warm_capture(self, x, txt, txt_mask, tau, grid, rt, cond, cond_grids):
        quiet, _ = graphs.logging_runtime(rt, self._level(rt))
        s = self.capture_stream(x.device)
        s.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(s), graphs.device_scalars():
            self.model(x, txt, txt_mask, tau, grid, quiet, cond=cond, cond_grids=cond_grids)
        torch.cuda.synchronize()
        return real_capture(self, x, txt, txt_mask, tau, grid, rt, cond, cond_grids)
    graphs.GraphedForward._capture = warm_capture
if V == "nodigest":
    runner.weight_digest = lambda m: "xxh3_128:" + "0" * 32
if V == "emptyhost":
    real_wd = runner.weight_digest
    def wd_then_empty(m):
        d = real_wd(m)
        torch.cuda.synchronize()
        import gc; gc.collect()
        for f in ("_host_emptyCache", "_accelerator_emptyHostCache", "_cuda_hostEmptyCache"):  # by torch version
            fn = getattr(torch._C, f, None)
            print("   host empty cache:", f, fn is not None, flush=True)
            if fn: fn(); break
        return d
    runner.weight_digest = wd_then_empty
made = []
real_GF = runner.GraphedForward
def counted(model):
    made.append(real_GF(model)); return made[-1]

def go(name, graphed=True, mmdit=False):
    made.clear()
    runner.GraphedForward = counted if graphed else (lambda m: m)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            if mmdit:
                runner.execute(RunSpec(device="cuda", mode="auto", batch=3, capture="L2"), f"/tmp/dbg/{name}", overwrite=True)
            else:
                tr = load_transformer("fixtures/tiny-t2i/transformer", torch.bfloat16).to("cuda")
                run_diffusers(RunSpec(device="cuda", batch=3, capture="L2"), f"/tmp/dbg/{name}", transformer=tr, overwrite=True)
        except Exception:
            traceback.print_exc()
    g = made[0] if made else None
    print(f"{V}/{name}: replays={g and g.replays} captures={g and g.captures} refused={g and g.refused}; "
          f"warnings={[str(x.message)[:400] for x in w if 'graph' in str(x.message)]}", flush=True)

if V == "eagerfirst":
    go("eager", graphed=False)
if V == "mmdit":
    go("mmdit", mmdit=True)
else:
    go("graph")
if V == "asis":
    go("again")
