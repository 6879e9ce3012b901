"""The transformer layer's whole-step CUDA graph in a training loop that keeps its ``loss`` (``loss = ...;
loss.backward()``): each variant runs 12 graphed steps in a subprocess and prints its exit code and any
recording that failed.

Found with it on an H100 (torch 2.11): the backward's recording failed on every variant ("operation failed due
to a previous error during capture", with torch's warning that an AccumulateGrad node's stream does not match):
the opaque node's ``torch.autograd.grad`` handed its parameters' gradients to their own leaf nodes, which the
previous step's autograd graph (kept alive by ``loss``) had made on the default stream. The step then ran its
backward eagerly over the autograd graph the forward's capture had built, which with dropout on died with a
segmentation fault. Since then a recorded opaque node reads its parameters through aliases
(``spscan/layers/opaque.py``); every variant should print ``rc 0`` and no failed recording.

    python bench/gpu/probe_graph_crash.py
"""
import copy, os, subprocess, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    "graph_alone_sync": dict(before="", sync=1),
    "auto_alone_sync": dict(before="", sync=1, auto=1),
    "graph_alone_sync_dropout0": dict(before="", sync=1, p=0.0),
    "graph_alone_nosync": dict(before="", sync=0),
    "scan_then_graph_sync": dict(before="scan", sync=1),
    "autograd_scan_then_graph_sync": dict(before="autograd,scan", sync=1),
}


def child(name):
    import torch, spscan
    import spscan.runtime.graphed as gr
    from never_slower_models import CASES
    v = VARIANTS[name]
    why = gr._why

    def loud(part, e):
        text = why(part, e)
        print(f"{name}: recording failed: {text}", flush=True)
        import traceback
        traceback.print_exception(e, limit=-6)
        sys.stderr.flush()
        return text

    gr._why = loud
    if v.get("mt", 1) == 0:
        torch.autograd.set_multithreading_enabled(False)
    case = next(c for c in CASES if c.name == "transformer_encoder")
    model, head = case.build("cuda")
    if "p" in v:
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = v["p"]
            if hasattr(m, "dropout") and isinstance(getattr(m, "dropout"), float):
                m.dropout = v["p"]
    x, y = case.data("cuda")
    sides = {"autograd": (model, model)}
    for mode in ("scan", "graph"):
        m = copy.deepcopy(model)
        sides[mode] = (spscan.wrap(m, x, backward="auto" if mode == "graph" and v.get("auto") else mode), m)
    order = [s for s in v["before"].split(",") if s] + ["graph"]
    for label in order:
        net, mod = sides[label]
        params = list(mod.parameters())
        for r in range(12 if label == "graph" else 35):
            for p in params:
                p.grad = None
            loss = case.step_loss(net(x), head, y)
            if v["sync"]:
                torch.cuda.synchronize()
            print(f"{name}: {label} step {r} backward", flush=True)
            loss.backward()
            if v["sync"]:
                torch.cuda.synchronize()
    print(f"{name}: ok", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
        sys.exit(0)
    for name in VARIANTS:
        t = time.time()
        p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, name], capture_output=True, text=True,
                           timeout=120)
        lines = (p.stdout + p.stderr).strip().splitlines()
        last = [l for l in lines if l.startswith(name)][-1:] or lines[-1:]
        print(f"{name:34s} rc {p.returncode:4d} {time.time() - t:5.1f}s  last: {last}", flush=True)
        failed = [l for l in lines if "recording failed" in l]
        if failed:
            print("    " + "\n    ".join(failed[:3]), flush=True)
            tb = lines[lines.index(failed[0]) + 1:][:16]
            print("      " + "\n      ".join(tb), flush=True)
