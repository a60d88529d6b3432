"""Triton device code: the activations of the ReLU family, where h is formed.

Every kernel finds the non-zeros of hg = relu(g) (NaN kept) and forms h there from hg and the up
projection u; ``ACT`` (constexpr) picks the activation, its index in reference.ACTS:

    0 relu    h = hg [* u]
    1 relu2   h = hg^2 [* u]                 (squared ReLU: same zero pattern as hg)
    2 drelu   h = hg * relu(u)               (dReLU, gated only: zero wherever hg is)

The training state keeps hg and u (not h), so the backward forms the derivative from them:
``grads`` gives d_g and d_u from dh as autograd does (threshold_backward semantics: NaN in hg
or u passes).
"""

import triton
import triton.language as tl

@triton.jit
def gate_part(hg, ACT: tl.constexpr):
    """a(hg): hg^2 for squared ReLU, else hg (fp32)."""
    if ACT == 1:
        return hg * hg
    else:
        return hg


@triton.jit
def up_part(u, ACT: tl.constexpr):
    """b(u): relu(u) for dReLU (NaN kept), else u (fp32)."""
    if ACT == 2:
        return tl.where(u < 0.0, 0.0, u)
    else:
        return u


@triton.jit
def hidden(hg, u, GATED: tl.constexpr, ACT: tl.constexpr):
    """h = a(hg) * b(u), or a(hg) when not GATED (fp32, unrounded)."""
    if GATED:
        return gate_part(hg, ACT) * up_part(u, ACT)
    else:
        return gate_part(hg, ACT)


@triton.jit
def grads(dh, hg, u, GATED: tl.constexpr, ACT: tl.constexpr):
    """(d_g, d_u) in fp32 from dh (its L1 term included), hg and u: d_g = dh b(u) a'(hg) where
    hg > 0 (and NaN), else 0; d_u = dh a(hg) b'(u). Non-gated: d_u = dh a(hg), unused.

    dReLU's d_u is 0 where hg > 0 and u <= 0; where hg is 0 it is dh * 0, as ReLU's: the state
    keeps u only where hg is non-zero, so every path takes it so (it differs from eager only
    where dh is not finite: NaN there, where eager's relu(u) mask gives 0 for u <= 0)."""
    a = gate_part(hg, ACT)
    if GATED:
        dg = dh * up_part(u, ACT)
    else:
        dg = dh
    if ACT == 1:
        dg = dg * (2.0 * hg)
    dg = tl.where(hg <= 0.0, 0.0, dg)
    du = dh * a
    if ACT == 2:
        du = tl.where((u <= 0.0) & (hg > 0.0), 0.0, du)
    return dg, du
