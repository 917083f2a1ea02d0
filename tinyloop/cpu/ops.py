"""CPU kernels (numba @njit), batch-invariant by construction.

Shape legend: T rows in the launch, K input features, N output features, H query heads,
Hkv key/value heads, D head_dim, S cache slots.

Reduction order. Every dot product runs over k in 8 interleaved float32 partial sums
(lane j takes k = j mod 8), combined as ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)), then the tail in
order. Attention reduces over cache slots 0..p in slot order. None of these depend on T, on which
thread computes the element, or on how many threads run, so row t of a T-row launch equals the same
row computed alone (prefill == decode == uncached, bit for bit). fastmath stays off: reassociation
would let LLVM change the order.

Weight layout. The backend holds every weight matrix in row blocks (`block_rows`): block b is the
(K, LANES) transpose of rows b*LANES .. b*LANES + LANES - 1 (rows past N zero), so the LANES output
rows of a block sit in the vector lanes. `matmul` keeps each output row's 8 partial sums as 8
vectors of LANES accumulators, one lane per output row: LLVM vectorizes over the lanes without
reordering any sum. The scalar form, `matmul_rowwise` on an (N, K) matrix (kept as the reference
and for plain arrays), is 2.2-2.9x slower at 1-128 rows on the demo shapes and 2.5-5.7x slower on
the 360m shapes at one row: LLVM does not vectorize its 8 scalar chains. (A many-row kernel with
the input rows in the lanes, `matmul_rows`, served launches of 16 rows or more until the blocked
layout beat it at every row count measured, 16 to 512: it was removed.)

KV caches are read through a codec's inline load function (the built-ins' below, beside their
attention kernels; tinyloop.cpu.kv_codecs); the fp16 cache is stored as uint16 bit patterns (numba
has no float16 on the CPU) and read through a 65536-entry float32 table, which is exact.

Every kernel here is a module-level function with cache=True, so a process after the first loads
compiled code from numba's disk cache (tinyloop/cpu/__pycache__) instead of compiling; only a
third-party codec's attention kernel (attention_for) compiles in each process.
"""

from __future__ import annotations

import numpy as np
from numba import float32, njit, prange

_PAR = dict(parallel=True, fastmath=False, cache=True, nogil=True)
_SEQ = dict(fastmath=False, cache=True, nogil=True)

#: uint16 bit pattern -> float32 value of that IEEE half.
HALF_TO_FLOAT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(inline="always", **_SEQ)
def _dot(a, b, K):
    p0 = float32(0.0); p1 = float32(0.0); p2 = float32(0.0); p3 = float32(0.0)
    p4 = float32(0.0); p5 = float32(0.0); p6 = float32(0.0); p7 = float32(0.0)
    k = 0
    while k + 8 <= K:
        p0 += a[k] * b[k]; p1 += a[k + 1] * b[k + 1]
        p2 += a[k + 2] * b[k + 2]; p3 += a[k + 3] * b[k + 3]
        p4 += a[k + 4] * b[k + 4]; p5 += a[k + 5] * b[k + 5]
        p6 += a[k + 6] * b[k + 6]; p7 += a[k + 7] * b[k + 7]
        k += 8
    s = ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))
    while k < K:
        s += a[k] * b[k]
        k += 1
    return s


@njit(inline="always", **_SEQ)
def _lane_dots(v, A, P, K, L):
    """P[8, l] = sum_k v[k] * A[k, l] for l < L (A (K, >= L), P (9, >= L) scratch) in the module's
    order: partial j (P[j]) over k = j, j + 8, ... ascending, then ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)),
    then the tail k in order. The lanes are independent accumulators, so LLVM vectorizes the l loops
    (a run-time L: vectorized rather than unrolled) without reordering any sum."""
    K8 = K - K % 8
    for j in range(8):
        for l in range(L):
            P[j, l] = float32(0.0)
    for k0 in range(0, K8, 8):
        for j in range(8):
            vv = v[k0 + j]
            for l in range(L):
                P[j, l] += vv * A[k0 + j, l]
    for l in range(L):
        P[8, l] = (((P[0, l] + P[1, l]) + (P[2, l] + P[3, l]))
                   + ((P[4, l] + P[5, l]) + (P[6, l] + P[7, l])))
    for k in range(K8, K):
        vv = v[k]
        for l in range(L):
            P[8, l] += vv * A[k, l]


#: Output rows per block of the blocked weight layout: the vector lanes of `matmul`'s
#: accumulators. 2-core development machine (AVX2), demo shapes, one input row, against the
#: row-wise kernel: 8 lanes 0.9-1.0x, 16 1.1-1.3x, 32 2.1-2.3x, 64 1.9-2.6x, 128 2.0-3.0x (slower
#: than 32 on some shapes); docs/BENCHMARKS.md "CPU: blocked weights".
LANES = 32


