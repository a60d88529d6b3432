"""kernels/decode_state.py on the CPU: decode states follow their parameter's life and hold no
weight values."""

import gc

import torch
import torch.nn as nn

from twell_compile.runtime import decode_state


def _fresh():
    decode_state.clear()
    assert decode_state.state_bytes() == 0


def _one_state() -> int:
    return (decode_state.STATE_ROWS * 24 + decode_state.STATE_TAIL) * 4


def test_state_freed_with_its_parameter():
    _fresh()
    w = nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    keep = nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    assert decode_state.register(w) and decode_state.register(keep)
    assert decode_state.state_bytes() == 2 * _one_state()
    del w
    gc.collect()
    assert decode_state.state_bytes() == _one_state()      # only keep's state
    assert decode_state.decode_state(keep, 3) is not None
    decode_state.clear()


def test_view_entry_lives_as_long_as_its_base():
    _fresh()
    base = nn.Parameter(torch.randn(48, 40, dtype=torch.bfloat16))
    view = base[24:]                                  # a fused weight's half
    assert decode_state.register(view, base=base)
    del view
    gc.collect()
    assert decode_state.state_bytes() > 0             # the base still lives: the state stays
    assert decode_state.decode_state(base[24:], 2) is not None
    del base
    gc.collect()
    assert decode_state.state_bytes() == 0


def test_rebound_or_dead_weights_get_no_state():
    _fresh()
    w = nn.Parameter(torch.randn(24, 40))
    assert decode_state.register(w.detach(), base=w)
    acc, tail = decode_state.decode_state(w.detach(), 5)
    assert acc.numel() == 5 * 24 and not acc.any() and not tail.any()
    assert decode_state.decode_state(w.detach(), decode_state.STATE_ROWS + 1) is None
    old = w.detach()
    w.data = torch.randn(24, 40)                      # rebinding: the entry no longer describes w
    assert decode_state.decode_state(old, 5) is None
    assert decode_state.decode_state(w.detach(), 5) is None
    assert decode_state.state_bytes() == 0
    decode_state.clear()


def test_a_newer_entry_at_a_reused_key_survives_the_old_ones_drop():
    _fresh()
    w = nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    assert decode_state.register(w)
    key = decode_state._key(w)
    old = decode_state._entries[key]
    newer = decode_state._Entry(old.base.__class__(w), old.base_ptr, old.state)
    decode_state._entries[key] = newer                # as if another tensor now held the address
    decode_state._drop(key, old.base)
    assert decode_state._entries.get(key) is newer
    decode_state.clear()
