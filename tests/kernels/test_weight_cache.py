"""kernels/weight_cache.py on the CPU: the W_down^T copies follow their parameter's life."""

import gc

import torch

from twell_compile.kernels import weight_cache


def _fresh():
    weight_cache.clear()
    assert weight_cache.cached_bytes() == 0


def test_copy_freed_with_its_parameter():
    _fresh()
    w = torch.nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    keep = torch.nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    assert weight_cache.register(w) and weight_cache.register(keep)
    assert weight_cache.cached_bytes() == 2 * w.numel() * w.element_size()
    assert torch.equal(weight_cache.transposed(w), w.detach().t())
    del w
    gc.collect()
    assert weight_cache.cached_bytes() == keep.numel() * keep.element_size()   # only keep's copy
    assert torch.equal(weight_cache.transposed(keep), keep.detach().t())
    weight_cache.clear()


def test_view_entry_lives_as_long_as_its_base():
    _fresh()
    base = torch.nn.Parameter(torch.randn(48, 40, dtype=torch.bfloat16))
    view = base[24:]                                  # a fused weight's half
    assert weight_cache.register(view, base=base)
    del view
    gc.collect()
    assert weight_cache.cached_bytes() > 0            # the base still lives: the copy stays
    assert torch.equal(weight_cache.transposed(base[24:]), base.detach()[24:].t())
    del base
    gc.collect()
    assert weight_cache.cached_bytes() == 0


def test_a_newer_entry_at_a_reused_key_survives_the_old_ones_drop():
    _fresh()
    w = torch.nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    assert weight_cache.register(w)
    key = weight_cache._key(w)
    old = weight_cache._entries[key]
    newer = weight_cache._Entry(old.base.__class__(w), old.base_ptr, old.view, old.wt, old.version)
    weight_cache._entries[key] = newer                # as if another tensor now held the address
    weight_cache._drop(key, old.base)
    assert weight_cache._entries.get(key) is newer
    weight_cache.clear()
