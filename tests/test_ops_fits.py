"""White-box: the ops' one-pass argument check (``ops._fits``) against the explaining one.

Refusing a valid argument set would only make a call slower (the explaining checks then run and
pass), which no public call shows; so this file reads the private check, as test_layers allows."""

import pytest
import torch

from twell_compile import ops

from tests.test_ops import make


@pytest.mark.parametrize("gated, bias, lead", [(True, True, (5,)), (True, False, (2, 3)), (False, True, (4,)),
                                              (False, False, (1, 1, 2))])
def test_valid_arguments_take_the_one_pass_check(gated, bias, lead):
    """The per-call check (ops._fits) passes every valid argument set by itself, so the explaining
    checks run only where an argument is bad (a fits that refused good ones would only be slower)."""
    args = make(5, 8, 12, 7)
    args[0] = torch.randn(*lead, 8)
    if not gated:
        args[3] = args[4] = None
    if not bias:
        args[2] = args[4] = args[6] = None
    assert ops._fits(*args)


@pytest.mark.parametrize("change", [
    lambda a: a.__setitem__(0, torch.randn(5, 9)),                  # x's width is not w_gate's
    lambda a: a.__setitem__(2, torch.randn(11)),                    # b_gate's length
    lambda a: a.__setitem__(3, torch.randn(12, 9)),                 # w_up's shape
    lambda a: a.__setitem__(4, torch.randn(12).double()),           # b_up's dtype
    lambda a: (a.__setitem__(3, None)),                             # b_up without w_up
    lambda a: a.__setitem__(5, torch.randn(7, 11)),                 # w_down's width
    lambda a: a.__setitem__(0, torch.tensor(1.0)),                  # x without a feature dimension
    lambda a: a.__setitem__(0, torch.ones(5, 8, dtype=torch.int32)),
    lambda a: a.__setitem__(1, "w"),                                # not a tensor
])
def test_bad_arguments_fail_the_one_pass_check(change):
    """Every set the explaining check refuses, the one-pass check refuses too (else a bad call
    would reach the kernels unchecked)."""
    args = make(5, 8, 12, 7)
    change(args)
    assert not ops._fits(*args)
    with pytest.raises((TypeError, ValueError)):
        ops._check(*args)
