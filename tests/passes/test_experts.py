"""Grouped (MoE experts) FFNs through ``torch._grouped_mm`` (``passes/projections.py`` finds the
grouped projections, ``passes/experts.py`` checks the block): rewritten to one
``twell::experts`` op in every layout and activation, near-misses left alone with the reason,
and transformers 5.17's sentinel-row ``masked_fill`` dropped only where the down projection's
output is masked the same way."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.passes.rewrite_harness import PassBackend, check_close


class GroupedExperts(nn.Module):
    """Experts through torch._grouped_mm, as transformers' grouped_mm implementation writes them:
    x sorted by expert, offs each expert's end row, weights [E, 2N, K] and [E, K, N]."""

    def __init__(self, body: str, experts: int = 3, k: int = 16, n: int = 8, transposed: bool = False):
        super().__init__()
        shape_up, shape_down = (experts, 2 * n, k), (experts, k, n)
        if transposed:
            shape_up, shape_down = (experts, k, 2 * n), (experts, n, k)
        self.gate_up_proj = nn.Parameter(torch.randn(shape_up) / k ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(shape_down) / n ** 0.5)
        self.body, self.transposed = body, transposed

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        up = self.gate_up_proj if self.transposed else self.gate_up_proj.transpose(-2, -1)
        down = self.down_proj if self.transposed else self.down_proj.transpose(-2, -1)
        gate, u = torch._grouped_mm(x, up, offs=offs).chunk(2, dim=-1)
        h = {"relu": lambda: F.relu(gate) * u, "relu2": lambda: F.relu(gate) ** 2 * u,
             "drelu": lambda: F.relu(gate) * F.relu(u), "silu": lambda: F.silu(gate) * u,
             "relu_after_down": lambda: gate * u}[self.body]()
        y = torch._grouped_mm(h, down, offs=offs)
        return F.relu(y) if self.body == "relu_after_down" else y


GROUPED_OFFS = torch.tensor([3, 3, 9], dtype=torch.int32)      # expert 1 gets no rows; 3 rows past the end
BF16 = torch.bfloat16           # torch._grouped_mm's meta function (Dynamo's fake run) takes bfloat16 only


def _grouped_ref(mod: GroupedExperts, x: torch.Tensor) -> torch.Tensor:
    """The experts in float64, expert by expert (rows past the end: zeros)."""
    up, down = mod.gate_up_proj.double(), mod.down_proj.double()
    if mod.transposed:
        up, down = up.transpose(-2, -1), down.transpose(-2, -1)
    out, start = [], 0
    for e, end in enumerate(GROUPED_OFFS.tolist()):
        gate, u = F.linear(x[start:end].double(), up[e]).chunk(2, dim=-1)
        h = {"relu": lambda: F.relu(gate) * u, "relu2": lambda: F.relu(gate) ** 2 * u,
             "drelu": lambda: F.relu(gate) * F.relu(u)}[mod.body]()
        out.append(F.linear(h, down[e]))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("body,transposed", [("relu", False), ("relu", True), ("relu2", False), ("drelu", False)])
@pytest.mark.parametrize("grad", [False, True])
def test_grouped_experts_rewritten(body: str, transposed: bool, grad: bool) -> None:
    torch.manual_seed(0)
    mod = GroupedExperts(body, transposed=transposed).to(BF16)
    x = torch.randn(12, 16, dtype=BF16)
    backend = PassBackend()
    with torch.set_grad_enabled(grad):
        got = torch.compile(mod, backend=backend)(x, GROUPED_OFFS)
        want = mod(x, GROUPED_OFFS)
        ref = _grouped_ref(mod, x)
    op = "twell.experts_train.default" if grad else "twell.experts.default"
    calls = [n for n in backend.nodes() if n.op == "call_function"]
    assert [str(n.target) for n in calls].count(op) == 1
    assert not [n for n in calls if n.target in (F.relu, torch._grouped_mm, operator.mul, operator.pow)]
    assert not [n for n in backend.nodes() if n.op == "call_method" and n.target == "chunk"]
    assert [(r.experts, r.act, r.n, r.k) for r in backend.report.rewrites] == [(3, body, 8, 16)]
    # rows past offs[-1]: torch._grouped_mm leaves them unset, the op writes zeros
    check_close("y", got[:9], want[:9], ref)
    assert not got[9:].any()
    if grad:
        dy = torch.randn(9, 16, dtype=torch.float64)
        params = [mod.gate_up_proj, mod.down_proj]
        ref_params = [p.detach().double().requires_grad_() for p in params]
        ref_mod = GroupedExperts(body, transposed=transposed).double()
        ref_mod.gate_up_proj, ref_mod.down_proj = (nn.Parameter(p) for p in ref_params)
        g_ref = torch.autograd.grad(_grouped_ref(ref_mod, x), list(ref_mod.parameters()), dy)
        for a, b, c in zip(torch.autograd.grad(got[:9], params, dy.to(BF16)),
                           torch.autograd.grad(want[:9], params, dy.to(BF16)), g_ref):
            check_close("grad", a, b, c)