def block_rows(W: np.ndarray) -> np.ndarray:
    """The (ceil(N / LANES), K, LANES) float32 blocked copy of an (N, K) matrix (module doc): block
    b, column l holds row b * LANES + l, zeros past N."""
    N, K = W.shape
    nb = -(-N // LANES)
    out = np.zeros((nb, K, LANES), np.float32)
    full = N // LANES
    if full:
        out[:full] = np.asarray(W[:full * LANES], np.float32).reshape(full, LANES, K).transpose(0, 2, 1)
    if N % LANES:
        out[full, :, :N % LANES] = np.asarray(W[full * LANES:], np.float32).T
    return out


def unblock_rows(Wb: np.ndarray, N: int) -> np.ndarray:
    """The (N, K) matrix of a blocked copy (`block_rows`' inverse)."""
    nb, K, L = Wb.shape
    return np.ascontiguousarray(Wb.transpose(0, 2, 1).reshape(nb * L, K)[:N])


@njit(**_PAR)
def matmul(x, Wb, N, out, T, accumulate):
    """out[t, n] (+)= sum_k x[t, k] * W[n, k] for t < T, n < N; x (rows, K), W blocked (`block_rows`:
    (ceil(N / LANES), K, LANES)), out (rows, N). The bits of `matmul_rowwise` (module doc)."""
    NB, K, L = Wb.shape
    for b in prange(NB):
        P = np.empty((9, L), np.float32)
        wb = Wb[b]
        for t in range(T):
            _lane_dots(x[t], wb, P, K, L)
            for l in range(min(L, N - b * L)):
                if accumulate:
                    out[t, b * L + l] += P[8, l]
                else:
                    out[t, b * L + l] = P[8, l]


@njit(**_PAR)
def matmul_rowwise(x, W, out, T, accumulate):
    """out[t, n] (+)= sum_k x[t, k] * W[n, k] for t < T; x (rows, K), W (N, K), out (rows, N): the
    reference form of the order (one scalar dot product per element)."""
    N, K = W.shape
    # weight row outermost: each W row is read from memory once and reused for every input row
    for n in prange(N):
        wr = W[n]
        for t in range(T):
            s = _dot(x[t], wr, K)
            if accumulate:
                out[t, n] += s
            else:
                out[t, n] = s


@njit(inline="always", **_SEQ)
def _inv_rms(row, K, eps):
    return float32(1.0) / np.sqrt(_dot(row, row, K) / float32(K) + float32(eps))


@njit(**_SEQ)
def rmsnorm(x, w, out, T, eps):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w."""
    K = x.shape[1]
    for t in range(T):
        r = _inv_rms(x[t], K, eps)
        for k in range(K):
            out[t, k] = x[t, k] * r * w[k]


@njit(**_SEQ)
def norm_add(x, y, w, T, eps):
    """x[t] += y[t] / sqrt(mean(y[t]^2) + eps) * w: rmsnorm's terms (same order), then the add."""
    K = y.shape[1]
    for t in range(T):
        r = _inv_rms(y[t], K, eps)
        for k in range(K):
            x[t, k] = x[t, k] + y[t, k] * r * w[k]


@njit(**_SEQ)
def embed(table, ids, out, T):
    """out[t] = table[ids[t]]; table blocked (`block_rows`)."""
    L = table.shape[2]
    for t in range(T):
        i = ids[t]
        out[t, :] = table[i // L, :, i % L]


@njit(**_SEQ)
def swiglu(g, u, out, T):
    """out = silu(g) * u, silu(g) = g / (1 + exp(-g))."""
    F = g.shape[1]
    for t in range(T):
        for f in range(F):
            a = g[t, f]
            out[t, f] = a / (float32(1.0) + np.exp(-a)) * u[t, f]


@njit(**_SEQ)
def add(x, y, T):
    """x += y over T rows."""
    for t in range(T):
        for k in range(x.shape[1]):
            x[t, k] += y[t, k]


@njit(**_SEQ)
def rope(x, pos, T, n_heads, D, cos_t, sin_t, depth):
    """Rotate (x[i], x[i + D/2]) of every head of row t by angle p * inv_freq[i], in place, with
    p = pos + t, or p = pos + depth[t] for a tree layout (depth non-empty). cos_t / sin_t are
    (max_pos, D/2) float32 tables."""
    half = D // 2
    tree = depth.shape[0] > 0
    for t in range(T):
        p = pos + depth[t] if tree else pos + t
        for h in range(n_heads):
            base = h * D
            for i in range(half):
                c = cos_t[p, i]
                s = sin_t[p, i]
                a = x[t, base + i]
                b = x[t, base + half + i]
                x[t, base + i] = a * c - b * s
                x[t, base + half + i] = a * s + b * c


@njit(inline="always", **_SEQ)
def _slot(j, pos, t, tree, path, window, ring):
    """Cache slot of key j of row t: the row's tree path after the committed context, the ring
    slot j % ring under a window, else j."""
    if tree and j >= pos:
        return pos + path[t, j - pos]
    if window > 0:
        return j % ring
    return j


# ---------------------------------------------------------------- attention
# One module-level kernel per built-in KV codec, so that numba's disk cache (cache=True) serves it
# to every later process: a kernel built in a factory closes over its load function, and numba keys
# a closure's cache entry on the pickled closure contents -- a dispatcher pickles with a uuid drawn
# per process, so such a kernel missed the cache in every process and added a new entry (one file)
# each time. The loads live in this file beside the kernels that inline them because numba's cache
# checks the source stamp of the kernel's own file only: a kernel inlining a function of another file
# would keep its stale code when that file changed.


@njit(inline="always", **_SEQ)
def load_fp32(data, scale, zero, layer, s, h, d, lut):
    return data[layer, s, h, d]


@njit(inline="always", **_SEQ)
def load_fp16(data, scale, zero, layer, s, h, d, lut):
    return lut[data[layer, s, h, d]]


@njit(inline="always", **_SEQ)
def load_int8(data, scale, zero, layer, s, h, d, lut):
    return float32(data[layer, s, h, d]) * scale[layer, s, h]


@njit(inline="always", **_SEQ)
def load_int4(data, scale, zero, layer, s, h, d, lut):
    b = data[layer, s, h, d >> 1]
    q = (b >> ((d & 1) * 4)) & 15
    return float32(q) * scale[layer, s, h] + zero[layer, s, h]


@njit(inline="always", **_SEQ)
def _attend(load, th, q, kd, ks, kz, vd, vs, vz, layer, pos, n_heads, n_kv, D, out, scores, lut,
            depth, path, window, ring):
    """Task th = t * n_heads + h of GQA attention: out[t, head h] = softmax_j(q[t,h] . k[slot_j] /
    sqrt(D)) . v[slot_j].

    Causal (depth empty): keys j = 0 .. pos + t at slot j; with a window W > 0 only the last W
    of them, j = max(0, pos + t - W + 1) .. pos + t, at slot j % ring. Tree layout: keys j = 0
    .. pos + depth[t], slot j for j < pos (the committed context), then slot pos + path[t, j -
    pos] (the row's tree path, root first). Either way the keys reduce in j order, so a tree
    row equals the causal row of the same token sequence bit for bit.

    (kd, ks, kz) / (vd, vs, vz): a layer group's K / V codes, scales and zero points, read
    through the codec's `load` (tinyloop.cpu.kv_codecs). scores: (T*H, S) float32 scratch."""
    group = n_heads // n_kv
    scale = float32(1.0) / np.sqrt(float32(D))
    tree = depth.shape[0] > 0
    t = th // n_heads
    h = th % n_heads
    kvh = h // group
    n = pos + (depth[t] if tree else t) + 1
    j0 = n - window if window > 0 and n > window else 0
    sc = scores[th]
    m = float32(-np.inf)
    for j in range(j0, n):
        s = _slot(j, pos, t, tree, path, window, ring)
        p0 = float32(0.0); p1 = float32(0.0); p2 = float32(0.0); p3 = float32(0.0)
        d = 0
        while d + 4 <= D:
            p0 += q[t, h * D + d] * load(kd, ks, kz, layer, s, kvh, d, lut)
            p1 += q[t, h * D + d + 1] * load(kd, ks, kz, layer, s, kvh, d + 1, lut)
            p2 += q[t, h * D + d + 2] * load(kd, ks, kz, layer, s, kvh, d + 2, lut)
            p3 += q[t, h * D + d + 3] * load(kd, ks, kz, layer, s, kvh, d + 3, lut)
            d += 4
        a = (p0 + p1) + (p2 + p3)
        while d < D:
            a += q[t, h * D + d] * load(kd, ks, kz, layer, s, kvh, d, lut)
            d += 1
        a *= scale
        sc[j - j0] = a
        if a > m:
            m = a
    total = float32(0.0)
    for j in range(j0, n):
        e = np.exp(sc[j - j0] - m)
        sc[j - j0] = e
        total += e
    inv = float32(1.0) / total
    for d in range(D):
        out[t, h * D + d] = float32(0.0)
    for j in range(j0, n):
        s = _slot(j, pos, t, tree, path, window, ring)
        w = sc[j - j0] * inv
        for d in range(D):
            out[t, h * D + d] += w * load(vd, vs, vz, layer, s, kvh, d, lut)


# The kernels: attention_<codec>(q, kd, ks, kz, vd, vs, vz, layer, pos, T, n_heads, n_kv, D, out,
# scores, lut, depth, path, window, ring), each (t, h) of the T rows one task (_attend).

@njit(**_PAR)
def attention_fp32(q, kd, ks, kz, vd, vs, vz, layer, pos, T, n_heads, n_kv, D, out, scores, lut,
                   depth, path, window, ring):
    for th in prange(T * n_heads):
        _attend(load_fp32, th, q, kd, ks, kz, vd, vs, vz, layer, pos, n_heads, n_kv, D, out, scores,
                lut, depth, path, window, ring)


@njit(**_PAR)
def attention_fp16(q, kd, ks, kz, vd, vs, vz, layer, pos, T, n_heads, n_kv, D, out, scores, lut,
                   depth, path, window, ring):
    for th in prange(T * n_heads):
        _attend(load_fp16, th, q, kd, ks, kz, vd, vs, vz, layer, pos, n_heads, n_kv, D, out, scores,
                lut, depth, path, window, ring)


@njit(**_PAR)
def attention_int8(q, kd, ks, kz, vd, vs, vz, layer, pos, T, n_heads, n_kv, D, out, scores, lut,
                   depth, path, window, ring):
    for th in prange(T * n_heads):
        _attend(load_int8, th, q, kd, ks, kz, vd, vs, vz, layer, pos, n_heads, n_kv, D, out, scores,
                lut, depth, path, window, ring)


@njit(**_PAR)
def attention_int4(q, kd, ks, kz, vd, vs, vz, layer, pos, T, n_heads, n_kv, D, out, scores, lut,
                   depth, path, window, ring):
    for th in prange(T * n_heads):
        _attend(load_int4, th, q, kd, ks, kz, vd, vs, vz, layer, pos, n_heads, n_kv, D, out, scores,
                lut, depth, path, window, ring)


def _make_attention(load):
    # not cache=True: the closure's cache key would change in every process (see above), so each
    # process would compile anyway and leave one more file behind
    @njit(parallel=True, fastmath=False, cache=False, nogil=True)
    def attention(q, kd, ks, kz, vd, vs, vz, layer, pos, T, n_heads, n_kv, D, out, scores, lut, depth,
                  path, window, ring):
        for th in prange(T * n_heads):
            _attend(load, th, q, kd, ks, kz, vd, vs, vz, layer, pos, n_heads, n_kv, D, out, scores,
                    lut, depth, path, window, ring)
    return attention


_ATTENTION = {}


def attention_for(load):
    """The attention kernel reading the cache through `load` (a third-party codec's inline load
    function), compiled once per load function and process (not in numba's disk cache); the
    built-in codecs use the module-level kernels above."""
    fn = _ATTENTION.get(load)
    if fn is None:
        fn = _ATTENTION[load] = _make_attention(load)
    return fn


@njit(**_SEQ)
def topk(row, k, out):
    """out[0:k] = indices of the k largest values, best first; ties go to the lowest index (the
    order "larger value, then smaller index"); NaN never wins over a number."""
    pv = float32(np.inf)
    pi = -1
    for r in range(k):
        best = -1
        bv = float32(-np.inf)
        for i in range(row.shape[0]):
            v = row[i]
            # candidates strictly after the previous pick in the order
            if v < pv or (v == pv and i > pi):
                if best < 0 or v > bv:
                    best = i
                    bv = v
        if best < 0:      # only NaN left: the lowest index after the previous pick
            best = min(pi + 1, row.shape[0] - 1)
            bv = row[best]
        out[r] = best
        pv = bv
        pi = best


@njit(**_SEQ)
def argmax(row):
    """Index of the largest value; ties go to the lowest index."""
    best = 0
    bv = row[0]
    for i in range(1, row.shape[0]):
        if row[i] > bv:
            bv = row[i]
            best = i
    return best


@njit(**_SEQ)
def mask_logits(row, words):
    """``row[i] = -inf`` where bit (i % 32) of words[i // 32] is clear (the CUDA token_mask
    kernel's twin; int32 words, allowed entries unchanged)."""
    for i in range(row.shape[0]):
        if (words[i >> 5] >> (i & 31)) & 1 == 0:
            row[i] = -np.inf
