"""Session 12 probe (H200): where the decode pairs form spends its time (K=2048 N=5632 d=0.005,
M=1/8/16, CUDA graph over several layers as bench_decode). Variants of the shipped
decode_pairs_kernel are made from its source at run time (string edits, written to a temp
module; nothing copied into the repo): "store" (the down projection's atomics as plain
stores: wrong sums, timing only), "nodown" (no down projection), "gate" (the gate only: no
pair work). Also the rows form at M=1. Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session12/probe_parts.py OUT.json
"""
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import emit  # noqa: E402  (puts benchmarks/ on sys.path)
import torch  # noqa: E402

from bench_decode import graph_ms, layers_for, weight_sets  # noqa: E402
from twell_compile.kernels import cuda_decode, twell_decode_list  # noqa: E402

SRC = inspect.getsource(twell_decode_list)
DOWN = twell_decode_list._down_pairs.src   # JITFunction: its source text
EDITS = {
    "shipped": [],
    "store": [(DOWN, DOWN.replace("tl.atomic_add(", "tl.store(").replace(', sem="relaxed")', ")"))],
    "nodown": [("                _down_pairs(acc_ptr, wdt_ptr, swd_n, swd_k, wd, mg, ng, h, p_ok, KO, KOC)\n",
                "                pass\n")],
    "gate": [("    elif npair > 0:\n", "    elif npair < 0:\n")],
}
tmp = Path(tempfile.mkdtemp())
variants = {}
for name, edits in EDITS.items():
    src = SRC
    for a, b in edits:
        assert src.count(a) == 1, (name, a[:60])
        src = src.replace(a, b)
    f = tmp / f"pairs_{name}.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location(f"pairs_{name}", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    variants[name] = mod.decode_pairs_kernel

torch.manual_seed(0)
k, n, d = 2048, 5632, 0.005
sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, 256), seed=11)
shipped = twell_decode_list.decode_pairs_kernel
for m in (16, 8, 1):
    a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in sets]
    r = dict(K=k, N=n, M=m, density=d, layers=len(a), us={})
    for rep in range(2):
        for name, kern in variants.items():
            twell_decode_list.decode_pairs_kernel = kern
            cuda_decode._prepared.clear()
            t = graph_ms(lambda: [cuda_decode.decode_forward(*x, form="pairs") for x in a], 40) / len(a) * 1e3
            r["us"].setdefault(f"pairs/{name}", []).append(round(t, 2))
        twell_decode_list.decode_pairs_kernel = shipped
        cuda_decode._prepared.clear()
        if m <= cuda_decode.config_for(m, k).vec_m:
            t = graph_ms(lambda: [cuda_decode.decode_forward(*x, form="rows") for x in a], 40) / len(a) * 1e3
            r["us"].setdefault("rows", []).append(round(t, 2))
    emit(r)
