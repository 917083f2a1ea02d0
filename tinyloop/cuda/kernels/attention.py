"""Grouped-query attention of T query rows over one KV-cache layer, causal, windowed (a ring of
slots) or tree-masked, with the keys of each row split over Z blocks ("flash decoding"), reading
the cache through its codec.

Causal: query row t sits at position ``p = pos[0] + t`` and attends to keys j = 0 .. p, key j in
cache slot j. Ring (``window`` W > 0, the cache's slot map ``SlotMap(S, W)``): row t attends to
the positions j0 .. p, ``j0 = max(0, p - W + 1)``, key i of the row being position j0 + i in slot
``(j0 + i) % S``; positions, and with them RoPE, stay absolute, so p may be far past S. Tree
(speculative verify over a draft tree; `depth` non-empty; linear caches only): row t attends to
keys j = 0 .. pos[0] + depth[t]; key j is slot j for j < pos[0] (the committed context) and slot
``pos[0] + path[t, j - pos[0]]`` after it (the row's tree path, root first)::

    out[t, h*hd:(h+1)*hd] = sum_j softmax_j(q_h . K[slot_j, kvh] * scale) V[slot_j, kvh]
    kvh = h // (H / Hkv),  scale = 1 / sqrt(hd)

Keys are reduced by key index (position order) in every layout (only the slot a key is read from
differs), so a tree row computes exactly what the causal row of the same token sequence computes.

Codecs (tinyloop/cuda/kv_codecs.py). The kernel is compiled per (ND, codec, ring); the codec's
``row_params`` reads a key or value row's scale and zero point once and its ``elem`` decodes one
dim (fp32 / fp16: a cast, the arithmetic of the float-only kernel; int8 ``code * scale``; int4
``q * scale + zero`` from a nibble). A decoded row enters the same fma chains as a float row.

Shapes (T rows, H query heads, Hkv kv heads, hd head width <= MAX_HD, L layers, S slots,
cols = hd / pack of the codec)::

    q                 float32 (T, H * hd)
    k_cache, v_cache  the codec's data (L, S, Hkv, cols): float32 / float16 (L, S, Hkv, hd),
                      int8 (L, S, Hkv, hd), int4 uint8 (L, S, Hkv, hd / 2); a bare array or a
                      kv_codecs.Rows(data, scale, zero) with scale / zero float32 (L, S, Hkv)
    pos               int32 (1,)        read on the device (graph-replay safe)
    depth, path       int32 (T,), (T, D+1)   tree tables; empty (0,) and (0, 1) for causal
    work              float32 (>= T * H * Z * (hd + 2),)   per-split partials (`workspace_shape`)
    counter           int32 (>= T * H,)   arrival counts, zero before the first launch
                                          (`counter_shape`); every launch leaves them zero
    out               float32 (T, H * hd)

Build constants (fixed per build, never derived from T or the grid)::

              GPU  simulator
    NW          8     4       warps per block (NT = 32 * NW threads)
    CK         32     8       keys per chunk (CK / NW = 4 resp. 2 keys per warp and chunk)
    Z           8     2       blocks (splits) per (row, head)
    U           4     1       keys per score / value step (their cache loads in flight together)

Splits. Row t's n keys (n = pos[0] + t + 1 causal, pos[0] + depth[t] + 1 tree, at most S;
p - j0 + 1 <= W ring) are cut into chunks of CK keys from the row's first key (key 0, or position j0
of a ring): chunk c holds the row's keys c*CK .. min(c*CK + CK, n) - 1. The grid is
(T, H, Z); block (t, h, z) takes chunks z, z + Z, z + 2Z, ... in ascending order and runs the
online softmax below over them, ending with a running max m_z, denominator l_z and unnormalised
output acc_z[0:hd] (m_z = -inf, l_z = 0, acc_z = 0 for a block without chunks).

Thread mapping within a block. Key jj of a chunk belongs to warp ``jj % NW`` as its
``(jj // NW)``-th key, so even a short chunk spreads over every warp. Per chunk:

1. scores: a warp scores its keys U at a time (the U keys' loads are issued together, and with
   them the same keys' value rows, which stay in registers for step 4; on a linear cache a causal
   row's first chunk, z, has its rows requested before pos[0] is read, at slots clamped to S - 1:
   a ring's first slot depends on the position, so it waits); for one key
   lane l forms ``fma`` chains over dims l, l+32, ... ascending (coalesced cache reads: the 32 lanes
   read consecutive dims), the 32 lane partials are added by the xor butterfly
   (`_common.warp_sum`) and the total times scale is the score, kept by the lane whose index is the
   key's rank in the warp;
2. the chunk max (exact: warp butterflies of max, then the NW warp maxima) updates the running max:
   ``m_new = max(m, chunk max)``;
3. each key's ``e = exp(s - m_new)`` goes to shared memory; the chunk sum of the e is the
   warp butterfly sums added in warp order 0, 1, ..., NW-1 (as `_common.block_sum`), and the
   running denominator becomes ``l = fma(l, alpha, sum)`` with ``alpha = exp(m - m_new)`` (0 on
   the block's first chunk);
4. values: warp w forms ``sum e_j V[slot_j, d]`` over its keys of the chunk (ascending, one fma
   chain per dim from 0, lane l owning dims l, l+32, ...; the rows loaded in step 1),
   stores the partials, and thread d adds the NW warp partials in warp order and updates
   ``acc_d = fma(acc_d, alpha, that)``.

Three barriers per chunk (after the warp maxima, after the warp sums and e stores, after the
value partials); each shared array is rewritten only past a barrier that every reader of its
previous contents has reached. Every warp runs KPW / U score steps (the butterflies stay in
uniform control flow; a warp with fewer keys scores slot 0 and drops it).

Combine ("last block"). Every block, empty or not, writes its record (m_z, l_z, acc_z[0:hd]) to
`work` at ``((t*H + h)*Z + z) * (hd + 2)`` (m, l, then acc); every writing thread (tid < hd)
executes a device-wide memory fence (`cuda.threadfence`), and after a barrier thread 0 adds 1 to
``counter[t*H + h]`` atomically. The block whose thread 0 reads back Z - 1 arrived last (which z that is varies between
launches); that thread fences, a barrier shares the verdict, and every thread of that block
fences and reads the Z records from `work` (its own included), combining them in z order::

    M     = max(m_0, ..., m_(Z-1))                  exact
    w_z   = exp(m_z - M)                            0 for a block without keys
    l     = 0;  for z = 0 .. Z-1:  l     = fma(l_z, w_z, l)
    acc_d = 0;  for z = 0 .. Z-1:  acc_d = fma(acc_z[d], w_z, acc_d)
    out[t, h*hd + d] = acc_d / l

Its thread 0 then resets ``counter[t*H + h]`` to 0, so the next launch (a CUDA-graph replay
included) counts from zero again. The counters must therefore be zero before the first launch (allocate them
zeroed, once) and a workspace serves one launch at a time (launches on one stream are ordered). A
launch that dies part-way leaves its counters non-zero: zero them again before reusing them.

The rows form (launches of at least ROWS_T rows: prefill chunks, whose T x H blocks need no
split for parallelism): grid (T, H), block (t, h) runs splits z = 0 .. Z-1 one after the other
(each exactly as block (t, h, z) would, from a fresh m, l, acc), keeps the Z records in shared
memory and combines them in z order as above, without `work`, fences or `counter`: the same
arithmetic, so a row's bits do not depend on which form ran it.

Determinism and batch invariance: chunk boundaries, which block takes a chunk, every step of a
block's reduction and the combine order depend only on the row's position (its first key and key
count, from pos[0], the window and the tree tables), the cache contents, q and the build constants
(CK, NW, Z, U), never on T, on the
grid's other dimensions or on which block arrives last; a row of a T-row launch is bit-identical
to the same row launched alone. Warp reductions: shuffles on the GPU, shared-memory twin under the
simulator (same butterfly). Shared memory is fixed (CK weights, NW x MAX_HD partials,
reduction scratch: about 9 KB on the GPU) whatever the context length. The kernel is compiled per
ND = ceil(hd / 32) (dims per lane), so the per-lane arrays stay in registers. Cache codes are
addressed through flat views with unsigned offsets (base + slot * row + d, in codes of the codec's
dtype), a row's scale and zero at ((layer * S + slot) * Hkv + kvh).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint64

from ...errors import BackendError
from ..kv_codecs import FP16, FP32, INT4, INT8, as_rows, codec_for
from ._cache import jit_kernel
from ._common import (NEG_INF, SIM, block_max_once, block_sum_once, check_array, check_tree,
                      check_workspace, warp_sum)
from ._pdl import grid_dep_wait

#: Warps per block: 8 on the GPU; 4 under the simulator, where every thread is a Python thread.
#: (H200, 360m decode step, attention us per token: NW 16 / CK 64: 86; NW 8 / CK 32: 78;
#: NW 16 / CK 32: 79; NW 8 / CK 32 / Z 16: 94.)
NW = 4 if SIM else 8
NT = NW * 32
#: Keys per chunk. Each warp takes CK / NW keys of a chunk, and lane i holds the score of the
#: warp's i-th key, so CK / NW <= 32. On the GPU one chunk is one U-step per warp; the simulator
#: keeps chunks small so that tests reach several chunks per split with few keys.
CK = 8 if SIM else 32
KPW = CK // NW
#: Blocks (splits) per (row, head): the grid is (T, H, Z). 8 puts 128 blocks on the GPU for a
#: 16-head one-token decode step (the H200 has 132 SMs).
Z = 2 if SIM else 8
#: Keys a warp handles per step (their key and value loads in flight together; KPW % U == 0). It
#: only decides when loads are issued, not the arithmetic (each key's score is its own reduction;
#: values are added in key order either way), so the simulator takes one key per step.
U = 1 if SIM else 4
MAX_HD = min(256, NT)   # thread d < hd of the block owns output dim d (128 under the simulator)
REC = 2                 # floats ahead of acc in a split's record: m, l
_JIT_OPTS = {} if SIM else {"max_registers": 128}   # 256 threads x 128 registers: 2 blocks per SM

assert CK % NW == 0 and 0 < KPW <= 32 and KPW % U == 0, (CK, NW, U)
#: Launches of at least this many rows take the rows form (grid (T, H): a block runs its row's Z
#: splits one after the other and combines them itself); fewer rows keep the splits in Z
#: blocks, whose parallelism a short launch needs. The same bits either way.
ROWS_T = 64

_kernels = {}


@cuda.jit(device=True, inline=True)
def _combine(out, rec, r0, rl, t, h, hd, tid):
    """Out row t, head h from the Z split records at rec[r0 + z * rl] (m, l, acc[0:hd]), in z order
    (the module doc's combine): the last block reads them from `work`, the rows form from shared
    memory."""
    mx = rec[r0]
    for zz in range(1, Z):
        mx = max(mx, rec[r0 + zz * rl])
    if tid < hd:
        ls = float32(0.0)
        a = float32(0.0)
        for zz in range(Z):
            r = r0 + zz * rl
            wz = math.exp(rec[r] - mx)
            ls = cuda.fma(rec[r + 1], wz, ls)
            a = cuda.fma(rec[r + REC + tid], wz, a)
        out[t, h * hd + tid] = a / ls


def _make_kernel(nd, codec=FP16, ring=False, seq=False):
    """The attention kernel for head widths with nd = ceil(hd / 32) dims per lane, cache rows
    decoded by `codec` (a kv_codecs.CUDAKVCodec), over a ring of slots when `ring`; `seq`: the
    rows form (grid (T, H); each block runs the Z splits one after the other and combines their
    records from shared memory, no workspace, no arrival count), the same arithmetic for every row."""
    key = (nd, codec, bool(ring), bool(seq))
    if key in _kernels:
        return _kernels[key]
    RING = bool(ring)
    SEQ = bool(seq)
    ZS = Z if SEQ else 1              # splits a block runs
    ZR = Z * (MAX_HD + REC) if SEQ else 1   # the rows form's split records, in shared memory
    PACK = codec.pack
    row_params = codec.row_params
    lane_offset = codec.lane_offset
    elem = codec.elem

    @cuda.jit(device=True)
    def slot_of(j, p0, t, tree, path, s0, S):
        """Cache slot of key j of row t: causal j; tree: the row's path after the context; ring:
        position j0 + j at (j0 + j) % S = s0 + j wrapped once (s0 = j0 % S, j < W <= S)."""
        if RING:
            s = s0 + j
            if s >= S:
                s -= S
            return s
        if tree and j >= p0:
            return p0 + path[t, j - p0]
        return j

    @cuda.jit(device=True)
    def load_row(cf, sf, zf, off, srow, rows, u, lane, hd):
        """rows[u, k] <- the lane's dims lane + 32 k of the cache row whose codes start at flat
        offset `off` (scale / zero row `srow`), decoded (0 past hd); the 32 lanes read
        consecutive dims."""
        s, zp = row_params(sf, zf, srow)
        o = lane_offset(off, lane)
        for k in range(nd):
            rows[u, k] = elem(cf, o, k, lane, s, zp) if lane + 32 * k < hd else float32(0.0)

    @jit_kernel(**_JIT_OPTS)
    def kernel(out, q, kf, ks, kz, vf, vs, vz, S, Hk, hd, layer, pos, scale, W, depth, path, work,
               counter):
        grid_dep_wait()
        H = q.shape[1] // hd
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        kvh = h // (H // Hk)
        # Flat cache offsets in unsigned arithmetic (no negative-index wrap-around per load):
        # code (layer, slot, kvh, c) is at base + slot * row + c, the row's scale and zero at
        # sbase + slot * Hk.
        cols = hd // PACK
        row = uint64(Hk * cols)
        base = uint64(layer) * uint64(S) * row + uint64(kvh * cols)
        uhk = uint64(Hk)
        sbase = uint64(layer) * uint64(S) * uhk + uint64(kvh)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        sc = cuda.shared.array(CK, float32)
        pv = cuda.shared.array((NW, MAX_HD), float32)
        scratch = cuda.shared.array((NW, 32), float32)
        pmax = cuda.shared.array(NW, float32)
        psum = cuda.shared.array(NW, float32)
        is_last = cuda.shared.array(1, int32)
        qv = cuda.local.array(nd, float32)
        kk = cuda.local.array((KPW, nd), float32)
        vv = cuda.local.array((KPW, nd), float32)
        tv = cuda.local.array(nd, float32)
        srec = cuda.shared.array(ZR, float32)   # the rows form's records, laid out as in `work`
        for k in range(nd):
            d = lane + 32 * k
            qv[k] = q[t, h * hd + d] if d < hd else float32(0.0)

        tree = depth.shape[0] > 0
        # Causal rows of a linear cache: the first chunk's key and value rows are requested before
        # pos[0] has arrived (their slots do not depend on it; clamped into the cache, a row past
        # the key count is loaded but never used). A ring's slots depend on the position.
        ahead = not tree and not RING
        for zi in range(ZS):
            z = zi if SEQ else cuda.blockIdx.z
            if ahead:
                for i in range(KPW):
                    slot = uint64(min(z * CK + warp + NW * i, S - 1))
                    load_row(kf, ks, kz, base + slot * row, sbase + slot * uhk, kk, i, lane, hd)
                    load_row(vf, vs, vz, base + slot * row, sbase + slot * uhk, vv, i, lane, hd)
            p0 = pos[0]
            s0 = 0
            if RING:
                pt = p0 + t
                j0 = max(0, pt - W + 1)
                n_slots = pt - j0 + 1
                s0 = j0 % S
            elif tree:
                n_slots = min(p0 + depth[t] + 1, S)
            else:
                n_slots = min(p0 + t + 1, S)
            m = NEG_INF
            l = float32(0.0)
            acc = float32(0.0)
            for c in range(z, (n_slots + CK - 1) // CK, Z):
                c0 = c * CK
                cn = min(CK, n_slots - c0)
                n_mine = (cn - warp + NW - 1) // NW  # keys of this warp
                s_mine = NEG_INF
                # 1. scores, U keys at a time; the same keys' value rows are requested with their key
                # rows (step 4 reads them from registers), unless they came ahead. Every warp runs the
                # KPW / U steps (the butterflies stay in uniform control flow); a key past n_mine
                # reads slot 0, unused.
                for i0 in range(0, KPW, U):
                    if not (ahead and c == z):
                        for u in range(U):
                            i = i0 + u
                            slot = 0
                            if i < n_mine:
                                slot = slot_of(c0 + warp + NW * i, p0, t, tree, path, s0, S)
                            off = base + uint64(slot) * row
                            srow = sbase + uint64(slot) * uhk
                            load_row(kf, ks, kz, off, srow, kk, i, lane, hd)
                            load_row(vf, vs, vz, off, srow, vv, i, lane, hd)
                    for u in range(U):
                        pp = float32(0.0)
                        for k in range(nd):
                            pp = cuda.fma(qv[k], kk[i0 + u, k], pp)
                        tot = warp_sum(pp, scratch, warp, lane)
                        if lane == i0 + u and i0 + u < n_mine:
                            s_mine = tot * scale
                # 2. running max
                m_new = max(m, block_max_once(s_mine, scratch, pmax, warp, lane, NW))
                # 3. weights and their sum
                e = float32(0.0)
                if lane < n_mine:
                    e = math.exp(s_mine - m_new)
                if lane < KPW:
                    sc[warp + NW * lane] = e
                # (the barrier inside also publishes every lane's sc[] entries)
                csum = block_sum_once(e, scratch, psum, warp, lane, NW)
                alpha = math.exp(m - m_new)  # exp(-inf) = 0 on the block's first chunk
                l = cuda.fma(l, alpha, csum)
                # 4. values: the warp's keys in order, from the rows loaded in step 1
                for k in range(nd):
                    tv[k] = float32(0.0)
                for i in range(KPW):
                    if i < n_mine:
                        ew = sc[warp + NW * i]
                        for k in range(nd):
                            tv[k] = cuda.fma(ew, vv[i, k], tv[k])
                for k in range(nd):
                    d = lane + 32 * k
                    if d < hd:
                        pv[warp, d] = tv[k]
                # Every warp's partials must be stored before thread d adds them up. (No barrier at the
                # chunk's end: the next chunk writes pmax after this barrier, sc/psum after its
                # first and pv after its second, when every thread is done reading the old values.)
                cuda.syncthreads()
                if tid < hd:
                    tvs = pv[0, tid]
                    for w in range(1, NW):
                        tvs += pv[w, tid]
                    acc = cuda.fma(acc, alpha, tvs)
                m = m_new

            if SEQ:
                if tid == 0:              # m and l are the same in every thread
                    srec[zi * (hd + REC)] = m
                    srec[zi * (hd + REC) + 1] = l
                if tid < hd:
                    srec[zi * (hd + REC) + REC + tid] = acc

        if SEQ:
            # the last-block combine below, on the block's own records
            cuda.syncthreads()
            _combine(out, srec, 0, hd + REC, t, h, hd, tid)
            return

        # Combine: publish this split's record, count the arrival; the last block adds them up.
        th = t * H + h
        rl = hd + REC
        rec = (th * Z + z) * rl
        if tid == 0:
            work[rec] = m
            work[rec + 1] = l
        if tid < hd:
            work[rec + REC + tid] = acc
        # Release: every writer's part of the record (threads tid < hd, thread 0 included) is
        # visible device-wide before the barrier, and so before the arrival is counted.
        if tid < hd:
            cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            last = cuda.atomic.add(counter, th, 1) == Z - 1
            if last:
                cuda.threadfence()   # acquire: the Z - 1 counts seen, their records after them
            is_last[0] = 1 if last else 0
        # is_last must be stored before the block reads it.
        cuda.syncthreads()
        if is_last[0] != 0:
            # Every reading thread fences too (the records are read through its own loads).
            cuda.threadfence()
            _combine(out, work, th * Z * rl, rl, t, h, hd, tid)
            if tid == 0:
                counter[th] = 0

    _kernels[key] = kernel
    return kernel


def workspace_shape(T: int, H: int, hd: int) -> tuple:
    """Shape of the float32 `work` array a launch of T rows, H heads of width hd needs (a larger
    one is fine: a launch uses its first entries)."""
    return (T * H * Z * (hd + REC),)


def counter_shape(T: int, H: int) -> tuple:
    """Shape of the int32 `counter` array a launch of T rows and H heads needs (allocate it zeroed,
    once; launches leave it zero)."""
    return (T * H,)


def _check_params(op, name, rows, codec, shape):
    """The scale / zero arrays of K or V as `codec` stores them (flat views, or None)."""
    flat = []
    for what, has, a in (("scale", codec.has_scale, rows.scale), ("zero", codec.has_zero, rows.zero)):
        if not has:
            if a is not None:
                raise BackendError(f"{op}: {name}_{what} given for the {codec.name} codec, which has none")
            flat.append(None)
            continue
        check_array(op, f"{name}_{what}", a, np.float32, 3, shape)
        flat.append(a.reshape(int(np.prod(shape))))
    return flat


def attention(out, q, k_cache, v_cache, layer, pos, work, counter, stream=0, depth=None, path=None,
              codec=None, window=0):
    """GQA attention of q (T, H*hd) over cache layer `layer`; writes out (T, H*hd). Causal (rows at
    positions pos[0] + t over slots 0 .. pos[0] + t) unless the tree tables `depth` (T,) and `path`
    (T, D+1) are given, or over the last `window` positions in a ring of the cache's S slots when
    window > 0 (see the module doc; trees need a linear cache). `k_cache` / `v_cache` are the
    codec's data arrays, or kv_codecs.Rows with their scale / zero; `codec` (a
    kv_codecs.CUDAKVCodec) defaults to the built-in one of the data's dtype. hd and Hkv come from
    the cache shape; H from q. `work` (float32, at least `workspace_shape(T, H, hd)`) and
    `counter` (int32, at least `counter_shape(T, H)`, zero before the first launch) are the split
    workspace; one launch at a time may use them. The caller keeps every slot a row reads below
    S: the key count is clamped to S, but a tree path's slots ``pos[0] + path[t, j]`` are not
    checked on the device; with a ring, no launch may overwrite a slot one of its rows still
    reads (S >= window + T - 1, or no position of the request past S - 1)."""
    op = "attention"
    kr, vr = as_rows(k_cache), as_rows(v_cache)
    if kr.data is None:
        raise BackendError(f"{op}: k_cache is required")
    cdc = codec_for(kr.data, codec)
    if cdc is None:
        raise BackendError(f"{op}: no built-in KV codec stores {np.dtype(kr.data.dtype).name} codes; "
                           f"pass codec=")
    check_array(op, "k_cache", kr.data, cdc.dtype, 4)
    L, S, Hk, cols = kr.data.shape
    hd = cols * cdc.pack
    check_array(op, "v_cache", vr.data, cdc.dtype, 4, (L, S, Hk, cols))
    if hd == 0 or hd % 2 or hd > MAX_HD:
        raise BackendError(f"{op}: head_dim={hd} must be even and at most {MAX_HD}")
    if Hk == 0 or S == 0:
        raise BackendError(f"{op}: empty cache shape {tuple(kr.data.shape)}")
    ks, kz = _check_params(op, "k", kr, cdc, (L, S, Hk))
    vs, vz = _check_params(op, "v", vr, cdc, (L, S, Hk))
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
    window = int(window)
    if not 0 <= window <= S:
        raise BackendError(f"{op}: window={window} is outside [0, {S}] (a ring of {S} slots)")
    depth, path = check_tree(op, depth, path, T)
    if window and depth.shape[0] > 0:
        raise BackendError(f"{op}: a draft tree's rows cannot attend over a ring (window={window}); "
                           f"trees need a linear cache")
    check_workspace(op, "work", work, np.float32, workspace_shape(T, H, hd)[0],
                    f"{T} rows x {H} heads of head_dim={hd} (workspace_shape)")
    check_workspace(op, "counter", counter, np.int32, counter_shape(T, H)[0],
                    f"{T} rows x {H} heads (counter_shape)")
    if T == 0:
        return
    scale = np.float32(1.0 / math.sqrt(hd))
    n = L * S * Hk * cols
    # codecs without a scale or zero point never read those arguments: `work` stands in
    ks, kz, vs, vz = (work if a is None else a for a in (ks, kz, vs, vz))
    seq = T >= ROWS_T
    _make_kernel((hd + 31) // 32, cdc, window > 0, seq)[(T, H, 1 if seq else Z), NT, stream](
        out, q, kr.data.reshape(n), ks, kz, vr.data.reshape(n), vs, vz, S, Hk, hd, layer, pos, scale,
        window, depth, path, work, counter)


#: (codec, head widths' ND) of the compiled variants listed for the PTX tests, each linear and ring
PTX_VARIANTS = ((FP16, (1, 2, 4, 8)), (FP32, (4,)), (INT8, (2, 4)), (INT4, (2, 4)))


def ptx_signatures():
    m = "float32[:, ::1]"
    f = "float32[::1]"
    sigs = []
    for codec, nds in PTX_VARIANTS:
        c = f"{np.dtype(codec.dtype).name}[::1]"
        for ring, seq in ((False, False), (True, False), (False, True), (True, True)):
            if seq and nds != PTX_VARIANTS[0][1] and codec is not INT4:
                continue                         # the rows form: fp16 and int4, every head width
            for nd in nds:
                sigs.append((f"attention_{codec.name}_nd{nd}{'_ring' if ring else ''}{'_rows' if seq else ''}",
                             _make_kernel(nd, codec, ring, seq).py_func,
                             f"void({m}, {m}, {c}, {f}, {f}, {c}, {f}, {f}, int64, int64, int64, int64, "
                             "int32[::1], float32, int64, int32[::1], int32[:, ::1], float32[::1], "
                             "int32[::1])"))
    return sigs