@pytest.mark.parametrize("body,reason", [("silu", "gate activation is SiLU, not ReLU"),
                                         ("relu_after_down", "gated product has no activation (bilinear), not ReLU")])
def test_grouped_experts_near_miss(body: str, reason: str) -> None:
    mod = GroupedExperts(body).to(BF16)
    x = torch.randn(12, 16, dtype=BF16)
    backend = PassBackend()
    with torch.no_grad():
        torch.compile(mod, backend=backend)(x, GROUPED_OFFS)
    assert not backend.report.rewrites
    assert [r.reason for r in backend.report.rejections] == [reason]
    assert sum(n.op == "call_function" and n.target is torch._grouped_mm for n in backend.nodes()) == 2


def test_grouped_and_plain_projections_do_not_mix() -> None:
    """A plain down projection after grouped gate/up: no grouped FFN to rewrite."""

    class Mixed(GroupedExperts):
        def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            gate, u = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            return F.linear(F.relu(gate) * u, self.down_proj[0])

    backend = PassBackend()
    with torch.no_grad():
        torch.compile(Mixed("relu").to(BF16), backend=backend)(torch.randn(12, 16, dtype=BF16), GROUPED_OFFS)
    assert not backend.report.rewrites
    assert [r.reason for r in backend.report.rejections] == ["mixes grouped (per-expert) and plain projections"]


