"""The exact integer matmul on tensor cores (numerics: tinyloop/model/exact_matmul.py).

``out[t, n] (+)= sum_k x[t, k] * W[n, k]`` for q4 weights (group size a multiple of 32), with
the result defined by the exact integer numerics, so any row count, grid or warp split gives the
same bits, and so does the numpy reference. Two launches:

* ``stage`` (one warp per (token row, group), 8 groups per 256-thread block): optionally the
  RMS norm (``(x * inv) * norm_w``, inv in the rmsnorm kernel's order, `rmsnorm.row_inv_rms`),
  then the group's exponent E (warp max, exact), X = rint(x * 2^(XBITS - E)) in float64, the
  four signed 7-bit limbs of X written as bytes ``limbs[l, t, pos(k)]`` and the group sum
  ``sx[t, g] = sum X`` (int64 butterfly, exact). Within every 8 elements the limbs are stored in
  the order k = 0, 2, 4, 6, 1, 3, 5, 7, so one 8-byte load gives a lane both B registers of an
  mma step, matching the even / odd nibbles of its 4-byte weight word.
* ``mma`` (block = one tile of 16 weight rows, or 8 row pairs with an epilogue, x NW warps;
  grid.y = token blocks of 8 * NTT rows): warp w takes chunks w, w + NW, ... (CHUNK_K elements of
  k each); per group, per 32 elements of k, lane (gid, tig) loads the 4-byte weight word of rows
  gid and gid + 8 at k0 + 8 tig, splits it into even and odd nibbles (A registers) and issues one
  ``mma_u8s8`` per limb and token tile: exact int32 group sums of q * limb. The group's term
  ``float64(V * sm) * 2^(es + E - XBITS)`` (V = sum over limbs of a_l * 2^(7 (3 - l)) - zero *
  sx) is added to the chunk partial; partials go to shared memory, and after a barrier each
  output adds its chunk partials in chunk order, rounds once to float32 and stores it (adding in
  float64 to the old value when accumulating), or hands the pair to the epilogue.

Limits (BackendError otherwise): q4 weights, group size a multiple of 32, at most
``SMEM_DOUBLES`` partials per block (CHUNK_K * 44 elements of k at 8 token rows).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from ...errors import BackendError
from ...model.exact_matmul import CHUNK_K, LIMB_BITS, LIMBS, XBITS, chunk_groups
from ._common import cdiv, check_array, warp_max, warp_sum
from ._mma import mma_u8s8
from ._pdl import grid_dep_wait
from .rmsnorm import NT as STAGE_NT
from .matmul import epilogue_args, norm_args
from .rmsnorm import row_inv_rms

#: Warps per mma block.
NW = 4
#: Largest number of float64 chunk partials a block keeps in shared memory (48 KB).
SMEM_DOUBLES = 6144
#: Token tiles of 8 rows per block, at most.
MAX_NTT = 4

_M = uint32(0x0F0F0F0F)
_LO = uint64(0xFFFFFFFF)
_HALF = 1 << (LIMB_BITS - 1)
_MASK = (1 << LIMB_BITS) - 1

_stage_cache = {}
_mma_cache = {}


def _make_stage(norm: bool):
    if norm in _stage_cache:
        return _stage_cache[norm]
    GW = STAGE_NT // 32

    @cuda.jit(device=True, forceinline=True)
    def xval(x, nw, inv, t, k):
        """x[t, k], normed as ``(x * inv) * nw[k]`` when the variant has the norm."""
        v = x[t, k]
        if norm:
            v = (v * inv) * nw[k]
        return v

    @cuda.jit
    def stage(limbs8, sx, ex, x, nw, eps, gs):
        grid_dep_wait()
        t = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        K = x.shape[1]
        G = K // gs
        # warp reductions' scratch rows (used only by the simulator's twins): one per value type
        scratch = cuda.shared.array((GW, 32), float32)
        iscratch = cuda.shared.array((GW, 32), int64)
        inv = float32(1.0)
        if norm:
            inv = row_inv_rms(x, t, eps)
        g = cuda.blockIdx.x * GW + warp
        if g >= G:
            return
        m = float32(0.0)
        for i in range(lane, gs, 32):
            k = g * gs + i
            v = xval(x, nw, inv, t, k)
            m = max(m, abs(v))
        m = warp_max(m, scratch, warp, lane)
        eb = (cuda.libdevice.float_as_int(m) >> 23) & 0xFF
        E = max(eb, 1) - 126
        f = cuda.libdevice.ldexp(1.0, int32(XBITS - E))
        s = int64(0)
        for i in range(lane, gs, 32):
            k = g * gs + i
            v = xval(x, nw, inv, t, k)
            X = int64(cuda.libdevice.rint(float64(v) * f))
            s += X
            pos = (k & ~7) + ((k & 7) >> 1) + (k & 1) * 4
            rest = X
            for j in range(LIMBS - 1, 0, -1):
                d = ((rest + _HALF) & _MASK) - _HALF
                limbs8[j, t, pos] = uint32(d) & uint32(0xFF)
                rest = (rest - d) >> LIMB_BITS
            limbs8[0, t, pos] = uint32(rest) & uint32(0xFF)
        s = warp_sum(s, iscratch, warp, lane)          # integers: exact in any order
        if lane == 0:
            sx[t, g] = s
            ex[t, g] = E

    _stage_cache[norm] = stage
    return stage


def _make_mma(NTT: int, NCH: int, epilogue):
    key = (NTT, NCH, None if epilogue is None else epilogue.name)
    if key in _mma_cache:
        return _mma_cache[key]
    pair = epilogue is not None
    rows_of = epilogue.rows if pair else None
    store_pair = epilogue.store if pair else None
    TOK = 8 * NTT
    NACC = NTT * 4
    NIA = LIMBS * NTT * 4
    NTHREADS = NW * 32

    @cuda.jit
    def mma(out, w32, sbits, zeros, limbs64, sx, ex, T, N, gs, cg, nch, acc_flag, ep):
        grid_dep_wait()
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        gid = lane >> 2
        tig = lane & 3
        tile = cuda.blockIdx.x
        tok0 = cuda.blockIdx.y * TOK
        G = sbits.shape[1]
        if pair:
            p = min(tile * 8 + gid, N // 2 - 1)
            ra, rb = rows_of(ep, p, N)
        else:
            ra = min(tile * 16 + gid, N - 1)
            rb = min(tile * 16 + gid + 8, N - 1)
        part = cuda.shared.array((NCH, TOK, 16), float64)
        acc = cuda.local.array(NACC, float64)
        ia = cuda.local.array(NIA, int32)
        for c in range(warp, nch, NW):
            for i in range(NACC):
                acc[i] = 0.0
            for g in range(c * cg, min(G, c * cg + cg)):
                for i in range(NIA):
                    ia[i] = int32(0)
                for s in range(gs >> 5):
                    wi = ((g * gs + s * 32) >> 3) + tig
                    u0 = w32[ra, wi]
                    u1 = w32[rb, wi]
                    a0 = uint32(u0 & _M)
                    a2 = uint32((u0 >> uint32(4)) & _M)
                    a1 = uint32(u1 & _M)
                    a3 = uint32((u1 >> uint32(4)) & _M)
                    for tt in range(NTT):
                        tok = tok0 + tt * 8 + gid
                        for L in range(LIMBS):
                            bw = limbs64[L, tok, wi]
                            b = (L * NTT + tt) * 4
                            d = mma_u8s8(a0, a1, a2, a3, uint32(bw & _LO), uint32(bw >> uint64(32)),
                                         ia[b], ia[b + 1], ia[b + 2], ia[b + 3])
                            ia[b] = d[0]
                            ia[b + 1] = d[1]
                            ia[b + 2] = d[2]
                            ia[b + 3] = d[3]
                for h in range(2):
                    r = ra if h == 0 else rb
                    bits = int32(sbits[r, g])
                    eb = (bits >> 10) & 0x1F
                    sm = int64(bits & 0x3FF)
                    if eb > 0:
                        sm += 1024
                    es = max(eb, 1) - 25
                    z = int64(zeros[r, g])
                    for tt in range(NTT):
                        for cc in range(2):
                            tok = tok0 + tt * 8 + tig * 2 + cc
                            idx = h * 2 + cc
                            V = int64(0)
                            for L in range(LIMBS):
                                V += int64(ia[(L * NTT + tt) * 4 + idx]) << (LIMB_BITS * (LIMBS - 1 - L))
                            V -= z * sx[tok, g]
                            acc[tt * 4 + idx] += float64(V * sm) * cuda.libdevice.ldexp(
                                1.0, int32(es + ex[tok, g] - XBITS))
            for tt in range(NTT):
                for idx in range(4):
                    part[c, tt * 8 + tig * 2 + (idx & 1), gid + 8 * (idx >> 1)] = acc[tt * 4 + idx]
        cuda.syncthreads()
        if pair:
            for j in range(tid, TOK * 8, NTHREADS):
                tl = j >> 3
                q = j & 7
                t = tok0 + tl
                pp = tile * 8 + q
                if t < T and pp < N // 2:
                    va = 0.0
                    vb = 0.0
                    for c in range(nch):
                        va += part[c, tl, q]
                        vb += part[c, tl, q + 8]
                    store_pair(ep, out, t, pp, float32(va), float32(vb), N)
        else:
            for j in range(tid, TOK * 16, NTHREADS):
                tl = j >> 4
                q = j & 15
                t = tok0 + tl
                n = tile * 16 + q
                if t < T and n < N:
                    v = 0.0
                    for c in range(nch):
                        v += part[c, tl, q]
                    if acc_flag:
                        v += float64(out[t, n])
                    out[t, n] = float32(v)

    _mma_cache[key] = mma
    return mma


def _token_tiles(T: int) -> int:
    """Token tiles of 8 rows per mma block for a launch of T rows (before the shared-memory cap)."""
    return min(MAX_NTT, cdiv(T, 8))


def staging_shapes(T: int, K: int, group: int):
    """Shapes of the (limbs, sx, ex) buffers a launch of T rows needs: limbs uint8 (LIMBS, TP, K),
    sx int64 (TP, G), ex int32 (TP, G), TP = T rounded up to the token block."""
    NTT = _token_tiles(T)
    TP = cdiv(T, 8 * NTT) * 8 * NTT
    G = K // group
    return (LIMBS, TP, K), (TP, G), (TP, G)


def matmul_exact(out, x, w, scales, zeros, limbs, sx, ex, accumulate=False, stream=0, norm_w=None,
                 eps=0.0, epilogue=None):
    """The exact integer matmul of x (T, K) float32 with q4 weight `w` (N, K/2) uint8, `scales`
    float16 (N, G), `zeros` uint8 (N, G), staged through the caller's `limbs`, `sx`, `ex` buffers
    (at least `staging_shapes(T, K, group)`; rows past T are read but only into outputs that are
    never stored: a tensor-core column depends on its own B column only);
    optional fused RMS norm (`norm_w`, `eps`), accumulate, or a pair `epilogue` as in
    `matmul.matmul`."""
    op = "matmul_exact"
    check_array(op, "x", x, np.float32, 2)
    T, K = x.shape
    check_array(op, "out", out, np.float32, 2, (T, None))
    N, ep = epilogue_args(op, epilogue, accumulate, out, T)
    check_array(op, "scales", scales, np.float16, 2, (N, None))
    G = scales.shape[1]
    check_array(op, "w", w, np.uint8, 2, (N, K // 2))
    check_array(op, "zeros", zeros, np.uint8, 2, (N, G))
    if G == 0 or K % G or (K // G) % 32 or K % 2:
        raise BackendError(f"{op}: in_features={K} with {G} groups: the group size must be a "
                           f"multiple of 32")
    group = K // G
    ls, ss, es = staging_shapes(T, K, group)
    check_array(op, "limbs", limbs, np.uint8, 3)
    check_array(op, "sx", sx, np.int64, 2)
    check_array(op, "ex", ex, np.int32, 2)
    if limbs.shape[0] != LIMBS or limbs.shape[2] != K or limbs.shape[1] < ls[1] or \
            sx.shape[0] < ss[0] or sx.shape[1] != G or ex.shape != sx.shape:
        raise BackendError(f"{op}: staging buffers limbs {tuple(limbs.shape)}, sx {tuple(sx.shape)}, "
                           f"ex {tuple(ex.shape)} do not fit {ls}, {ss}")
    cg = chunk_groups(group)
    nch = cdiv(G, cg)
    NTT = _token_tiles(T)
    while NTT > 1 and nch * NTT * 8 * 16 > SMEM_DOUBLES:
        NTT //= 2
    if nch * NTT * 8 * 16 > SMEM_DOUBLES:
        raise BackendError(f"{op}: in_features={K} needs {nch} chunks; at most "
                           f"{SMEM_DOUBLES // 128} fit a block")
    norm = norm_w is not None
    eps = norm_args(op, norm_w, eps, K)
    if T == 0:
        return
    TB = cdiv(T, 8 * NTT)
    _make_stage(norm)[(cdiv(G, STAGE_NT // 32), T), STAGE_NT, stream](
        limbs, sx, ex, x, norm_w if norm else x[0], eps, group)
    w32 = w.view(np.uint32)
    sbits = scales.view(np.uint16)
    l64 = limbs.view(np.uint64)
    tiles = cdiv(N // 2, 8) if epilogue is not None else cdiv(N, 16)
    _make_mma(NTT, nch, epilogue)[(tiles, TB), NW * 32, stream](
        out, w32, sbits, zeros, l64, sx, ex, T, N, group, cg, nch, 1 if accumulate else 0, ep)


def ptx_signatures(epilogues=()):
    """(name, python function, signature) triples for the PTX compile tests: both staging
    variants, the mma kernel for one and four token tiles and a long row, and each epilogue."""
    sigs = [(f"matmul_exact_stage{'_norm' if norm else ''}", _make_stage(norm).py_func,
             "void(uint8[:, :, ::1], int64[:, ::1], int32[:, ::1], float32[:, ::1], float32[::1], float32, int64)")
            for norm in (False, True)]
    head = ("float32[:, ::1], uint32[:, ::1], uint16[:, ::1], uint8[:, ::1], uint64[:, :, ::1], int64[:, ::1], "
            "int32[:, ::1], int64, int64, int64, int64, int64, int64")
    for NTT, NCH, epi in [(1, 4, None), (4, 4, None), (1, 44, None)] + [(1, 4, e) for e in epilogues]:
        es = "UniTuple(int64, 1)" if epi is None else epi.sig
        tag = "" if epi is None else f"_{epi.name}"
        sigs.append((f"matmul_exact_mma{tag}_{NTT}_{NCH}", _make_mma(NTT, NCH, epi).py_func, f"void({head}, {es})"))
    return sigs


__all__ = ["matmul_exact", "ptx_signatures", "staging_shapes", "NW", "MAX_NTT", "SMEM_DOUBLES", "CHUNK_K"]
