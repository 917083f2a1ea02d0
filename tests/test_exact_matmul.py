"""The exact integer matmul's numerics (tinyloop/model/exact_matmul.py) against a naive
element-by-element model written from its definition with Python integers and floats, and its
error against float64 arithmetic."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyloop.model import exact_matmul as em
from tinyloop.model.arch import TensorQuant
from tinyloop.model.quant import dequantize, quantize, unpack


def naive(x, codes, scales, zeros):
    """Step by step from the module doc, one output at a time, Python ints for every integer."""
    T, K = x.shape
    N, G = scales.shape
    gs = K // G
    cg = max(1, em.CHUNK_K // gs)
    out = np.empty((T, N), np.float32)
    for t in range(T):
        Xs, Es = [], []
        for g in range(G):
            seg = x[t, g * gs:(g + 1) * gs]
            m = float(np.abs(seg).max())
            e = math.frexp(m)[1] if m >= 2.0 ** -126 else -125
            Es.append(e)
            Xs.append([int(np.rint(float(v) * 2.0 ** (em.XBITS - e))) for v in seg])
        for n in range(N):
            total = 0.0
            for c0 in range(0, G, cg):
                acc = 0.0
                for g in range(c0, min(G, c0 + cg)):
                    z = int(zeros[n, g])
                    V = sum((int(codes[n, g * gs + i]) - z) * Xs[g][i] for i in range(gs))
                    s = float(scales[n, g])
                    mant, ex = math.frexp(s)          # s = mant * 2^ex, mant in [0.5, 1)
                    sm = int(mant * 2048)              # 11-bit integer significand
                    es = ex - 11
                    assert sm * 2.0 ** es == s
                    acc = acc + math.ldexp(float(V * sm), es + Es[g] - em.XBITS)
                total = total + acc
            out[t, n] = np.float32(total)
    return out


def _case(seed, T, N, K, gs, bits):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    tq = TensorQuant(f"q{bits}", gs)
    parts = quantize(w, tq)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[:, rng.integers(0, K, 3)] *= 40.0                 # outliers inside some groups
    x[:, :gs] *= 1e-3                                    # a group of small values
    return x, unpack(parts["q"], bits, K), parts, tq


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 31), T=st.integers(1, 3), N=st.integers(1, 5),
       groups=st.integers(1, 9), gs=st.sampled_from([32, 64, 128]), bits=st.sampled_from([2, 4, 8]))
def test_reference_equals_the_naive_definition(seed, T, N, groups, gs, bits):
    x, codes, parts, _ = _case(seed, T, N, groups * gs, gs, bits)
    got = em.exact_matmul(x, codes, parts["scales"], parts["zeros"], block_rows=2)
    np.testing.assert_array_equal(got, naive(x, codes, parts["scales"], parts["zeros"]))


def test_error_is_below_float32s():
    x, codes, parts, tq = _case(1, 4, 64, 2048, 128, 4)
    N, K = codes.shape
    exact = x.astype(np.float64) @ dequantize(parts, tq, (N, K)).astype(np.float64).T
    got = em.exact_matmul(x, codes, parts["scales"], parts["zeros"]).astype(np.float64)
    naive32 = np.zeros_like(exact)                      # a sequential float32 dot product
    w32 = dequantize(parts, tq, (N, K)).astype(np.float32)
    for t in range(x.shape[0]):
        acc = np.zeros(N, np.float32)
        for k in range(K):
            acc = (acc + w32[:, k] * x[t, k]).astype(np.float32)
        naive32[t] = acc
    scale = np.abs(exact).max()
    err = np.abs(got - exact).max() / scale
    assert err <= 2.0 ** -24                             # float32 rounding of the result itself
    assert err < np.abs(naive32 - exact).max() / scale


def test_rows_are_independent_and_accumulate_rounds_once():
    x, codes, parts, _ = _case(2, 5, 16, 512, 64, 4)
    full = em.exact_matmul(x, codes, parts["scales"], parts["zeros"])
    for t in range(5):
        np.testing.assert_array_equal(em.exact_matmul(x[t:t + 1], codes, parts["scales"], parts["zeros"])[0],
                                      full[t])
    base = np.random.default_rng(3).standard_normal(full.shape).astype(np.float32)
    acc = em.exact_matmul(x, codes, parts["scales"], parts["zeros"], out=base.copy())
    total = em.exact_matmul(x, codes, parts["scales"], parts["zeros"]).astype(np.float64)
    # one rounding of (total + old): equal to the float32 sum whenever that sum is exact in float64
    assert np.abs(acc.astype(np.float64) - (total + base)).max() <= 2.0 ** -23 * np.abs(total + base).max()


def test_limbs_rebuild_the_integers_within_int8():
    rng = np.random.default_rng(4)
    X = rng.integers(-2 ** em.XBITS, 2 ** em.XBITS + 1, 10000)
    X[:4] = [2 ** em.XBITS, -2 ** em.XBITS, 0, -1]
    L = em.limbs(X).astype(np.int64)
    rebuilt = sum(L[i] << (em.LIMB_BITS * (em.LIMBS - 1 - i)) for i in range(em.LIMBS))
    np.testing.assert_array_equal(rebuilt, X)
    assert L[1:].min() >= -64 and L[1:].max() <= 63 and np.abs(L[0]).max() <= 65


def test_zero_and_tiny_groups():
    x, codes, parts, tq = _case(5, 2, 8, 256, 128, 4)
    x[0, :128] = 0.0
    x[1, 128:] = np.float32(1e-40)                       # subnormals
    got = em.exact_matmul(x, codes, parts["scales"], parts["zeros"])
    np.testing.assert_array_equal(got, naive(x, codes, parts["scales"], parts["zeros"]))
    exact = x.astype(np.float64) @ dequantize(parts, tq, (8, 256)).astype(np.float64).T
    assert np.abs(got - exact).max() <= 1e-6 * np.abs(exact).max()
