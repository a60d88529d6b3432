"""kernels/weight_cache.py on the CPU: decode states follow their parameter's life and hold no
weight values."""

import gc

import torch
import torch.nn as nn

from twell_compile.kernels import weight_cache


def _fresh():
    weight_cache.clear()
    assert weight_cache.state_bytes() == 0


def _one_state() -> int:
    return (weight_cache.STATE_ROWS * 24 + weight_cache.STATE_TAIL) * 4


def test_state_freed_with_its_parameter():
    _fresh()
    w = nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    keep = nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    assert weight_cache.register(w) and weight_cache.register(keep)
    assert weight_cache.state_bytes() == 2 * _one_state()
    del w
    gc.collect()
    assert weight_cache.state_bytes() == _one_state()      # only keep's state
    assert weight_cache.decode_state(keep, 3) is not None
    weight_cache.clear()


def test_view_entry_lives_as_long_as_its_base():
    _fresh()
    base = nn.Parameter(torch.randn(48, 40, dtype=torch.bfloat16))
    view = base[24:]                                  # a fused weight's half
    assert weight_cache.register(view, base=base)
    del view
    gc.collect()
    assert weight_cache.state_bytes() > 0             # the base still lives: the state stays
    assert weight_cache.decode_state(base[24:], 2) is not None
    del base
    gc.collect()
    assert weight_cache.state_bytes() == 0


def test_rebound_or_dead_weights_get_no_state():
    _fresh()
    w = nn.Parameter(torch.randn(24, 40))
    assert weight_cache.register(w.detach(), base=w)
    acc, tail = weight_cache.decode_state(w.detach(), 5)
    assert acc.numel() == 5 * 24 and not acc.any() and not tail.any()
    assert weight_cache.decode_state(w.detach(), weight_cache.STATE_ROWS + 1) is None
    old = w.detach()
    w.data = torch.randn(24, 40)                      # rebinding: the entry no longer describes w
    assert weight_cache.decode_state(old, 5) is None
    assert weight_cache.decode_state(w.detach(), 5) is None
    assert weight_cache.state_bytes() == 0
    weight_cache.clear()


def test_a_newer_entry_at_a_reused_key_survives_the_old_ones_drop():
    _fresh()
    w = nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    assert weight_cache.register(w)
    key = weight_cache._key(w)
    old = weight_cache._entries[key]
    newer = weight_cache._Entry(old.base.__class__(w), old.base_ptr, old.state)
    weight_cache._entries[key] = newer                # as if another tensor now held the address
    weight_cache._drop(key, old.base)
    assert weight_cache._entries.get(key) is newer
    weight_cache.clear()
