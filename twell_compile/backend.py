"""The ``twell`` torch.compile backend: rewrite ReLU FFNs, then hand the graph to Inductor.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="twell")`` works without importing this package.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
from pathlib import Path
from typing import Any, Optional

import torch
from torch import fx

from twell_compile import __version__
from twell_compile.config import PREFIX, TwellConfig, did_you_mean


def with_cudagraphs(config: TwellConfig, patches: dict[str, Any]) -> TwellConfig:
    """The config with ``cudagraphs`` resolved ("on"/"off") from the Inductor patches of this
    compile (its mode) and Inductor's global ``triton.cudagraphs``, unless the user set it."""
    if config.cudagraphs:
        return config
    from torch._inductor import config as inductor_config

    on = patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs)
    return config.replace(cudagraphs="on" if on else "off")


def inductor_patches(mode: Optional[str], options: dict[str, Any]) -> dict[str, Any]:
    """Inductor config patches for torch.compile's ``mode`` plus the user's non-twell options."""
    from torch._inductor import config as inductor_config, list_mode_options

    patches: dict[str, Any] = {}
    if mode and mode != "default":
        try:
            patches.update(list_mode_options(mode))
        except (KeyError, RuntimeError) as e:  # torch versions differ in which they raise
            raise ValueError(f"unknown torch.compile mode {mode!r}: {e}") from None
    known = inductor_config.get_config_copy()
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name not in known:
            ours = [PREFIX + f.name for f in dataclasses.fields(TwellConfig)]
            # A bare twell name ("l1") is ours; else the closest of ours and Inductor's keys.
            hint = (did_you_mean(PREFIX + name, ours) if PREFIX + name in ours
                    else did_you_mean(name, ours + list(known)))
            raise ValueError(f"unknown option {key!r}: neither a twell.* option nor an Inductor config key{hint}")
        patches[name] = value
    return patches


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
    from twell_compile import stats
    from twell_compile.ops import arg_index
    from twell_compile.passes.fuse_ffn import graph_modules

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
    """Make the decode state (kernels/weight_cache.py: a persistent fp32 accumulator, 0.5 MB at
    K_out=2048; no weight values) of every rewritten CUDA bf16/fp16 inference FFN whose decode
    path can win (the decode rule at M=1, density 0: its best case) now, outside any CUDA-graph
    pool. Weights inside subgraphs or computed in the graph are not found here; their decode
    calls zero-fill a state per call."""
    from twell_compile.kernels import cuda_policy, weight_cache
    from twell_compile.ops import arg_index

    op = torch.ops.twell.ffn.default
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = dict(zip(placeholders, example_inputs))
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not op:
            continue
        wd = _real_tensor(node.args[arg_index(op, "w_down")], gm, inputs)
        if wd is None or not weight_cache.wanted(wd):
            continue
        gate = node.args[arg_index(op, "w_gate")]
        wg = _real_tensor(gate, gm, inputs)
        if wg is None and isinstance(gate, fx.Node):
            wg = gate.meta.get("example_value", gate.meta.get("val"))
        if not isinstance(wg, torch.Tensor) or wg.dim() != 2:
            continue
        (n, k), k_out = wg.shape, wd.shape[0]
        gated = node.args[arg_index(op, "w_up")] is not None
        if not cuda_policy.decode_wins(0.0, 1, int(k), int(n), int(k_out), gated):
            continue
        base = wd if wd._base is None else wd._base
        weight_cache.register(wd.detach(), base=base)


def twell_backend(gm: fx.GraphModule, example_inputs: list[Any], *, mode: Optional[str] = None,
                  options: Optional[dict[str, Any]] = None):
    from torch._inductor.compile_fx import compile_fx

    from twell_compile.passes import run_passes

    config, rest = TwellConfig.from_options(options)
    if mode and config.mode and mode != config.mode:
        raise ValueError(f"mode={mode!r} and twell.mode={config.mode!r} disagree")
    patches = inductor_patches(mode or config.mode or None, rest)
    config = with_cudagraphs(config, patches)
    gm = run_passes(gm, config)
    reserve_stats(gm)
    reserve_decode_state(gm, example_inputs)
    # The AOTAutograd cache key does not cover Python autograd formulas: tag it with our
    # version and options so a cached compile never reuses a stale backward.
    tag = f"{torch.compiler.config.cache_key_tag}|twell-{__version__}-{source_fingerprint()}|{config.cache_tag()}"
    with torch.compiler.config.patch(cache_key_tag=tag):
        return compile_fx(gm, example_inputs, config_patches=patches)


def _reset() -> None:
    from twell_compile import dispatch

    dispatch.reset()


# torch._dynamo.reset() calls reset() on each backend it has compiled with: the ops' runtime
# state (the CUDA policy's measurements) goes with the compiled code.
twell_backend.reset = _reset