class SentinelExperts(nn.Module):
    """transformers 5.17's ``grouped_mm_experts_forward`` (gated experts, [E, 2N, K] and [E, K, N]
    weights), written out: rows sorted by expert, offsets from histc, expert ids >= E (expert
    parallel's sentinels) sorted to the tail and masked with ``masked_fill`` before the up
    projection (in place), after it, and after the down projection; ``.to(weight.dtype)`` on
    each grouped_mm input. ``variant`` changes one thing to make a near-miss."""

    def __init__(self, variant: str = "5.17", experts: int = 3, k: int = 16, n: int = 8):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * n, k) / k ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, k, n) / n ** 0.5)
        self.num_experts, self.variant = experts, variant

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                feature_mask: torch.Tensor) -> torch.Tensor:
        v, e = self.variant, self.num_experts
        num_tokens, num_top_k = top_k_index.shape
        sample_weights, expert_ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        selected = hidden_states[perm // num_top_k]
        sample_weights_g = sample_weights[perm]
        tokens_per_expert = torch.histc(expert_ids_g.float(), bins=e, min=0, max=e - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        sentinel_mask = (expert_ids_g >= e).unsqueeze(-1)
        expert_ids_g.clamp_(max=e - 1)
        selected.masked_fill_(sentinel_mask, 0.0)
        w = self.gate_up_proj
        proj_out = torch._grouped_mm(selected.to(w.dtype), w.transpose(-2, -1), offs=offsets)
        up_mask = feature_mask if v == "feature_mask" else sentinel_mask
        proj_out = proj_out.masked_fill(up_mask, 1.0 if v == "fill_one" else 0.0)
        gate, up = proj_out.chunk(2, dim=-1)
        proj_out = F.relu(gate) * up
        if v == "mask_written":
            sentinel_mask.logical_not_()
        w = self.down_proj
        proj_out = torch._grouped_mm(proj_out.to(w.dtype), w.transpose(-2, -1), offs=offsets)
        if v == "other_mask":
            proj_out = proj_out.masked_fill((expert_ids_g >= e).unsqueeze(-1), 0.0)
        elif v != "no_final":
            proj_out = proj_out.masked_fill(sentinel_mask, 0.0)
        weighted = proj_out * sample_weights_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=hidden_states.device)
        return weighted[inv_perm].view(num_tokens, num_top_k, -1).sum(dim=1)


def _sentinel_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """8 tokens, top-2 of 3 experts, 3 of the 16 routed slots sentinels (id 3), expert 1 unused."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64).to(BF16)
    idx = torch.tensor([[0, 2], [2, 3], [0, 2], [3, 0], [2, 0], [0, 2], [2, 3], [0, 2]])
    weights = torch.rand(8, 2, generator=g, dtype=torch.float64).to(BF16)
    feature_mask = torch.rand(16, 16, generator=g) < 0.2
    return x, idx, weights, feature_mask


def _sentinel_ref(mod: SentinelExperts, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts in float64, token by token; sentinel slots add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, ex in enumerate(idx[t].tolist()):
            if ex >= mod.num_experts:
                continue
            gate, u = F.linear(x[t].double(), mod.gate_up_proj[ex].double()).chunk(2, dim=-1)
            out[t] += weights[t, j].double() * F.linear(F.relu(gate) * u, mod.down_proj[ex].double())
    return out


@pytest.mark.parametrize("grad", [False, True])
def test_sentinel_masked_experts_rewritten(grad: bool) -> None:
    """transformers 5.17's experts: one twell::experts op; the masked_fill before the activation
    goes with the block, the one after the down projection stays on the op's output; output and
    weight gradients within 2x of eager bfloat16's error against float64, with sentinel rows."""
    torch.manual_seed(0)
    mod = SentinelExperts().to(BF16)
    x, idx, weights, fmask = _sentinel_inputs()
    backend = PassBackend()
    with torch.set_grad_enabled(grad):
        got = torch.compile(mod, backend=backend)(x, idx, weights, fmask)
        want = mod(x, idx, weights, fmask)
        ref = _sentinel_ref(mod, x, idx, weights)
    op = "twell.experts_train.default" if grad else "twell.experts.default"
    calls = [n for n in backend.nodes() if n.op == "call_function"]
    assert [str(n.target) for n in calls].count(op) == 1
    assert not [n for n in calls if n.target in (F.relu, torch._grouped_mm)]
    fills = [n for n in backend.nodes() if n.op == "call_method" and n.target == "masked_fill"]
    assert len(fills) == 1, fills
    y = fills[0].args[0]
    assert "twell" in str(y.target) or "twell" in str(y.args[0].target), y
    assert [(r.experts, r.act, r.n, r.k) for r in backend.report.rewrites] == [(3, "relu", 8, 16)]
    assert not backend.report.rejections
    check_close("y", got, want, ref)
    if grad:
        dy = torch.randn(8, 16, dtype=torch.float64)
        params = [mod.gate_up_proj, mod.down_proj]
        ref_mod = SentinelExperts()
        ref_mod.gate_up_proj, ref_mod.down_proj = (nn.Parameter(p.detach().double()) for p in params)
        g_ref = torch.autograd.grad(_sentinel_ref(ref_mod, x, idx, weights), list(ref_mod.parameters()), dy)
        for a, b, c in zip(torch.autograd.grad(got, params, dy.to(BF16)),
                           torch.autograd.grad(want, params, dy.to(BF16)), g_ref):
            check_close("grad", a, b, c)


_SENTINEL_NEAR_MISSES = {
    "fill_one": "a grouped projection's output is masked_fill-ed with 1.0 before the activation, not 0",
    "feature_mask": "a grouped projection's output is masked_fill-ed by a mask that is not one value per row",
    "no_final": ("the grouped projections' output rows are masked_fill-ed before the activation but the down "
                 "projection's output is not masked_fill-ed with 0 by the same mask"),
    "other_mask": ("the grouped projections' output rows are masked_fill-ed before the activation but the down "
                   "projection's output is not masked_fill-ed with 0 by the same mask"),
    "mask_written": ("a tensor that may alias the row mask is modified in place (call_method logical_not_ on "
                     "sentinel_mask) between the masked_fill calls"),
}


@pytest.mark.parametrize("variant", list(_SENTINEL_NEAR_MISSES))
def test_sentinel_masked_experts_near_miss(variant: str) -> None:
    """Masked experts whose masking the rewrite would change: left to Inductor with the reason,
    both grouped matmuls still in the graph, the output eager's."""
    torch.manual_seed(0)
    mod = SentinelExperts(variant).to(BF16)
    x, idx, weights, fmask = _sentinel_inputs(1)
    backend = PassBackend()
    with torch.no_grad():
        got = torch.compile(mod, backend=backend)(x, idx, weights, fmask)
        want = mod(x, idx, weights, fmask)
    assert not backend.report.rewrites
    assert [r.reason for r in backend.report.rejections] == [_SENTINEL_NEAR_MISSES[variant]]
    assert sum(n.op == "call_function" and n.target is torch._grouped_mm for n in backend.nodes()) == 2
    # tokens with a sentinel slot may read the rows past offs[-1] that torch._grouped_mm leaves unset
    # (no_final, other_mask: the clamp_ has already cleared the recomputed mask; mask_written)
    plain = (idx < mod.num_experts).all(dim=1)
    assert torch.equal(got[plain], want[plain])
