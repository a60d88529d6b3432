"""Session 9 probes' shared part (sessions 10-12 reuse it): the repo root and benchmarks/ on
sys.path; emit(), which prints a JSON line and rewrites the output file (argv[1]) with every
result so far; the compiled decode step of bench_e2e per backend (compiled_decode_steps); and
a decode config timed after an exactness check (config_us), and a launch-config sweep
of a decode form (decode_sweep)."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
out = sys.argv[1]
res = []


def emit(r):
    print(json.dumps(r), flush=True)
    res.append(r)
    Path(out).write_text(json.dumps(res, indent=1))


def calibrated_model(batch, new_tokens=48):
    """bench_e2e's generate() model (16 layers, seq 128, gate biases calibrated to d=0.005 over
    max(batch, 16) sequences per forward): (its bench_e2e args, the model)."""
    import contextlib

    import torch

    import bench_e2e as be

    a = be.parse_args(["--generate", "--batch", str(batch), "--seq", "128", "--new-tokens", str(new_tokens),
                       "--density", "0.005", "--no-energy"])
    model = be.build_model(a, torch.bfloat16, a.seed).eval()
    be.calibrate(model, be.token_batch(a, a.calib_batch, a.seq, a.seed + 1), 0.005, contextlib.nullcontext,
                 max(batch, 16))
    return a, model


def backend_generate(name, a, model, prompt):
    """A copy of ``model`` for backend ``name`` (inductor, twell: its policy reset) and the
    generate() kwargs that compile it as bench_e2e does (reduce-overhead, static cache)."""
    import copy

    import torch
    import transformers

    import bench_e2e as be

    m = copy.deepcopy(model)
    cc = transformers.CompileConfig(**be.compile_kwargs(name, a, "reduce-overhead"))
    if name == "twell":
        be.reset_twell_policy()
    return m, dict(attention_mask=torch.ones_like(prompt), max_new_tokens=a.new_tokens, do_sample=False,
                   cache_implementation="static", compile_config=cc)


def compiled_decode_steps(batches):
    """bench_e2e's generate() model (calibrated_model), per batch size, compiled per backend
    (inductor, twell) as generate() compiles it (reduce-overhead; one generate() call compiles
    and records the graphs). Yields (batch, bench_e2e args, prompt, backend, the backend's model
    copy, its compiled step); the copy is freed once the caller moves on."""
    import torch

    import bench_e2e as be

    for batch in batches:
        a, model = calibrated_model(batch)
        prompt = be.token_batch(a, batch, a.seq, a.seed + 2)
        for name in ("inductor", "twell"):
            m, kw = backend_generate(name, a, model, prompt)
            with torch.no_grad():
                m.generate(prompt, **kw)
            compiled = m.get_compiled_call(kw["compile_config"])
            yield batch, a, prompt, name, m, compiled
            del m, compiled
            torch.cuda.empty_cache()


def config_us(a, cfg, form):
    """One decode config on the layers ``a`` (argument tuples, one per rotated layer): its time
    per layer in us, timed as bench_decode does (one CUDA graph over the layers), after a check
    of the first layer against fp64 under the 2x rule; "ERR ..." if it fails the check, "OOR
    ..." if Triton cannot fit it."""
    import triton

    from bench_decode import graph_ms
    from twell_compile.kernels import cuda_decode
    from twell_compile.reference import ffn_dense

    ref = ffn_dense(*(None if t is None else t.double() for t in a[0]))
    derr = float((ffn_dense(*a[0]).double() - ref).norm() / ref.norm())
    try:
        y = cuda_decode.decode_forward(*a[0], cfg=cfg, form=form).y.double()
        err = float((y - ref).norm() / ref.norm())
        if not err <= 2 * derr:
            return f"ERR {err:.2e} vs {derr:.2e}"
        return round(graph_ms(lambda: [cuda_decode.decode_forward(*x, cfg=cfg, form=form) for x in a], 30)
                     / len(a) * 1e3, 2)
    except triton.runtime.errors.OutOfResources as e:
        return f"OOR {str(e)[:40]}"


def decode_sweep(configs, ms=(16, 8), form="pairs"):
    """A decode form's launch configs at K=2048 N=5632 d=0.005, per M in ``ms``: ``configs``
    maps a name to cuda_decode.Config field overrides of config_for(M, K), each timed by
    config_us. Emits one result per M (with dense's time, PDL, and the 8 fastest configs)."""
    import torch

    from bench_decode import graph_ms, layers_for, weight_sets
    from twell_compile.kernels import cuda_decode
    from twell_compile.reference import ffn_dense

    torch.manual_seed(0)
    k, n, d = 2048, 5632, 0.005
    sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, 256), seed=11)
    for m in ms:
        a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in sets]
        base = cuda_decode.config_for(m, k)
        dense = graph_ms(lambda: [ffn_dense(*x) for x in a], 40) / len(a) * 1e3
        r = dict(K=k, N=n, M=m, density=d, form=form, pdl=cuda_decode.pdl_ok(a[0][0].device),
                 dense_us=round(dense, 2),
                 t={key: config_us(a, base._replace(**fields), form) for key, fields in configs.items()})
        r["best"] = sorted((v, kk) for kk, v in r["t"].items() if isinstance(v, float))[:8]
        emit(r)
        print("BEST", m, "dense", r["dense_us"], r["best"][:5], flush=True)
