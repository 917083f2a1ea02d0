"""The CPU backend's matmul on row-blocked weights (`ops.matmul`, output rows in the vector lanes)
gives the bits of the row-wise reference (`ops.matmul_rowwise`) for every element, whatever the
row count, the shape and the values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tinyloop.cpu import ops


def _blocked(x, W, T, accumulate, base):
    a = base.copy()
    ops.matmul_rowwise(x, W, a, T, accumulate)
    b = base.copy()
    ops.matmul(x, ops.block_rows(W), W.shape[0], b, T, accumulate)
    return a, b


def _values(rng, shape, spread):
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-spread, spread + 1, shape))).astype(np.float32)


@settings(max_examples=40, deadline=None)
@given(N=st.integers(1, 100), K=st.integers(1, 150), T=st.integers(1, 140), accumulate=st.booleans(),
       seed=st.integers(0, 2 ** 31), spread=st.integers(0, 60))
def test_blocked_matmul_equals_rowwise_bit_for_bit(N, K, T, accumulate, seed, spread):
    """Output rows in the vector lanes (N not a multiple of LANES: a padded last block; K not a
    multiple of 8: the tail in order), values over many binades: the reference's bits; rows past T
    and columns past N untouched."""
    rng = np.random.default_rng(seed)
    x, W = _values(rng, (T + 2, K), spread), _values(rng, (N, K), spread)
    base = rng.standard_normal((T + 2, N + 3)).astype(np.float32)
    a, b = base.copy(), base.copy()
    ops.matmul_rowwise(x, W, a[:, :N], T, accumulate)
    ops.matmul(x, ops.block_rows(W), N, b, T, accumulate)
    _same(a, b)
    assert np.array_equal(b[T:], base[T:]) and np.array_equal(b[:, N:], base[:, N:])


def test_block_rows_layout():
    """Block b, column l is row b * LANES + l; zeros past N; unblock_rows inverts it; the embedding
    kernel reads rows out of it."""
    rng = np.random.default_rng(5)
    for N in (1, ops.LANES - 1, ops.LANES, 2 * ops.LANES + 3):
        W = rng.standard_normal((N, 7)).astype(np.float32)
        Wb = ops.block_rows(W)
        assert Wb.shape == (-(-N // ops.LANES), 7, ops.LANES)
        for n in range(N):
            assert np.array_equal(Wb[n // ops.LANES, :, n % ops.LANES], W[n])
        assert not Wb[-1, :, N - (Wb.shape[0] - 1) * ops.LANES:].any()
        assert np.array_equal(ops.unblock_rows(Wb, N), W)
        ids = rng.integers(0, N, 5)
        out = np.zeros((5, 7), np.float32)
        ops.embed(Wb, ids, out, 5)
        assert np.array_equal(out, W[ids])


def _same(a, b):
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    assert np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def test_blocked_matmul_special_values():
    """inf, nan, signed zeros and subnormals in x and W: the same results as the row-wise kernel."""
    rng = np.random.default_rng(3)
    N, K, T = 33, 37, 40
    x = rng.standard_normal((T, K)).astype(np.float32)
    W = rng.standard_normal((N, K)).astype(np.float32)
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, -1e-42, 3e38], np.float32)
    x.flat[rng.integers(0, x.size, 60)] = rng.choice(specials, 60)
    W.flat[rng.integers(0, W.size, 60)] = rng.choice(specials, 60)
    for rows in (1, 3, T):
        a, b = _blocked(x, W, rows, False, np.zeros((T, N), np.float32))
        _same(a, b)


@pytest.mark.parametrize("T", [1, 16, 45, 130])
def test_backend_rows_alone_equal_rows_in_a_launch(T):
    """Through the CPU backend: row t of a T-row product equals the row computed alone, and both
    equal the row-wise reference kernel (a plain array handed to the backend), bit for bit."""
    from tinyloop.cpu.backend import CPUBackend, RowBlocks
    from tinyloop.model.arch import ModelConfig
    from tinyloop.model.presets import get_preset
    cfg = ModelConfig.from_dict(get_preset("small").config)
    be = CPUBackend(cfg, 256)
    be.alloc_workspace(T)
    rng = np.random.default_rng(T)
    N, K = 3 * cfg.d_model, cfg.d_ff
    x = rng.standard_normal((T, K)).astype(np.float32)
    W = rng.standard_normal((N, K)).astype(np.float32)
    Wb = RowBlocks(W)
    out = np.zeros((T, N), np.float32)
    be.matmul(x, Wb, out, T)
    ref = np.zeros((T, N), np.float32)
    be.matmul(x, W, ref, T)                      # a plain array: the row-wise reference kernel
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    for t in range(T):
        one = np.zeros((1, N), np.float32)
        be.matmul(x[t:t + 1], Wb, one, 1)
        assert np.array_equal(one[0], out[t])
