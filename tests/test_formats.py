"""Bit-exact round trips of the TwELL and hybrid formats on any input."""

import pytest
import torch
from hypothesis import given, strategies as st

from twell_compile.formats import (Hybrid, nonzero_mask, pack_hybrid, pack_twell, unpack_hybrid,
                                   unpack_twell)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t):
    return t.contiguous().view(_INT[t.dtype])


@st.composite
def activations(draw):
    """Random h with a chosen density, busy rows, specials (NaN, Inf, -0.0) and odd sizes."""
    m = draw(st.integers(0, 9))
    n = draw(st.integers(1, 70))
    dtype = draw(st.sampled_from(DTYPES))
    density = draw(st.sampled_from([0.0, 0.02, 0.2, 0.7, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, n, generator=g).to(dtype)
    keep = torch.rand(m, n, generator=g) < density
    if m and draw(st.booleans()):  # one busy row among sparse ones
        keep[draw(st.integers(0, m - 1))] = True
    h = torch.where(keep, h, torch.zeros((), dtype=dtype))
    if m and draw(st.booleans()):
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
        idx = torch.randint(0, m * n, (4,), generator=g)
        h.view(-1)[idx] = specials
    return h


@given(activations(), st.sampled_from([1, 4, 8, 16, 32]), st.integers(1, 8))
def test_twell_round_trip_is_bit_exact(h, tile_n, slots):
    slots = min(slots, tile_n)
    p = pack_twell(h, tile_n, slots)
    out = unpack_twell(p)
    assert out.dtype == h.dtype and out.shape == h.shape
    assert torch.equal(bits(out), bits(h))
    # Layout contract.
    n_tiles = max(1, -(-h.shape[1] // tile_n))
    assert p.values.shape == (h.shape[0], n_tiles, slots) and p.cols.dtype == torch.int16
    assert p.counts.shape == (h.shape[0], n_tiles) and p.counts.dtype == torch.int32
    assert int(p.counts.sum()) == int(nonzero_mask(h).sum())
    assert p.ovf_tiles.numel() == int((p.counts > slots).sum())


@given(activations(), st.integers(1, 12), st.booleans())
def test_hybrid_round_trip_is_bit_exact(h, width, bounded):
    busy = int((nonzero_mask(h).sum(-1) > width).sum()) if h.numel() else 0
    cap = busy if bounded else None
    p = pack_hybrid(h, width, cap)
    out = unpack_hybrid(p, h.shape[1])
    assert torch.equal(bits(out), bits(h))
    assert p.cols.dtype == torch.int32 and p.counts.dtype == torch.int32
    assert p.missing_rows().numel() == 0


def test_twell_slots_hold_first_nonzeros_in_column_order():
    h = torch.tensor([[0.0, 1.0, 0.0, 2.0, 3.0, 0.0, 0.0, 4.0]])
    p = pack_twell(h, tile_n=4, slots=2)
    assert p.counts.tolist() == [[2, 2]]
    assert p.values.tolist() == [[[1.0, 2.0], [3.0, 4.0]]]
    assert p.cols.tolist() == [[[1, 3], [0, 3]]]
    assert p.ovf_tiles.numel() == 0


def test_twell_overflow_tile_is_kept_dense():
    h = torch.randn(3, 12) + 5.0  # every entry non-zero
    p = pack_twell(h, tile_n=4, slots=2)
    assert p.ovf_tiles.tolist() == list(range(9))  # 3 rows x 3 tiles, all over capacity
    assert torch.equal(unpack_twell(p), h)


def test_hybrid_missing_rows_are_refused_or_recomputed():
    h = torch.zeros(5, 6)
    h[1] = torch.randn(6).abs() + 1
    h[3] = torch.randn(6).abs() + 1
    p = pack_hybrid(h, width=2, capacity=1)
    assert p.backup_rows.tolist() == [1]
    assert p.missing_rows().tolist() == [3]
    with pytest.raises(ValueError, match="recompute"):
        unpack_hybrid(p, 6)
    out = unpack_hybrid(p, 6, recompute=lambda rows: h[rows])
    assert torch.equal(out, h)


def test_nan_counts_as_nonzero():
    h = torch.tensor([[float("nan"), 0.0, -0.0, 1.0]])
    assert nonzero_mask(h).tolist() == [[True, False, True, True]]


@pytest.mark.parametrize("bad, match", [
    (dict(tile_n=0), "tile_n"), (dict(slots=0), "slots"), (dict(tile_n=4, slots=5), "slots"),
])
def test_pack_twell_rejects_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        pack_twell(torch.randn(2, 8), **bad)


def test_pack_rejects_non_tensors_and_wrong_rank():
    with pytest.raises(TypeError, match="h must be"):
        pack_twell([[1.0]])
    with pytest.raises(ValueError, match="2-D"):
        pack_hybrid(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="floating"):
        nonzero_mask(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="capacity"):
        pack_hybrid(torch.randn(2, 3), capacity=-1)
