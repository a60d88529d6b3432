"""Session 13 probes' shared part: kernel variants made from the shipped source at run time
(string edits written to a temp module; nothing copied into the repo), and their timing over
rotated layers as bench_decode times the op (one CUDA graph), each checked against fp64 under
the 2x rule before it is timed."""
import importlib.util
import tempfile
from pathlib import Path

from probe_io import emit  # (puts the repo root and benchmarks/ on sys.path)


def module(name, src, edits, extra=""):
    """A module from ``src`` with each (old, new) edit applied (old must occur once) and
    ``extra`` appended."""
    for a, b in edits:
        assert src.count(a) == 1, (name, a[:60])
        src = src.replace(a, b)
    f = Path(tempfile.mkdtemp()) / f"{name}.py"
    f.write_text(src + extra)
    spec = importlib.util.spec_from_file_location(name, f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_variants(variants, use, points, reps=3):
    """``variants``: name -> what ``use`` installs; ``points``: (M, form) at K=2048 N=5632
    d=0.005. Emits one result per point: per variant ``reps`` interleaved times (us per layer)
    and their median."""
    import torch

    from bench_decode import graph_ms, layers_for, weight_sets
    from twell_compile.kernels import cuda_decode
    from twell_compile.reference import ffn_dense

    torch.manual_seed(0)
    k, n, d = 2048, 5632, 0.005
    sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, 256), seed=11)
    first = next(iter(variants.values()))
    for m, form in points:
        a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in sets]
        ref = ffn_dense(*(None if t is None else t.double() for t in a[0]))
        derr = float((ffn_dense(*a[0]).double() - ref).norm() / ref.norm())
        r = dict(K=k, N=n, M=m, form=form, density=d, layers=len(a), pdl=cuda_decode.pdl_ok(a[0][0].device),
                 dense_us=round(graph_ms(lambda: [ffn_dense(*x) for x in a], 40) / len(a) * 1e3, 2), us={}, err={})
        for rep in range(reps):
            for name, v in variants.items():
                use(v)
                if rep == 0:
                    y = cuda_decode.decode_forward(*a[0], form=form).y.double()
                    err = float((y - ref).norm() / ref.norm())
                    r["err"][name] = f"{err:.2e} (dense {derr:.2e})"
                    assert err <= 2 * derr, (name, err, derr)
                t = graph_ms(lambda: [cuda_decode.decode_forward(*x, form=form) for x in a], 40) / len(a) * 1e3
                r["us"].setdefault(name, []).append(round(t, 2))
        use(first)
        r["median"] = {kk: sorted(v)[len(v) // 2] for kk, v in r["us"].items()}
        emit(r)
