"""The ``twell`` torch.compile backend: rewrite ReLU FFNs, then hand the graph to Inductor.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="twell")`` works without importing this package.
"""

from __future__ import annotations

import functools
import hashlib
import operator
from pathlib import Path
from typing import Any, Optional

import torch
from torch import fx

from twell_compile import __version__, control, stats
from twell_compile.config import TwellConfig, inductor_patches
from twell_compile.ops import arg_index
from twell_compile.passes import graph_modules, run_passes
from twell_compile.runtime import decode_state, execute, names, select


def with_cudagraphs(config: TwellConfig, patches: dict[str, Any]) -> TwellConfig:
    """The config with ``cudagraphs`` resolved ("on"/"off") from the Inductor patches of this
    compile (its mode) and Inductor's global ``triton.cudagraphs``, unless the user set it."""
    if config.cudagraphs:
        return config
    from torch._inductor import config as inductor_config

    on = patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs)
    return config.replace(cudagraphs="on" if on else "off")


@functools.lru_cache(maxsize=None)
def source_fingerprint() -> str:
    """Hash of the package's Python sources (ops, fakes, kernels, autograd formulas).

    Inductor's and AOTAutograd's on-disk caches key on the graph, not on our op code: after an
    edit to a fake or a backward (same version number), a cached compile would otherwise run
    with stale output shapes or a stale backward.
    """
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _example_device(node: Any) -> Optional[torch.device]:
    """Device of a node's value, following the first tensor argument up to recorded metadata."""
    while isinstance(node, fx.Node):
        ev = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(ev, torch.Tensor):
            return ev.device
        node = node.args[0] if node.args else None
    return None


def reserve_stats(gm: fx.GraphModule) -> None:
    """Allocate every rewritten layer's statistics buffer now, outside any CUDA-graph pool."""
    ops = (torch.ops.twell.ffn.default, torch.ops.twell.ffn_train.default)
    for _, sub in graph_modules(gm):
        for node in sub.graph.nodes:
            if node.op != "call_function" or node.target not in ops:
                continue
            if not node.args[arg_index(node.target, "stats")]:
                continue
            device = _example_device(node.args[0])
            if device is not None:
                stats.reserve(node.args[arg_index(node.target, "layer")], device)


def _configure(config: TwellConfig, layer: str) -> None:
    target = config.target_for(layer)
    if target is not None:
        control.configure(layer, target, config.target_steps, config.target_l1_init)


def declare_targets(gm: fx.GraphModule, config: TwellConfig) -> None:
    """Give the controller (control.py) the target of every training op the scale_l1 pass set
    to ``l1_control``: its coefficient is adapted from the op's first call."""
    op = torch.ops.twell.ffn_train.default
    for _, sub in graph_modules(gm):
        for node in sub.graph.nodes:
            if node.op != "call_function" or node.target is not op:
                continue
            pos = arg_index(op, "l1_control")
            on = node.args[pos] if len(node.args) > pos else node.kwargs.get("l1_control", False)
            layer = str(node.args[arg_index(op, "layer")])
            target = config.target_for(layer)
            if on and target is not None:
                control.configure(layer, target, config.target_steps, config.target_l1_init)
            if on and node.kwargs.get("owner") is not None:
                # another module running this graph resolves its own layer name at run time
                names.on_new_layer(node.args[arg_index(op, "instance")], functools.partial(_configure, config))


_VIEWS = {torch.t, "t", operator.getitem}


