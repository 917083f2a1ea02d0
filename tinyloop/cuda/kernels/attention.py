"""Grouped-query attention of T query rows over one KV-cache layer, causal or tree-masked.

Causal: query row t sits at position ``p = pos[0] + t`` and attends to keys j = 0 .. p, key j in
cache slot j. Tree (speculative verify over a draft tree; `depth` non-empty): row t attends to keys
j = 0 .. pos[0] + depth[t]; key j is slot j for j < pos[0] (the committed context) and slot
``pos[0] + path[t, j - pos[0]]`` after it (the row's tree path, root first)::

    out[t, h*hd:(h+1)*hd] = sum_j softmax_j(q_h . K[slot_j, kvh] * scale) V[slot_j, kvh]
    kvh = h // (H / Hkv),  scale = 1 / sqrt(hd)

Keys are reduced in j order either way, so a tree row computes exactly what the causal row of the
same token sequence computes.

Shapes (T rows, H query heads, Hkv kv heads, hd head width <= 256, L layers, S max_seq)::

    q                 float32 (T, H * hd)
    k_cache, v_cache  float16 or float32 (L, S, Hkv, hd)
    pos               int32 (1,)        read on the device (graph-replay safe)
    depth, path       int32 (T,), (T, D+1)   tree tables; empty (0,) and (0, 1) for causal
    out               float32 (T, H * hd)

Thread mapping: one block of NT = 512 threads (16 warps; 256 under the simulator) per (row t,
head h). Slots are processed in chunks of C = NT (chunk c covers slots c*C .. c*C + C - 1, so chunk
boundaries are multiples of C from slot 0, independent of T). Per chunk:

0. thread j stages the cache slot of key c*C + j in shared memory;
1. thread j computes the score of key c*C + j (two fma chains, over the even and over the odd
   dims in ascending order, added, then times scale) into shared memory;
2. the chunk max (exact) updates the running max m;
3. thread j stores ``e_j = exp(s_j - m_new)``; the chunk sum of the e_j is a fixed-tree block sum
   (`_common.block_sum`), and the running denominator becomes ``l = fma(l, alpha, sum)`` with
   ``alpha = exp(m_old - m_new)``;
4. the threads form G = NT / 128 value groups; thread (g, d) forms ``sum_j e_j V[j, d]`` over
   slots g*C/G .. (g+1)*C/G - 1 of the chunk (j ascending, one fma chain), and group 0 adds the G
   partials in group order and updates ``acc_d = fma(acc_d, alpha, that)`` (d = gt and gt + 128).

Finally ``out = acc_d / l``. Shared memory is fixed (q, C scores, G x 256 partials, reduction
scratch: about 9 KB) whatever the context length; the only cap is hd <= 256. Every step's order
depends only on p, the cache contents, q and the build constants (NW), never on T or on the grid:
batch-invariant. Warp reductions: shuffles on the GPU, shared-memory twin under the simulator.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from ...core.errors import BackendError
from ._common import NEG_INF, SIM, block_max, block_sum, check_array, check_tree

#: Warps per block: 16 on the GPU (each chunk then covers 512 slots, so long contexts take 4x
#: fewer latency-bound chunk steps than with 128); 8 under the simulator, where every thread is a
#: Python thread. A fixed constant of the build, never derived from T.
NW = 8 if SIM else 16
NT = NW * 32
C = NT            # slots per chunk: one score per thread
GT = 128          # threads per value group; each owns output dims gt and gt + 128
G = NT // GT      # value groups: group g sums slots g*GS .. g*GS + GS - 1 of the chunk
GS = C // G
MAX_HD = 2 * GT   # two output dims per thread of a group
_JIT_OPTS = {} if SIM else {"max_registers": 128}   # 512 threads x 128 registers fit one SM


@cuda.jit(device=True)
def _score(qs, k_cache, layer, j, kvh, hd):
    """q . K[j]: even dims into a0 and odd dims into a1, each in ascending order, then a0 + a1.
    Unrolled by 8 so eight independent loads are in flight before the fma chain needs them
    (the order of the chains is unchanged by the unrolling)."""
    a0 = float32(0.0)
    a1 = float32(0.0)
    d = 0
    while d + 8 <= hd:
        k0 = float32(k_cache[layer, j, kvh, d])
        k1 = float32(k_cache[layer, j, kvh, d + 1])
        k2 = float32(k_cache[layer, j, kvh, d + 2])
        k3 = float32(k_cache[layer, j, kvh, d + 3])
        k4 = float32(k_cache[layer, j, kvh, d + 4])
        k5 = float32(k_cache[layer, j, kvh, d + 5])
        k6 = float32(k_cache[layer, j, kvh, d + 6])
        k7 = float32(k_cache[layer, j, kvh, d + 7])
        a0 = cuda.fma(qs[d], k0, a0)
        a1 = cuda.fma(qs[d + 1], k1, a1)
        a0 = cuda.fma(qs[d + 2], k2, a0)
        a1 = cuda.fma(qs[d + 3], k3, a1)
        a0 = cuda.fma(qs[d + 4], k4, a0)
        a1 = cuda.fma(qs[d + 5], k5, a1)
        a0 = cuda.fma(qs[d + 6], k6, a0)
        a1 = cuda.fma(qs[d + 7], k7, a1)
        d += 8
    while d < hd:
        a0 = cuda.fma(qs[d], float32(k_cache[layer, j, kvh, d]), a0)
        a1 = cuda.fma(qs[d + 1], float32(k_cache[layer, j, kvh, d + 1]), a1)
        d += 2
    return a0 + a1


@cuda.jit(device=True)
def _weighted_sum(sc, v_cache, layer, sl, lo, hi, kvh, d):
    """sum_{lo <= jj < hi} sc[jj] * V[sl[jj], d] as one fma chain over jj ascending, loads
    unrolled by 8 (sl: the chunk's staged cache slots)."""
    tv = float32(0.0)
    jj = lo
    while jj + 8 <= hi:
        v0 = float32(v_cache[layer, sl[jj], kvh, d])
        v1 = float32(v_cache[layer, sl[jj + 1], kvh, d])
        v2 = float32(v_cache[layer, sl[jj + 2], kvh, d])
        v3 = float32(v_cache[layer, sl[jj + 3], kvh, d])
        v4 = float32(v_cache[layer, sl[jj + 4], kvh, d])
        v5 = float32(v_cache[layer, sl[jj + 5], kvh, d])
        v6 = float32(v_cache[layer, sl[jj + 6], kvh, d])
        v7 = float32(v_cache[layer, sl[jj + 7], kvh, d])
        tv = cuda.fma(sc[jj], v0, tv)
        tv = cuda.fma(sc[jj + 1], v1, tv)
        tv = cuda.fma(sc[jj + 2], v2, tv)
        tv = cuda.fma(sc[jj + 3], v3, tv)
        tv = cuda.fma(sc[jj + 4], v4, tv)
        tv = cuda.fma(sc[jj + 5], v5, tv)
        tv = cuda.fma(sc[jj + 6], v6, tv)
        tv = cuda.fma(sc[jj + 7], v7, tv)
        jj += 8
    while jj < hi:
        tv = cuda.fma(sc[jj], float32(v_cache[layer, sl[jj], kvh, d]), tv)
        jj += 1
    return tv


@cuda.jit(**_JIT_OPTS)
def _attention_kernel(out, q, k_cache, v_cache, layer, pos, scale, depth, path):
    hd = k_cache.shape[3]
    Hk = k_cache.shape[2]
    S = k_cache.shape[1]
    H = q.shape[1] // hd
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    kvh = h // (H // Hk)
    tid = cuda.threadIdx.x
    warp = tid // 32
    lane = tid % 32
    grp = tid // GT
    gt = tid - grp * GT
    qs = cuda.shared.array(MAX_HD, float32)
    sc = cuda.shared.array(C, float32)
    sl = cuda.shared.array(C, int32)
    pv = cuda.shared.array((G, MAX_HD), float32)
    scratch = cuda.shared.array((NW, 32), float32)
    part = cuda.shared.array(NW, float32)

    for d in range(tid, hd, NT):
        qs[d] = q[t, h * hd + d]
    # q must be staged before any thread computes a score.
    cuda.syncthreads()

    p0 = pos[0]
    tree = depth.shape[0] > 0
    if tree:
        n_slots = min(p0 + depth[t] + 1, S)
    else:
        n_slots = min(p0 + t + 1, S)
    m = NEG_INF
    l = float32(0.0)
    acc0 = float32(0.0)
    acc1 = float32(0.0)
    d0 = gt
    d1 = gt + GT
    for c0 in range(0, n_slots, C):
        j = c0 + tid
        slot = j
        if tree and p0 <= j < n_slots:
            slot = p0 + path[t, j - p0]
        sl[tid] = slot
        s = NEG_INF
        if j < n_slots:
            s = _score(qs, k_cache, layer, slot, kvh, hd) * scale
        cmax = block_max(s, scratch, part, warp, lane, NW)
        m_new = max(m, cmax)
        e = float32(0.0)
        if j < n_slots:
            e = math.exp(s - m_new)
        sc[tid] = e
        # block_sum's barriers also publish every thread's sc[] and sl[] entries before the value loop.
        csum = block_sum(e, scratch, part, warp, lane, NW)
        alpha = math.exp(m - m_new)  # exp(-inf) = 0 on the first chunk
        l = cuda.fma(l, alpha, csum)
        cn = min(C, n_slots - c0)
        lo = grp * GS
        hi = min(lo + GS, cn)
        if d0 < hd:
            pv[grp, d0] = _weighted_sum(sc, v_cache, layer, sl, lo, hi, kvh, d0)
        if d1 < hd:
            pv[grp, d1] = _weighted_sum(sc, v_cache, layer, sl, lo, hi, kvh, d1)
        # Every group's partial sums must be stored before group 0 combines them.
        cuda.syncthreads()
        if grp == 0:
            if d0 < hd:
                tv = pv[0, d0]
                for g in range(1, G):
                    tv += pv[g, d0]
                acc0 = cuda.fma(acc0, alpha, tv)
            if d1 < hd:
                tv = pv[0, d1]
                for g in range(1, G):
                    tv += pv[g, d1]
                acc1 = cuda.fma(acc1, alpha, tv)
        m = m_new
        # sc[], sl[] and pv[] must be fully read before the next chunk overwrites them.
        cuda.syncthreads()

    if grp == 0:
        if d0 < hd:
            out[t, h * hd + d0] = acc0 / l
        if d1 < hd:
            out[t, h * hd + d1] = acc1 / l


def attention(out, q, k_cache, v_cache, layer, pos, stream=0, depth=None, path=None):
    """GQA attention of q (T, H*hd) over cache layer `layer`; writes out (T, H*hd). Causal (rows at
    positions pos[0] + t over slots 0 .. pos[0] + t) unless the tree tables `depth` (T,) and `path`
    (T, D+1) are given (see the module doc). hd and Hkv come from the cache shape; H from q. The
    host keeps every slot read below S (slots past S are not read)."""
    op = "attention"
    check_array(op, "k_cache", k_cache, (np.float16, np.float32), 4)
    L, S, Hk, hd = k_cache.shape
    check_array(op, "v_cache", v_cache, k_cache.dtype, 4, (L, S, Hk, hd))
    if hd == 0 or hd % 2 or hd > MAX_HD:
        raise BackendError(f"{op}: head_dim={hd} must be even and at most {MAX_HD}")
    if Hk == 0 or S == 0:
        raise BackendError(f"{op}: empty cache shape {tuple(k_cache.shape)}")
    check_array(op, "q", q, np.float32, 2)
    T = q.shape[0]
    if q.shape[1] == 0 or q.shape[1] % hd:
        raise BackendError(f"{op}: q width {q.shape[1]} is not a positive multiple of "
                           f"head_dim={hd}")
    H = q.shape[1] // hd
    if H % Hk:
        raise BackendError(f"{op}: n_kv_heads={Hk} must divide n_heads={H}")
    check_array(op, "out", out, np.float32, 2, tuple(q.shape))
    check_array(op, "pos", pos, np.int32, 1, (1,))
    layer = int(layer)
    if not 0 <= layer < L:
        raise BackendError(f"{op}: layer={layer} is outside [0, {L})")
    if T > S:
        raise BackendError(f"{op}: {T} rows do not fit a cache of {S} slots")
    depth, path = check_tree(op, depth, path, T)
    if T == 0:
        return
    scale = np.float32(1.0 / math.sqrt(hd))
    _attention_kernel[(T, H), NT, stream](out, q, k_cache, v_cache, layer, pos, scale, depth, path)


def ptx_signatures():
    m = "float32[:, ::1]"
    sigs = []
    for ct in ("float16", "float32"):
        c = f"{ct}[:, :, :, ::1]"
        sigs.append((f"attention_{ct}", _attention_kernel.py_func,
                     f"void({m}, {m}, {c}, {c}, int64, int32[::1], float32, int32[::1], int32[:, ::1])"))
    return sigs
