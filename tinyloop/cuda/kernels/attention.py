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

Thread mapping: one block of NT = 512 threads (16 warps; 128 threads / 4 warps under the
simulator) per (row t, head h). Keys are processed in chunks of C = 32 * NW (chunk c covers keys
c*C .. c*C + C - 1, boundaries at multiples of C from key 0, independent of T). Within a chunk, key
jj belongs to warp ``jj % NW`` (its ``jj // NW``-th key), so a short context still spreads over
every warp. Per chunk:

1. scores: a warp scores its keys U at a time (the U keys' loads are issued together); for one key
   lane l forms ``fma`` chains over dims l, l+32, ... ascending (coalesced cache reads: the 32 lanes
   read consecutive dims), the 32 lane partials are added by the xor butterfly
   (`_common.warp_sum`) and the total times scale is the score, kept by the lane whose index is the
   key's rank in the warp (with its cache slot);
2. the chunk max (exact) updates the running max m;
3. each lane stores ``e = exp(s - m_new)`` and its slot in shared memory; the chunk sum of the e is
   a fixed-tree block sum (`_common.block_sum`: butterflies, warps in order), and the running
   denominator becomes ``l = fma(l, alpha, sum)`` with ``alpha = exp(m_old - m_new)``;
4. values: warp w forms ``sum e_j V[slot_j, d]`` over its keys (ascending, one fma chain per dim,
   lane l owning dims l, l+32, ...; U keys' loads in flight together), stores the partials, and
   thread d adds the NW warp partials in warp order and updates ``acc_d = fma(acc_d, alpha, that)``.

Finally ``out = acc_d / l``. Shared memory is fixed (C scores and slots, NW x 256 partials,
reduction scratch: about 22 KB) whatever the context length; the only cap is hd <= 256. Every step's
order depends only on the row's position, the cache contents, q and the build constants (NW, U),
never on T or on the grid: batch-invariant. Every warp runs the same number of score steps (the
butterflies stay in uniform control flow; a warp with fewer keys scores slot 0 and drops it). Warp
reductions: shuffles on the GPU, shared-memory twin under the simulator. The kernel is compiled
per ND = ceil(hd / 32) (dims per lane), so the per-lane arrays stay in registers.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint64

from ...core.errors import BackendError
from ._common import NEG_INF, SIM, block_max, block_sum, check_array, check_tree, warp_sum

#: Warps per block: 16 on the GPU; 4 under the simulator, where every thread is a Python thread.
#: A fixed constant of the build, never derived from T.
NW = 4 if SIM else 16
NT = NW * 32
C = NT            # keys per chunk: one per lane
#: Keys a warp handles per step (their cache loads in flight together). It only decides when loads
#: are issued, not the arithmetic (each key's score is its own reduction; values are added in key
#: order either way), so the simulator takes one key per step.
U = 1 if SIM else 4
MAX_HD = min(256, NT)   # thread d < hd of the block owns output dim d (128 under the simulator)
_JIT_OPTS = {} if SIM else {"max_registers": 128}   # 512 threads x 128 registers fit one SM

_kernels = {}


def _make_kernel(nd):
    """The attention kernel for head widths with nd = ceil(hd / 32) dims per lane."""
    if nd in _kernels:
        return _kernels[nd]

    @cuda.jit(device=True)
    def slot_of(j, p0, t, tree, path):
        """Cache slot of key j of row t (causal: j; tree: the row's path after the context)."""
        if tree and j >= p0:
            return p0 + path[t, j - p0]
        return j

    @cuda.jit(device=True)
    def load_row(cf, off, rows, u, lane, hd):
        """rows[u, k] <- the lane's dims lane + 32 k of the cache row at flat offset `off` (0 past
        hd); the 32 lanes read consecutive dims."""
        o = off + uint64(lane)
        for k in range(nd):
            rows[u, k] = float32(cf[o + uint64(32 * k)]) if lane + 32 * k < hd else float32(0.0)

    @cuda.jit(**_JIT_OPTS)
    def kernel(out, q, kf, vf, S, Hk, hd, layer, pos, scale, depth, path):
        H = q.shape[1] // hd
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        kvh = h // (H // Hk)
        # Flat cache offsets in unsigned arithmetic (no negative-index wrap-around per load):
        # element (layer, slot, kvh, d) is at base + slot * row + d.
        row = uint64(Hk * hd)
        base = uint64(layer) * uint64(S) * row + uint64(kvh * hd)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        sc = cuda.shared.array(C, float32)
        sl = cuda.shared.array(C, int32)
        pv = cuda.shared.array((NW, MAX_HD), float32)
        scratch = cuda.shared.array((NW, 32), float32)
        part = cuda.shared.array(NW, float32)
        qv = cuda.local.array(nd, float32)
        kv = cuda.local.array((U, nd), float32)
        ks = cuda.local.array(U, int32)
        ke = cuda.local.array(U, float32)
        tv = cuda.local.array(nd, float32)
        for k in range(nd):
            d = lane + 32 * k
            qv[k] = q[t, h * hd + d] if d < hd else float32(0.0)

        p0 = pos[0]
        tree = depth.shape[0] > 0
        if tree:
            n_slots = min(p0 + depth[t] + 1, S)
        else:
            n_slots = min(p0 + t + 1, S)
        m = NEG_INF
        l = float32(0.0)
        acc = float32(0.0)
        for c0 in range(0, n_slots, C):
            cn = min(C, n_slots - c0)
            n_step = (cn + NW - 1) // NW        # keys of warp 0: the same loop count in every warp
            n_mine = (cn - warp + NW - 1) // NW  # keys of this warp
            s_mine = NEG_INF
            slot_mine = 0
            # 1. scores, U keys at a time
            for i0 in range(0, n_step, U):
                for u in range(U):
                    i = i0 + u
                    slot = 0
                    if i < n_mine:
                        slot = slot_of(c0 + warp + NW * i, p0, t, tree, path)
                    ks[u] = slot
                    load_row(kf, base + uint64(slot) * row, kv, u, lane, hd)
                for u in range(U):
                    pp = float32(0.0)
                    for k in range(nd):
                        pp = cuda.fma(qv[k], kv[u, k], pp)
                    tot = warp_sum(pp, scratch, warp, lane)
                    if lane == i0 + u and i0 + u < n_mine:
                        s_mine = tot * scale
                        slot_mine = ks[u]
            # 2. running max
            cmax = block_max(s_mine, scratch, part, warp, lane, NW)
            m_new = max(m, cmax)
            # 3. weights and their sum
            e = float32(0.0)
            if lane < n_mine:
                e = math.exp(s_mine - m_new)
            sc[warp + NW * lane] = e
            sl[warp + NW * lane] = slot_mine
            # block_sum's barriers also publish every lane's sc[] and sl[] entries.
            csum = block_sum(e, scratch, part, warp, lane, NW)
            alpha = math.exp(m - m_new)  # exp(-inf) = 0 on the first chunk
            l = cuda.fma(l, alpha, csum)
            # 4. values, U keys at a time
            for k in range(nd):
                tv[k] = float32(0.0)
            for i0 in range(0, n_mine, U):
                for u in range(U):
                    i = i0 + u
                    slot = 0
                    ew = float32(0.0)
                    if i < n_mine:
                        slot = sl[warp + NW * i]
                        ew = sc[warp + NW * i]
                    ke[u] = ew
                    load_row(vf, base + uint64(slot) * row, kv, u, lane, hd)
                for u in range(U):
                    if i0 + u < n_mine:
                        for k in range(nd):
                            tv[k] = cuda.fma(ke[u], kv[u, k], tv[k])
            for k in range(nd):
                d = lane + 32 * k
                if d < hd:
                    pv[warp, d] = tv[k]
            # Every warp's partials must be stored before thread d adds them up.
            cuda.syncthreads()
            if tid < hd:
                tvs = pv[0, tid]
                for w in range(1, NW):
                    tvs += pv[w, tid]
                acc = cuda.fma(acc, alpha, tvs)
            m = m_new
            # sc[], sl[] and pv[] must be fully read before the next chunk overwrites them.
            cuda.syncthreads()

        if tid < hd:
            out[t, h * hd + tid] = acc / l

    _kernels[nd] = kernel
    return kernel


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
    n = L * S * Hk * hd
    _make_kernel((hd + 31) // 32)[(T, H), NT, stream](out, q, k_cache.reshape(n), v_cache.reshape(n), S, Hk,
                                                      hd, layer, pos, scale, depth, path)


def ptx_signatures():
    m = "float32[:, ::1]"
    sigs = []
    for ct, nds in (("float16", (1, 2, 4, 8)), ("float32", (4,))):
        c = f"{ct}[::1]"
        for nd in nds:
            sigs.append((f"attention_{ct}_nd{nd}", _make_kernel(nd).py_func,
                         f"void({m}, {m}, {c}, {c}, int64, int64, int64, int64, int32[::1], float32, int32[::1], "
                         "int32[:, ::1])"))
    return sigs