def _real_tensor(node: Any, gm: fx.GraphModule, inputs: dict[fx.Node, Any]) -> Optional[torch.Tensor]:
    """The real tensor behind a top-level graph node: a placeholder (example input), a
    get_attr, or t/slicing of one; None for anything computed."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "placeholder":
        t = inputs.get(node)
    elif node.op == "get_attr":
        t = gm
        for part in str(node.target).split("."):
            t = getattr(t, part, None)
    elif node.op in ("call_function", "call_method") and node.target in _VIEWS and node.args:
        base = _real_tensor(node.args[0], gm, inputs)
        if base is None or any(isinstance(a, fx.Node) for a in node.args[1:]):
            return None
        fn = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
        t = fn(base, *node.args[1:])
    else:
        return None
    if not isinstance(t, torch.Tensor) or isinstance(t, torch._subclasses.FakeTensor):
        return None
    return t


def reserve_decode_state(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Make the decode state (runtime/decode_state.py: a persistent fp32 accumulator, 0.5 MB at
    K_out=2048; no weight values) of every rewritten CUDA bf16/fp16 inference FFN whose decode
    path can win (select.decode_state_wanted) now, outside any CUDA-graph pool. Weights inside
    subgraphs or computed in the graph are not found here; their decode calls zero-fill a state
    per call."""
    op = torch.ops.twell.ffn.default
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = dict(zip(placeholders, example_inputs))
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not op:
            continue
        wd = _real_tensor(node.args[arg_index(op, "w_down")], gm, inputs)
        if wd is None or wd.dim() != 2:
            continue
        gate = node.args[arg_index(op, "w_gate")]
        wg = _real_tensor(gate, gm, inputs)
        if wg is None and isinstance(gate, fx.Node):
            wg = gate.meta.get("example_value", gate.meta.get("val"))
        if not isinstance(wg, torch.Tensor) or wg.dim() != 2:
            continue
        (n, k), k_out = wg.shape, wd.shape[0]
        gated = node.args[arg_index(op, "w_up")] is not None
        if not select.decode_state_wanted(wd.device, wd.dtype, int(k), int(n), int(k_out), gated):
            continue
        base = wd if wd._base is None else wd._base
        decode_state.register(wd.detach(), base=base)


def twell_backend(gm: fx.GraphModule, example_inputs: list[Any], *, mode: Optional[str] = None,
                  options: Optional[dict[str, Any]] = None):
    from torch._inductor.compile_fx import compile_fx      # Inductor loads on first compile

    config, rest = TwellConfig.from_options(options)
    if mode and config.mode and mode != config.mode:
        raise ValueError(f"mode={mode!r} and twell.mode={config.mode!r} disagree")
    patches = inductor_patches(mode or config.mode or None, rest)
    config = with_cudagraphs(config, patches)
    gm = run_passes(gm, config)
    declare_targets(gm, config)
    reserve_stats(gm)
    reserve_decode_state(gm, example_inputs)
    # The AOTAutograd cache key does not cover Python autograd formulas: tag it with our
    # version and options so a cached compile never reuses a stale backward.
    tag = f"{torch.compiler.config.cache_key_tag}|twell-{__version__}-{source_fingerprint()}|{config.cache_tag()}"
    with torch.compiler.config.patch(cache_key_tag=tag):
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    return settled(compiled) if config.cudagraphs == "on" else compiled


def settled(compiled):
    """``compiled`` (Inductor's boxed callable), waiting after a call for the layers' first
    density measurements that call made (density.settle: a host sync once per layer, on the
    warm-up call). Inductor's CUDA graphs record the second call and replay it from then on:
    without the wait the recording ran before any measurement landed and kept the dense path
    (reduce-overhead at 2048 tokens, H200: 0.98x of Inductor, the op's own path 1.29x;
    results/h200/ffn_prefill_reduce_overhead.json)."""
    from twell_compile.runtime import density

    def run(*args):
        out = compiled(*args)
        if density.unsettled():
            density.settle()
        return out

    # called as ``compiled`` is, with its own attributes (calling convention, named_parameters,
    # ...), not Dynamo's markers (_torchdynamo_*: Dynamo would call the callable they name)
    run.__dict__.update({k: v for k, v in compiled.__dict__.items() if not k.startswith("_torchdynamo")})
    return run


def _reset() -> None:
    execute.reset()


# torch._dynamo.reset() calls reset() on each backend it has compiled with: the ops' runtime
# state (the CUDA policy's measurements) goes with the compiled code.
twell_backend.reset = _reset
