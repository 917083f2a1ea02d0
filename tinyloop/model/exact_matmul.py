"""The exact integer matmul: numerics for quantized weights that any kernel can reproduce bit for bit.

``out[t, n] = sum_k x[t, k] * W[n, k]`` with ``W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]``
(the file format's groups, docs/FORMAT.md) is defined here so that the result does not depend on
the order in which a kernel adds the products: every sum that a kernel may split or reorder is a
sum of integers, which is exact; the few floating-point steps left happen in one fixed order.
That lets a tensor-core kernel (integer ``mma.sync``), a CUDA-core GEMV and the CPU give the
same bits for any number of rows (docs/KERNELS.md, "The exact integer matmul").

For each token row t and weight group g (elements ``[g*G, (g+1)*G)``):

1. ``m = max |x[t, k]|`` over the group; ``E = max(e, 1) - 126`` where e is m's biased float32
   exponent, so ``m < 2^E``.
2. ``X[t, k] = rint(x[t, k] * 2^(XBITS - E))``, an integer with ``|X| <= 2^XBITS`` (round half to
   even; exact scaling in float64). Each x keeps XBITS + 1 bits relative to its group's largest.
3. ``V[t, n, g] = sum_k (q[n, k] - zero[n, g]) * X[t, k]`` exactly, an integer with
   ``|V| <= 255 * G * 2^XBITS`` (below 2^46 for groups of up to 2048).
4. ``scale = sm * 2^es`` with sm the float16's integer significand (at most 2047);
   ``P = V * sm`` exactly (|P| < 2^63); ``term = float64(P) * 2^(es + E - XBITS)`` (one rounding,
   round to nearest even, only when |P| > 2^53; the power of two is exact).
5. Groups are added in order within a chunk of CG = max(1, CHUNK_K // G) groups, starting from
   0.0: ``c_j = ((0 + term_0) + term_1) + ...`` in float64; chunks are added in order the same way:
   ``total = ((0 + c_0) + c_1) + ...``.
6. ``out = float32(total)``; accumulating into an existing float32 ``o``: ``out =
   float32(total + float64(o))``.

Kernels vectorize steps 2-3 freely (tensor cores: X as four signed 7-bit limbs, `LIMBS`); steps
4-6 are few and cheap. The error against exact arithmetic is at most 2^-(XBITS + 1) of the
group's largest |x| per element (step 2) plus float64 roundings: below float32's own.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidInputError

#: Bits of every x kept relative to its group's largest magnitude (plus the sign).
XBITS = 27
#: Signed base-2^7 digits of X: ``X = sum_i limb_i * 2^(7 * (LIMBS - 1 - i))``, each in int8.
LIMBS = 4
LIMB_BITS = 7
#: Elements of k per chunk of groups (step 5).
CHUNK_K = 512


def chunk_groups(group_size: int) -> int:
    """CG: groups per chunk for a weight with this group size."""
    return max(1, CHUNK_K // int(group_size))


def group_exponents(x: np.ndarray, group_size: int) -> np.ndarray:
    """E[t, g] (step 1), int64 (T, G)."""
    T, K = x.shape
    m = np.abs(np.asarray(x, np.float32)).reshape(T, K // group_size, group_size).max(axis=2)
    e = (m.view(np.int32) >> 23) & 0xFF
    return (np.maximum(e, 1) - 126).astype(np.int64)


def to_integers(x: np.ndarray, group_size: int):
    """(X int64 (T, K), E int64 (T, G)): steps 1-2."""
    T, K = x.shape
    E = group_exponents(x, group_size)
    f = np.ldexp(1.0, XBITS - np.repeat(E, group_size, axis=1))
    X = np.rint(np.asarray(x, np.float64) * f).astype(np.int64)
    return X, E


def limbs(X: np.ndarray) -> np.ndarray:
    """The LIMBS signed digits of X (int8, (LIMBS,) + X.shape), most significant first; each of
    the lower digits is in [-64, 63] and the top one in [-65, 65]."""
    out = np.empty((LIMBS,) + X.shape, np.int8)
    rest = np.asarray(X, np.int64)
    half = 1 << (LIMB_BITS - 1)
    for i in range(LIMBS - 1, 0, -1):
        d = ((rest + half) & ((1 << LIMB_BITS) - 1)) - half
        out[i] = d
        rest = (rest - d) >> LIMB_BITS
    out[0] = rest
    return out


def scale_parts(scales: np.ndarray):
    """(sm int64, es int64): float16 scales as ``sm * 2^es`` with sm an integer (step 4)."""
    b = np.asarray(scales, np.float16).view(np.uint16).astype(np.int64)
    ebits = (b >> 10) & 0x1F
    frac = b & 0x3FF
    sm = np.where(ebits > 0, frac | 0x400, frac)
    es = np.maximum(ebits, 1) - 25
    return sm, es


def exact_matmul(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray,
                 out: np.ndarray | None = None, block_rows: int = 4096) -> np.ndarray:
    """The reference: x float32 (T, K), codes (N, K) unpacked integers, scales float16 (N, G),
    zeros (N, G); returns float32 (T, N), or accumulates into `out` (float32 (T, N)) and returns
    it. Weight rows are processed `block_rows` at a time (memory only: the result is the same)."""
    x = np.asarray(x, np.float32)
    T, K = x.shape
    N, G = scales.shape
    if codes.shape != (N, K) or zeros.shape != (N, G) or G == 0 or K % G:
        raise InvalidInputError(f"exact_matmul: shapes x {x.shape}, codes {codes.shape}, scales {scales.shape}, "
                         f"zeros {zeros.shape} do not fit")
    gs = K // G
    X, E = to_integers(x, gs)
    SX = X.reshape(T, G, gs).sum(axis=2)                                # (T, G)
    Xf = X.reshape(T, G, gs).astype(np.float64)
    sm, es = scale_parts(scales)
    cg = chunk_groups(gs)
    total = np.zeros((T, N))
    for n0 in range(0, N, block_rows):
        n1 = min(N, n0 + block_rows)
        qf = np.asarray(codes[n0:n1], np.float64).reshape(n1 - n0, G, gs)
        z = np.asarray(zeros[n0:n1], np.int64)
        tot = np.zeros((T, n1 - n0))
        for c0 in range(0, G, cg):
            acc = np.zeros((T, n1 - n0))
            for g in range(c0, min(G, c0 + cg)):
                # |partial sums| < 2^(8 + 7 + XBITS) < 2^53: exact in float64 in any order
                qx = (Xf[:, g, :] @ qf[:, g, :].T).astype(np.int64)
                V = qx - SX[:, g:g + 1] * z[None, :, g]
                P = V * sm[None, n0:n1, g]
                acc = acc + P.astype(np.float64) * np.ldexp(1.0, es[None, n0:n1, g] + E[:, g:g + 1] - XBITS)
            tot = tot + acc
        total[:, n0:n1] = tot
    if out is None:
        return total.astype(np.float32)
    out[...] = (total + out.astype(np.float64)).astype(np.float32)
    return out
