"""runtime/torch_impl.py's training state: which (column, relu(g), u) pairs it keeps, and that
the backward from it is autograd's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import twell_compile  # noqa: F401  (registers the ops)
from tests.helpers import check_close
from twell_compile.formats import nonzero_mask
from twell_compile.reference import activate, ffn_hidden
from twell_compile.runtime import torch_impl

WIDTH, BACKUP = 6, 4            # narrow ELL and a small backup: ELL rows, backup rows and missing rows


def _ffn(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    m, k, n, k_out = 24, 12, 20, 9
    x = torch.randn(m, k, generator=g).to(dtype)
    return (x, (torch.randn(n, k, generator=g) / 3).to(dtype), (torch.randn(n, generator=g) * 0.1).to(dtype),
            (torch.randn(n, k, generator=g) / 3).to(dtype), (torch.randn(n, generator=g) * 0.1).to(dtype),
            (torch.randn(k_out, n, generator=g) / 4).to(dtype), None)


def _state(args, act):
    return torch_impl.ffn_train_forward(*args, WIDTH, BACKUP, "t", False, act)


def _listed(counts, cols, width):
    """Each row's stored columns of the ELL part (the first min(count, width))."""
    return [set(c[:min(int(k), width)].tolist()) for k, c in zip(counts, cols)]


@pytest.mark.parametrize("act", ["relu", "relu2", "drelu"])
def test_state_holds_the_pairs_where_h_is_nonzero(act):
    """relu/relu2: relu(g)'s non-zeros; dReLU: only where relu(u) is non-zero too (fewer pairs,
    so fewer busy rows); the counts the statistics and controller take stay relu(g)'s."""
    args = _ffn()
    y, counts, cols, ell_g, ell_u, bidx, bg, bu, gate_counts = _state(args, act)
    hg, hu = ffn_hidden(*args[:5])
    h = activate(hg, hu, act)
    nz = ((h != 0) | h.isnan()) if act == "drelu" else nonzero_mask(hg)
    assert torch.equal(counts, nz.sum(-1, dtype=torch.int32))
    assert torch.equal(gate_counts, nonzero_mask(hg).sum(-1, dtype=torch.int32))
    if act == "drelu":
        assert (counts < gate_counts).any()          # the intersection is sparser than relu(g)
    for row, listed in enumerate(_listed(counts, cols, WIDTH)):
        want = nz[row].nonzero().reshape(-1)[:WIDTH].tolist()
        assert listed == set(want)
        kept = cols[row, :len(want)].long()
        assert torch.equal(ell_g[row, :len(want)], hg[row, kept])
        assert torch.equal(ell_u[row, :len(want)], hu[row, kept])
    for slot, row in enumerate(bidx.tolist()):       # backup rows: relu(g) at the kept pairs, dense
        if row >= 0:
            assert torch.equal(bg[slot], torch.where(nz[row], hg[row], 0))
    torch.testing.assert_close(y, F.linear(h, args[5]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drelu_backward_from_the_paired_state_is_autograds(dtype):
    """Gradients from the dReLU state (L1 term included) against fp64 autograd, under the 2x
    rule; busy rows past the backup are recomputed from x."""
    args = _ffn(dtype, seed=1)
    y, *state, _ = _state(args, "drelu")
    assert (state[0] > WIDTH).sum() > BACKUP          # some busy rows are missing from the backup
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = torch_impl.ffn_train_backward(dy, *args[:6], *state, 0.3, "drelu")

    def grads(cast):
        leaves = [None if a is None else cast(a).detach().requires_grad_() for a in args]
        hg, hu = ffn_hidden(*leaves[:5])
        h = activate(hg, hu, "drelu")
        loss = (F.linear(h, leaves[5]) * cast(dy)).sum() + 0.3 * h.abs().mean()
        return torch.autograd.grad(loss, [a for a in leaves if a is not None])

    eager, ref = grads(lambda t: t), grads(lambda t: t.double())
    for name, a, e, r in zip(("dx", "dw_gate", "db_gate", "dw_up", "db_up", "dw_down"), got, eager, ref):
        check_close(name, a, e, r)


def test_db_down_false_skips_the_sum_over_dy_and_changes_no_other_gradient():
    """``db_down=False`` (a down projection without bias): db_down is None, the rest as with it."""
    args = _ffn(torch.float32, seed=3)
    y, *state, _ = _state(args, "relu")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    full = torch_impl.ffn_train_backward(dy, *args[:6], *state, 0.3, "relu")
    lean = torch_impl.ffn_train_backward(dy, *args[:6], *state, 0.3, "relu", None, False)
    torch.testing.assert_close(full[6], dy.reshape(-1, dy.shape[-1]).sum(0))
    assert lean[6] is None
    for a, b in zip(full[:6], lean[:6]):
        assert (a is None and b is None) or torch.equal(a, b)
