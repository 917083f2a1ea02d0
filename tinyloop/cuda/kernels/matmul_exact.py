"""The exact integer matmul: tensor cores for many rows, dp4a for one (numerics:
tinyloop/model/exact_matmul.py).

``out[t, n] (+)= sum_k x[t, k] * W[n, k]`` for q4 weights (group size a multiple of 32), with
the result defined by the exact integer numerics, so any row count, grid or warp split gives the
same bits, and so does the numpy reference. A one-row launch whose group size is a power of two
up to GEMV_MAX_GROUP (and whose x fits a block's shared memory) is one launch of the dp4a kernel
(`_make_gemv`: x staged inside every block); every other launch is two:

* ``stage`` (one warp per (token row, group), 8 groups per 256-thread block): optionally the
  RMS norm (``(x * inv) * norm_w``, inv in the rmsnorm kernel's order, `rmsnorm.row_inv_rms`),
  then the group's exponent E (warp max, exact), X = rint(x * 2^(XBITS - E)) in float64, the
  four signed 7-bit limbs of X written as bytes ``limbs[l, t, pos(k)]`` and the group sum
  ``sx[t, g] = sum X`` (int64 butterfly, exact). Within every 8 elements the limbs are stored in
  the order k = 0, 2, 4, 6, 1, 3, 5, 7, so one 8-byte load gives a lane both B registers of an
  mma step, matching the even / odd nibbles of its 4-byte weight word.
* ``mma`` (block = one tile of 16 weight rows, or 8 row pairs with an epilogue, x `mma_warps`
  warps, one per chunk up to MMA_MAX_NW; grid.y = token blocks of 8 * NTT rows): warp w takes
  chunks w, w + NWB, ... (CHUNK_K elements of k each); per group of GS elements, lane (gid, tig)
  holds the GS / 32 contiguous 4-byte weight words tig * GS / 32 .. of the group in rows gid and
  gid + 8 (8-byte loads where the count is even; the next group's words are requested before
  this group's products), and per word s splits it into even and odd nibbles (A registers) and
  issues one ``mma_u8s8`` per limb and token tile with the limbs of the same 8 elements: exact
  int32 group sums of q * limb (which word rides in which k-slot does not matter to a sum). The
  group's term ``float64(V * sm) * 2^(es + E - XBITS)`` (V = sum over limbs of a_l * 2^(7 (3 - l)) - zero *
  sx) is formed in float64 where every step is exact (`_group_term`: groups of at most
  MAX_GROUP elements, zero points below 16 as the format requires of q4) and added to the
  chunk partial; partials go to shared memory, and after a barrier each
  output adds its chunk partials in chunk order, rounds once to float32 and stores it (adding in
  float64 to the old value when accumulating), or hands the pair to the epilogue.

* ``mma_wide`` (launches of at least MMA_WIDE_T rows that fill MMA_WIDE_BLOCKS blocks: prefill
  chunks): the same steps with the split turned around: warp w of a block owns 16-row tile
  bx * MMA_WIDE_NW + w over the whole of k for 32 token rows, every step's operands (limb words,
  weight words, a group's X sums and exponents) come into shared memory by cp.async
  (MMA_WIDE_STAGES steps in flight), and a warp adds its chunks' partials in registers in chunk
  order: the narrow kernel's sums, the same bits.

Limits (BackendError otherwise): q4 weights, group size a multiple of 32 and at most MAX_GROUP, at most
``SMEM_DOUBLES`` partials per block (CHUNK_K * 44 elements of k at 8 token rows).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from ...errors import BackendError
from ...model.exact_matmul import CHUNK_K, LIMB_BITS, LIMBS, XBITS, chunk_groups
from ._cp_async import cp_async, cp_async_commit, cp_async_wait
from ._common import SIM, as_bits, cdiv, check_array, pow2n, rint64, seg_max, seg_sum, sync_warp, warp_max, warp_sum
from ._dp4a import dp4a_us
from ._mma import mma_u8s8
from ._pdl import grid_dep_wait
from .rmsnorm import NT as STAGE_NT
from .matmul import epilogue_args, norm_args
from .rmsnorm import row_inv_rms

#: Most warps per tensor-core block of one token tile (`mma_warps`: one chunk of k per warp up to
#: this many chunks; the one-tile variants use at most 120 registers a thread, ptxas 13, sm_90).
MMA_MAX_NW = 12
#: Largest number of float64 chunk partials a block keeps in shared memory (48 KB).
SMEM_DOUBLES = 6144
#: Token tiles of 8 rows per block, at most.
MAX_NTT = 4
#: Launches of one token tile (T <= 8: lockstep lanes, verify rows) of a weight with at most
#: MMA_GROUP_NW groups a row and at most MMA_GROUP_TILES row tiles (fewer blocks than an H100 or
#: H200 has SMs, where the chunk form leaves SMs with a few warps waiting on L2) give each warp
#: one group instead of a chunk, MMA_GROUP_NW warps a block; the final sum adds the group terms in
#: chunk and group order (same bits). Measured (H200): 2048 x 2048 at T = 8 7.5 against 9.3 us;
#: on weights of more tiles or groups a warp per group was slower (gate|up 26.0 against 19.6 us,
#: head 103.8 against 57.1, down 12.3 against 10.6).
MMA_PER_GROUP = True
MMA_GROUP_NW = 16
MMA_GROUP_TILES = 128
#: Launches of at least this many rows take the wide tensor-core kernel (`_make_mma_wide`: warps
#: own row tiles over the whole of k, the token rows' limbs staged in shared memory); MMA_WIDE_NW
#: warps (16-row tiles) per block, WIDE_NTT token tiles of 8 rows per warp.
MMA_WIDE_T = 64
MMA_WIDE_NW = 4
#: ... and fill at least this many blocks (two per SM of an H100 or H200): with fewer, the
#: narrow kernel's chunk-parallel blocks are faster (2048-row weights at T = 64: 0.5x).
MMA_WIDE_BLOCKS = 256
WIDE_NTT = MAX_NTT
#: Pipeline stages of the wide kernel: mma steps whose operands are in flight (cp.async) at once.
MMA_WIDE_STAGES = 4

#: Flat weight and staging arrays are indexed with unsigned 32-bit offsets of 4-byte words.
_MAX_FLAT_BYTES = 1 << 34

_M = uint32(0x0F0F0F0F)
_LO = uint64(0xFFFFFFFF)
_HALF = 1 << (LIMB_BITS - 1)
_MASK = (1 << LIMB_BITS) - 1

#: The one-row kernel (`_make_gemv`): warps per block (rmsnorm's block, whose inverse RMS the
#: fused norm reproduces with `row_inv_rms`), weight rows per warp, elements of k per warp step
#: (32 lanes x 32), and the most shared memory a block may take (bytes); a one-row launch that
#: does not fit (group size not a power of two up to GEMV_MAX_GROUP, or a long row) takes the mma
#: kernel, which gives the same bits. GEMV_WIDE_R rows per warp from GEMV_WIDE_N weight rows on
#: (fewer blocks, each staging x once; a shape rule, never a function of T).
GEMV_NW = STAGE_NT // 32
GEMV_R = 2
GEMV_WIDE_R = 4
GEMV_WIDE_N = 4096
GEMV_STEP_K = 1024
GEMV_SMEM = 48 * 1024
#: Largest group the kernels take: below it a group's V * sm stays under 2^53, so the float64
#: group terms are exact (`_group_term`); larger groups are refused (`supports` is False).
MAX_GROUP = 2048
#: Largest group of the one-row kernel: a group's staging threads (8 elements each) share a warp.
GEMV_MAX_GROUP = 256

_stage_cache = {}
_mma_cache = {}
_gemv_cache = {}


def _groups_ok(K: int, G: int) -> bool:
    """K inputs in G groups whose size is a multiple of 32 (the kernels' step) and at most
    MAX_GROUP (the float64 group terms' exactness, `_group_term`)."""
    return G > 0 and K % G == 0 and (K // G) % 32 == 0 and K // G <= MAX_GROUP


@cuda.jit(device=True)
def _group_exponent(m):
    """E of a group whose largest |x| is the float32 m (step 1 of the numerics: m < 2^E)."""
    return max((as_bits(m) >> 23) & 0xFF, 1) - 126


@cuda.jit(device=True, inline=True)
def _limb(rest):
    """(the lowest signed 7-bit digit of the int32 rest, the rest above it), in int32 arithmetic
    (|X| <= 2^XBITS fits; every step truncated so the compiler keeps it 32-bit)."""
    d = int32(int32(int32(rest + _HALF) & _MASK) - _HALF)
    return d, int32(int32(rest - d) >> LIMB_BITS)


@cuda.jit(device=True, inline=True)
def _scale_value(bits):
    """The float16 scale with bits `bits` (finite, > 0) as a float64, exactly: ``sm * 2^es``
    with sm its integer significand (step 4 of the numerics)."""
    b = int32(bits)
    eb = (b >> 10) & 0x1F
    sm = b & 0x3FF
    if eb > 0:
        sm += 1024
    return float64(sm) * pow2n(max(eb, 1) - 25)


@cuda.jit(device=True, inline=True)
def _limb_value(a0, a1, a2, a3):
    """``a0 2^21 + a1 2^14 + a2 2^7 + a3`` of four int32 limb sums (most significant first) as
    a float64, exactly: the pairs ``a0 2^7 + a1`` and ``a2 2^7 + a3`` stay within int32 for
    groups of up to MAX_GROUP elements (|a_l| <= 15 * 65 * GS), and the whole below 2^53."""
    hi = int32(a0 * 128 + a1)
    lo = int32(a2 * 128 + a3)
    return float64(hi) * 16384.0 + float64(lo)


@cuda.jit(device=True, inline=True)
def _group_term(v, z, sxd, sd, p):
    """A group's float64 term (step 4 of the numerics) from the exact float64 sum v of q * X:
    ``(v - z * sum X) * (scale * 2^(E - XBITS))``. Every step is exact, so it equals
    ``float64(V * sm) * 2^(es + E - XBITS)`` bit for bit: z * sum X and V are integers below
    2^53 (z < 16, |sum X| <= GS 2^XBITS); the scale times the power of two is an 11-bit integer
    times 2^e with e in [-176, 108] (float64's normal range); and V * sm is below 2^53 for groups
    of up to MAX_GROUP elements (|V| <= 15 GS 2^XBITS, sm <= 2047), so the product does not
    round and the sum it joins rounds as the int64 form's would."""
    return (v - float64(z) * sxd) * (sd * p)


@cuda.jit(device=True, inline=True)
def _a_regs(u0, u1):
    """The mma's A registers from a lane's weight words of rows gid (u0) and gid + 8 (u1): even
    nibbles (k-slots 4 tig ..) and odd nibbles (16 + 4 tig ..), one mask each (_mma.py)."""
    return (uint32(u0 & _M), uint32(u1 & _M), uint32((u0 >> uint32(4)) & _M),
            uint32((u1 >> uint32(4)) & _M))


_tile_ops_cache = {}


def _make_tile_ops(NTT: int):
    """The tensor-core kernels' per-lane steps for NTT token tiles: `mma_limb` (one mma of a limb
    and token tile into the int32 group sums ia[q .. q + 3], B from an 8-byte limb word) and
    `group_terms` (the group's float64 terms of rows ra, rb added to the chunk partials acc)."""
    if NTT in _tile_ops_cache:
        return _tile_ops_cache[NTT]

    @cuda.jit(device=True, inline=True)
    def mma_limb(ia, q, a0, a1, a2, a3, bw):
        d = mma_u8s8(a0, a1, a2, a3, uint32(bw & _LO), uint32(bw >> uint64(32)),
                     ia[q], ia[q + 1], ia[q + 2], ia[q + 3])
        ia[q] = d[0]
        ia[q + 1] = d[1]
        ia[q + 2] = d[2]
        ia[q + 3] = d[3]

    @cuda.jit(device=True, inline=True)
    def group_terms(acc, ia, bits_a, z_a, bits_b, z_b, sx, ex, tb, col, tig):
        """Rows ra (scale bits bits_a, zero z_a) and rb; the group's sums of X and exponents of
        token row tb + i at sx[tb + i, col], ex[tb + i, col]."""
        sd_a = _scale_value(bits_a)
        sd_b = _scale_value(bits_b)
        for tt in range(NTT):
            for cc in range(2):
                tok = uint32(tb + tt * 8 + tig * 2 + cc)
                sxd = float64(sx[tok, col])
                p = pow2n(ex[tok, col] - XBITS)
                for h in range(2):
                    idx = h * 2 + cc
                    v = _limb_value(ia[tt * 4 + idx], ia[(NTT + tt) * 4 + idx], ia[(2 * NTT + tt) * 4 + idx],
                                    ia[(3 * NTT + tt) * 4 + idx])
                    acc[tt * 4 + idx] += _group_term(v, z_a if h == 0 else z_b, sxd, sd_a if h == 0 else sd_b, p)

    _tile_ops_cache[NTT] = (mma_limb, group_terms)
    return mma_limb, group_terms


_tile_rows_cache = {}


def _make_tile_rows(epilogue):
    """`tile_rows(ep, tile, gid, N)`: the weight rows a lane's mma rows gid and gid + 8 of 16-row
    tile `tile` stand for (with a pair epilogue: pair tile * 8 + gid's two rows), clamped."""
    name = None if epilogue is None else epilogue.name
    if name in _tile_rows_cache:
        return _tile_rows_cache[name]
    pair = epilogue is not None
    rows_of = epilogue.rows if pair else None

    @cuda.jit(device=True, inline=True)
    def tile_rows(ep, tile, gid, N):
        if pair:
            return rows_of(ep, min(tile * 8 + gid, N // 2 - 1), N)
        return min(tile * 16 + gid, N - 1), min(tile * 16 + gid + 8, N - 1)

    _tile_rows_cache[name] = tile_rows
    return tile_rows


def _make_stage(norm: bool):
    if norm in _stage_cache:
        return _stage_cache[norm]
    GW = STAGE_NT // 32

    @cuda.jit(device=True, inline=True)
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
        E = _group_exponent(m)
        f = pow2n(XBITS - E)
        s = int64(0)
        for i in range(lane, gs, 32):
            k = g * gs + i
            v = xval(x, nw, inv, t, k)
            X = int32(rint64(float64(v) * f))
            s += int64(X)
            pos = (k & ~7) + ((k & 7) >> 1) + (k & 1) * 4
            rest = X
            for j in range(LIMBS - 1, 0, -1):
                d, rest = _limb(rest)
                limbs8[j, t, pos] = uint32(d) & uint32(0xFF)
            limbs8[0, t, pos] = uint32(rest) & uint32(0xFF)
        s = warp_sum(s, iscratch, warp, lane)          # integers: exact in any order
        if lane == 0:
            sx[t, g] = s
            ex[t, g] = E

    _stage_cache[norm] = stage
    return stage


def mma_warps(nch: int, NTT: int = 1) -> int:
    """Warps of a tensor-core block for `nch` chunks and NTT token tiles: one chunk each up to
    MMA_MAX_NW chunks (8 with more than one token tile: those variants take up to 255 registers a
    thread, and 8 warps of 255 fit an SM's 64K), then the chunks spread evenly."""
    cap = MMA_MAX_NW if NTT == 1 else 8
    return cdiv(nch, cdiv(nch, cap))


def _make_mma(NTT: int, NCH: int, GS: int, NWB: int, epilogue, NG: int = 0):
    """The narrow tensor-core kernel. A warp's unit of work is a chunk of CG groups (NG = 0: up
    to NCH chunk partials per block) or, with NG > 0, one group (up to NG group terms per block,
    added into their chunks' partials by the final sum in the same order: the same bits)."""
    key = (NTT, NCH, GS, NWB, None if epilogue is None else epilogue.name, NG)
    if key in _mma_cache:
        return _mma_cache[key]
    pair = epilogue is not None
    tile_rows = _make_tile_rows(epilogue)
    store_pair = epilogue.store if pair else None
    TOK = 8 * NTT
    NACC = NTT * 4
    NIA = LIMBS * NTT * 4
    NTHREADS = NWB * 32
    mma_limb, group_terms = _make_tile_ops(NTT)
    SPG = GS // 32                     # mma steps per group = weight words per lane and row
    WPG = GS // 8                      # 4-byte weight words per group and row
    V64 = SPG % 2 == 0                 # a lane's words of a group as 8-byte loads
    PG = NG > 0                        # a warp per group
    NP = NG if PG else NCH             # partials in shared memory (a literal size)

    @cuda.jit(device=True, inline=True)
    def chunk_sum(part, tl, q, nch, cg, G):
        """An output's total from its partials: chunk partials added in chunk order, or, with a
        warp per group, each chunk's group terms added in group order from 0.0 first (the
        numerics' step 5, as a warp that walks a chunk adds them)."""
        v = 0.0
        for c in range(nch):
            if PG:
                a = 0.0
                for g in range(c * cg, min(G, c * cg + cg)):
                    a += part[g, tl, q]
                v += a
            else:
                v += part[c, tl, q]
        return v

    @cuda.jit(device=True, inline=True)
    def load_group(wa, wb, w32, w64, oa, ob, g, tig):
        """Lane tig's SPG contiguous weight words of group g in the rows whose first 4-byte word
        is at oa and ob of the flat weight (unsigned 32-bit offsets: no wrap-around or 64-bit
        index arithmetic)."""
        base = uint32(g * WPG + tig * SPG)
        if V64:
            for j in range(SPG // 2):
                ua = w64[((oa + base) >> uint32(1)) + uint32(j)]
                ub = w64[((ob + base) >> uint32(1)) + uint32(j)]
                wa[2 * j] = uint32(ua & _LO)
                wa[2 * j + 1] = uint32(ua >> uint64(32))
                wb[2 * j] = uint32(ub & _LO)
                wb[2 * j + 1] = uint32(ub >> uint64(32))
        else:
            for j in range(SPG):
                wa[j] = w32[oa + base + uint32(j)]
                wb[j] = w32[ob + base + uint32(j)]

    @cuda.jit
    def mma(out, w32, w64, sbits, zeros, lf, sx, ex, T, N, cg, nch, acc_flag, ep):
        """w32 / w64: the weight's codes as flat 4- / 8-byte words; lf: the staged limbs as flat
        8-byte words (LIMBS, TP, K / 8)."""
        grid_dep_wait()
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        gid = lane >> 2
        tig = lane & 3
        tile = cuda.blockIdx.x
        tok0 = cuda.blockIdx.y * TOK
        G = sbits.shape[1]
        KW = uint32(G * WPG)                       # 4-byte weight words of a row = limb words of a token row
        LP = uint32(lf.shape[0] // (LIMBS * G * WPG)) * KW    # limb words of one limb plane
        ra, rb = tile_rows(ep, tile, gid, N)
        ra = uint32(ra)
        rb = uint32(rb)
        oa = ra * KW
        ob = rb * KW
        # lane (gid, tig)'s limb word of token tile 0, limb 0, group 0, step 0
        lb = uint32(tok0 + gid) * KW + uint32(tig * SPG)
        part = cuda.shared.array((NP, TOK, 16), float64)
        acc = cuda.local.array(NACC, float64)
        ia = cuda.local.array(NIA, int32)
        wa = cuda.local.array(SPG, uint32)
        wb = cuda.local.array(SPG, uint32)
        na = cuda.local.array(SPG, uint32)
        nb = cuda.local.array(SPG, uint32)
        nu = G if PG else nch          # units: groups or chunks
        ug = 1 if PG else cg           # groups per unit
        if warp < nu:
            load_group(wa, wb, w32, w64, oa, ob, warp * ug, tig)
        for c in range(warp, nu, NWB):
            for i in range(NACC):
                acc[i] = 0.0
            g1 = min(G, c * ug + ug)
            for g in range(c * ug, g1):
                # the next group's weight words (the warp's next unit after its last group)
                # are requested before this group's products
                gn = g + 1 if g + 1 < g1 else (c + NWB) * ug
                if gn < G:
                    load_group(na, nb, w32, w64, oa, ob, gn, tig)
                for i in range(NIA):
                    ia[i] = int32(0)
                lg = lb + uint32(g * WPG)
                for s in range(SPG):
                    # lane tig's word s of the group: the limbs of the same 8 elements
                    u0 = wa[s]
                    u1 = wb[s]
                    a0, a1, a2, a3 = _a_regs(u0, u1)
                    for tt in range(NTT):
                        for L in range(LIMBS):
                            mma_limb(ia, (L * NTT + tt) * 4, a0, a1, a2, a3,
                                     lf[lg + uint32(L) * LP + uint32(tt * 8) * KW + uint32(s)])
                group_terms(acc, ia, sbits[ra, uint32(g)], zeros[ra, uint32(g)], sbits[rb, uint32(g)],
                            zeros[rb, uint32(g)], sx, ex, uint32(tok0), uint32(g), uint32(tig))
                for j in range(SPG):
                    wa[j] = na[j]
                    wb[j] = nb[j]
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
                    va = chunk_sum(part, tl, q, nch, cg, G)
                    vb = chunk_sum(part, tl, q + 8, nch, cg, G)
                    store_pair(ep, out, t, pp, float32(va), float32(vb), N)
        else:
            for j in range(tid, TOK * 16, NTHREADS):
                tl = j >> 4
                q = j & 15
                t = tok0 + tl
                n = tile * 16 + q
                if t < T and n < N:
                    v = chunk_sum(part, tl, q, nch, cg, G)
                    if acc_flag:
                        v += float64(out[t, n])
                    out[t, n] = float32(v)

    _mma_cache[key] = mma
    return mma


def _make_mma_wide(GS: int, NWB: int, NS: int, epilogue):
    """The tensor-core kernel for launches of at least MMA_WIDE_T rows: warp w of block (bx, by)
    owns 16-row tile bx * NWB + w (8 row pairs with an epilogue) and token rows 32 by .. 32 by + 31
    (four token tiles) over the whole of k, so a weight tile is read once per 32 token rows and no
    partials cross warps. Every mma step's operands come through shared memory, NS steps in flight
    (cp.async, no registers held for them): the block's 4 KB of limbs (4 limbs x 32 token rows x
    the 4 words of the step), each lane's two weight words, and at a group's first step the
    group's X sums and exponents of the 32 token rows. One barrier per step. A warp's outputs add
    their chunks' partials in registers in chunk order: the narrow kernel's sums, the same bits."""
    key = ("wide", GS, NWB, NS, None if epilogue is None else epilogue.name)
    if key in _mma_cache:
        return _mma_cache[key]
    pair = epilogue is not None
    tile_rows = _make_tile_rows(epilogue)
    store_pair = epilogue.store if pair else None
    NTT = WIDE_NTT
    TOK = 8 * NTT
    NACC = NTT * 4
    NIA = LIMBS * NTT * 4
    NTHREADS = NWB * 32
    SPG = GS // 32
    WPG = GS // 8
    LW = LIMBS * TOK * 4               # limb words of one step
    NSR = LW // NTHREADS               # of them copied by each thread
    assert NSR * NTHREADS == LW and NTHREADS >= 2 * TOK and NS >= 2
    SL = NS * LW                       # shared sizes must be literal constants
    SW = NS * NTHREADS * 2
    mma_limb, group_terms = _make_tile_ops(NTT)
    wait_stage = cp_async_wait(NS - 2)

    @cuda.jit(device=True, inline=True)
    def issue(bl, bw, bsx, bex, lf, w32, sx, ex, lsrc, oa, ob, osx, j, nsteps, tid):
        """Start the copies of step j's operands into stage j % NS, and commit them as one group
        (an empty group past the last step, so every thread's group count stays in step). The
        sources are flat arrays at this thread's fixed offsets (lsrc: its limb words, oa / ob:
        its two weight words, osx: its token row's group sums or exponents) plus the step's."""
        if j < nsteps:
            st = j % uint32(NS)
            g = j // uint32(SPG)
            s = j - g * uint32(SPG)
            step = g * uint32(WPG) + s
            for r in range(NSR):
                cp_async(bl, st * uint32(LW) + uint32(tid + r * NTHREADS), lf, lsrc[r] + step)
            cp_async(bw, (st * uint32(NTHREADS) + tid) * uint32(2), w32, oa + step)
            cp_async(bw, (st * uint32(NTHREADS) + tid) * uint32(2) + uint32(1), w32, ob + step)
            if s == 0:
                if tid < TOK:
                    cp_async(bsx, tid * uint32(NS) + g % uint32(NS), sx, osx + g)
                elif tid < 2 * TOK:
                    cp_async(bex, (tid - uint32(TOK)) * uint32(NS) + g % uint32(NS), ex, osx + g)
        cp_async_commit()

    @cuda.jit
    def mma(out, w32, w64, sbits, zeros, lf, sx, ex, T, N, cg, nch, acc_flag, ep):
        """w32: the weight's codes as flat 4-byte words; lf: the staged limbs as flat 8-byte words
        (LIMBS, TP, K / 8); sx, ex flat (TP, G)."""
        tid = uint32(cuda.threadIdx.x)
        warp = tid >> uint32(5)
        lane = tid & uint32(31)
        gid = lane >> uint32(2)
        tig = lane & uint32(3)
        tok0 = cuda.blockIdx.y * TOK
        G = sbits.shape[1]
        KW = uint32(G * WPG)             # 4-byte weight words of a row = limb words of a token row
        TP = uint32(lf.shape[0] // (LIMBS * G * WPG))
        ntile = (N // 2 + 7) // 8 if pair else (N + 15) // 16
        tile = cuda.blockIdx.x * NWB + warp
        live = tile < ntile              # a warp past the last tile stages and waits, stores nothing
        tile = min(tile, ntile - 1)
        ra, rb = tile_rows(ep, tile, gid, N)
        ra = uint32(ra)
        rb = uint32(rb)
        oa = ra * KW + tig * uint32(SPG)
        ob = rb * KW + tig * uint32(SPG)
        lsrc = cuda.local.array(NSR, uint32)
        for r in range(NSR):
            # word i of a stage: limb i // (TOK * 4), token row (i >> 2) % TOK, tig i & 3
            i = tid + uint32(r * NTHREADS)
            lsrc[r] = ((i // uint32(TOK * 4)) * TP + uint32(tok0) + ((i >> uint32(2)) % uint32(TOK))) * KW + \
                (i & uint32(3)) * uint32(SPG)
        osx = (uint32(tok0) + (tid if tid < TOK else tid - uint32(TOK))) * uint32(G)
        bl = cuda.shared.array(SL, uint64)
        bw = cuda.shared.array(SW, uint32)
        bsx = cuda.shared.array((TOK, NS), int64)
        bex = cuda.shared.array((TOK, NS), int32)
        tot = cuda.local.array(NACC, float64)
        acc = cuda.local.array(NACC, float64)
        ia = cuda.local.array(NIA, int32)
        grid_dep_wait()
        nsteps = uint32(G * SPG)
        for j in range(NS - 1):
            issue(bl, bw, bsx, bex, lf, w32, sx, ex, lsrc, oa, ob, osx, uint32(j), nsteps, tid)
        for i in range(NACC):
            tot[i] = 0.0
        for c in range(nch):
            for i in range(NACC):
                acc[i] = 0.0
            g1 = min(G, c * cg + cg)
            for g in range(c * cg, g1):
                for i in range(NIA):
                    ia[i] = int32(0)
                gu = uint32(g)
                bits_a = sbits[ra, gu]     # used after the group's steps
                z_a = zeros[ra, gu]
                bits_b = sbits[rb, gu]
                z_b = zeros[rb, gu]
                for s in range(SPG):
                    j = gu * uint32(SPG) + uint32(s)
                    # step j's copies are done (NS - 2 younger groups may be in flight); after the
                    # barrier every thread's are visible, and stage (j - 1) % NS is free again
                    wait_stage()
                    cuda.syncthreads()
                    issue(bl, bw, bsx, bex, lf, w32, sx, ex, lsrc, oa, ob, osx, j + uint32(NS - 1), nsteps, tid)
                    st = j % uint32(NS)
                    u0 = bw[(st * uint32(NTHREADS) + tid) * uint32(2)]
                    u1 = bw[(st * uint32(NTHREADS) + tid) * uint32(2) + uint32(1)]
                    a0, a1, a2, a3 = _a_regs(u0, u1)
                    sb = st * uint32(LW) + gid * uint32(4) + tig
                    for tt in range(NTT):
                        for L in range(LIMBS):
                            mma_limb(ia, (L * NTT + tt) * 4, a0, a1, a2, a3,
                                     bl[sb + uint32((L * TOK + tt * 8) * 4)])
                group_terms(acc, ia, bits_a, z_a, bits_b, z_b, bsx, bex, uint32(0), gu % uint32(NS), tig)
            for i in range(NACC):
                tot[i] += acc[i]
        if not live:
            return
        for tt in range(NTT):
            for cc in range(2):
                t = tok0 + tt * 8 + tig * 2 + cc
                if t < T:
                    if pair:
                        pp = tile * 8 + gid
                        if pp < N // 2:
                            store_pair(ep, out, t, pp, float32(tot[tt * 4 + cc]), float32(tot[tt * 4 + 2 + cc]), N)
                    else:
                        for h in range(2):
                            n = tile * 16 + gid + 8 * h
                            if n < N:
                                v = tot[tt * 4 + h * 2 + cc]
                                if acc_flag:
                                    v += float64(out[t, n])
                                out[t, n] = float32(v)

    _mma_cache[key] = mma
    return mma


def _gemv_smem(nstep: int, R: int) -> int:
    """Shared bytes of a one-row block with `nstep` warp steps and R rows per warp."""
    per_warp = R * (32 * 8 + 2 * nstep * 8 + 8)
    return nstep * (GEMV_STEP_K * LIMBS + 32 * 12) + GEMV_NW * (per_warp + 32 * 12)


def gemv_rows(N: int, pair: bool = False) -> int:
    """Rows per warp of the one-row kernel for N weight rows (even with a pair epilogue)."""
    R = GEMV_WIDE_R if N >= GEMV_WIDE_N else GEMV_R
    return max(2, R - R % 2) if pair else R


def gemv_fits(K: int, group: int, R: int = 0) -> bool:
    """Whether a one-row launch of a (., K) weight with this group size takes the dp4a kernel
    (with R rows per warp; 0: the largest the launcher uses)."""
    R = R or max(GEMV_R, GEMV_WIDE_R)
    return (32 <= group <= GEMV_MAX_GROUP and group & (group - 1) == 0 and K % group == 0
            and _gemv_smem(cdiv(K, GEMV_STEP_K), R) <= GEMV_SMEM)


def _make_gemv(R: int, NSTEP: int, GS: int, norm: bool, epilogue):
    """The one-row exact kernel with dp4a (T = 1): R rows per warp, at most NSTEP warp steps of
    GEMV_STEP_K elements, group size GS (a power of two, 32..GEMV_MAX_GROUP), all compile-time.

    The block stages x itself in one pass, thread per 8 elements: x (normed as ``(x * inv) * nw``
    with the variant's norm), the group's exponent E (max over the group's GS / 8 threads, which
    share a warp), X and its four 7-bit limbs as words (even elements 0, 2, 4, 6 of the 8 in one
    word, odd ones in the next: the nibble order of ``w & 0x0F0F0F0F`` and ``(w >> 4) &
    0x0F0F0F0F``) laid out so that lane l reads its 32 words of a step from bank l, and the
    group's integer sum of X. Then warp w takes rows; per step lane l
    covers k = 1024 s + 32 l .. + 31 (16 bytes of a row), 32 dp4a per row, and V = sum of q * X
    over its 32 elements (exact int64); the GS / 32 lanes of a group add their V by shuffles
    (`seg_sum`, exact), the group's leader forms the term, and one lane per (row, chunk) adds the chunk's
    terms in group order; after the last step lane r adds row r's chunks in order."""
    key = (R, NSTEP, GS, norm, None if epilogue is None else epilogue.name)
    if key in _gemv_cache:
        return _gemv_cache[key]
    assert LIMBS == 4 and LIMB_BITS == 7 and GS & (GS - 1) == 0 and 32 <= GS <= GEMV_MAX_GROUP
    pair = epilogue is not None
    rows_of = epilogue.rows if pair else None
    store_pair = epilogue.store if pair else None
    NWG = GEMV_NW
    NT = NWG * 32
    W = GS // 32                       # lanes per group
    GPS = GEMV_STEP_K // GS            # groups per step
    CG = chunk_groups(GS)
    CPS = max(1, GPS // CG)            # chunks per step (steps start on chunk boundaries)
    RP = R // 2
    R2 = 2 * R                         # a lane's weight words of a step
    XS = NSTEP * GEMV_STEP_K           # shared sizes (compile-time constants)
    GM = NSTEP * 32
    NCM = 2 * NSTEP
    SPG = GS // 8                      # staging threads per group
    SCR = NT if SIM else 1             # the simulator twins' segment scratch
    if pair:
        assert R % 2 == 0

    @cuda.jit(device=True)
    def xval(x, nw, inv, k):
        v = x[0, k]
        if norm:
            v = (v * inv) * nw[k]
        return v

    @cuda.jit(device=True)
    def row_of(ep, row0, r, N):
        if pair:
            p = min(row0 + (r >> 1), N // 2 - 1)
            ra, rb = rows_of(ep, p, N)
            return ra if r % 2 == 0 else rb
        return min(row0 + r, N - 1)

    @cuda.jit
    def gemv(out, w64, sbits, zeros, x, nw, eps, N, acc_flag, ep):
        grid_dep_wait()
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        K = x.shape[1]
        G = K // GS
        xs = cuda.shared.array(XS, uint32)
        exs = cuda.shared.array(GM, int32)
        sxs = cuda.shared.array(GM, int64)
        tb = cuda.shared.array((NWG, R, 32), float64)
        ps = cuda.shared.array((NWG, R, NCM), float64)
        tots = cuda.shared.array((NWG, R), float64)
        fscratch = cuda.shared.array(SCR, float32)
        iscratch = cuda.shared.array(SCR, int64)
        dscratch = cuda.shared.array(SCR, float64)
        # the warp's rows' weight words of the first step are requested before the staging pass
        # (weights are no kernel's output: their loads overlap the staging)
        row0 = (cuda.blockIdx.x * NWG + warp) * (RP if pair else R)
        wc = cuda.local.array(R2, uint64)
        wn = cuda.local.array(R2, uint64)
        # the rows and their first weight words in the flat weight (unsigned 32-bit: no 64-bit
        # index arithmetic or wrap-around per load)
        rows = cuda.local.array(R, uint32)
        orow = cuda.local.array(R, uint32)
        KW = uint32(K >> 4)
        ul = uint32(lane)
        uw = uint32(warp)
        for r in range(R):
            rows[r] = uint32(row_of(ep, row0, r, N))
            orow[r] = rows[r] * KW
            for hw in range(2):
                wc[2 * r + hw] = w64[orow[r] + (ul * uint32(2)) + uint32(hw)] if lane * 32 < K else uint64(0)
        inv = float32(1.0)
        if norm:
            inv = row_inv_rms(x, 0, eps)
        # (1) one pass, 8 elements per thread (block-uniform loop: the simulator's segment
        # reductions are block barriers): the group's exponent E (max over the group's SPG
        # threads), X and its four 7-bit limbs, the group's integer sum; limbs as words (module
        # doc) in shared memory, E and the sum per group
        xv = cuda.local.array(8, float32)
        for it in range(0, K >> 3, NT):
            m8 = it + tid
            on = m8 < (K >> 3)
            k0 = m8 * 8
            m = float32(0.0)
            for i in range(8):
                xv[i] = xval(x, nw, inv, k0 + i) if on else float32(0.0)
                m = max(m, abs(xv[i]))
            m = seg_max(m, SPG, fscratch, tid)
            E = _group_exponent(m)
            f = pow2n(XBITS - E)
            s = int32(0)                   # 8 values of at most 2^XBITS: within int32
            base = (m8 >> 7) * 32 * 32 + ((m8 & 3) * 2) * 32 + ((m8 >> 2) & 31)
            for h in range(2):
                l0 = uint32(0)
                l1 = uint32(0)
                l2 = uint32(0)
                l3 = uint32(0)
                for b in range(4):
                    rest = int32(rint64(float64(xv[2 * b + h]) * f))
                    s = int32(s + rest)
                    sh = uint32(8 * b)
                    d, rest = _limb(rest)
                    l3 = uint32(l3 | (uint32(d & 255) << sh))
                    d, rest = _limb(rest)
                    l2 = uint32(l2 | (uint32(d & 255) << sh))
                    d, rest = _limb(rest)
                    l1 = uint32(l1 | (uint32(d & 255) << sh))
                    l0 = uint32(l0 | (uint32(rest & 255) << sh))
                if on:
                    o = base + h * 32
                    xs[o] = uint32(l0)
                    xs[o + 8 * 32] = uint32(l1)
                    xs[o + 16 * 32] = uint32(l2)
                    xs[o + 24 * 32] = uint32(l3)
            s = seg_sum(int64(s), SPG, iscratch, tid)
            if on and m8 % SPG == 0:
                exs[k0 // GS] = E
                sxs[k0 // GS] = s
        cuda.syncthreads()
        # (2) the warp's rows; each step requests the next step's weight words first
        xr = cuda.local.array(32, uint32)
        nsteps = (K + GEMV_STEP_K - 1) // GEMV_STEP_K
        for st in range(nsteps):
            kl = st * GEMV_STEP_K + lane * 32
            on = kl < K
            kn = kl + GEMV_STEP_K
            if st + 1 < nsteps:
                for r in range(R):
                    for hw in range(2):
                        wn[2 * r + hw] = w64[orow[r] + uint32(kn >> 4) + uint32(hw)] if kn < K else uint64(0)
            xb = uint32(st * 32 * 32) + ul
            for i in range(32):
                xr[i] = xs[xb + uint32(i * 32)]
            for r in range(R):
                a0 = int32(0)
                a1 = int32(0)
                a2 = int32(0)
                a3 = int32(0)
                if on:
                    for hw in range(2):
                        u = wc[2 * r + hw]
                        for q in range(2):
                            wd = uint32((u >> uint64(32 * q)) & _LO)
                            lo = uint32(wd & _M)
                            hi = uint32((wd >> uint32(4)) & _M)
                            j = hw * 2 + q
                            a0 = dp4a_us(lo, xr[j * 2], a0)
                            a0 = dp4a_us(hi, xr[j * 2 + 1], a0)
                            a1 = dp4a_us(lo, xr[8 + j * 2], a1)
                            a1 = dp4a_us(hi, xr[8 + j * 2 + 1], a1)
                            a2 = dp4a_us(lo, xr[16 + j * 2], a2)
                            a2 = dp4a_us(hi, xr[16 + j * 2 + 1], a2)
                            a3 = dp4a_us(lo, xr[24 + j * 2], a3)
                            a3 = dp4a_us(hi, xr[24 + j * 2 + 1], a3)
                # the group's W lanes add their sums (integers below 2^53: exact in any order)
                v = seg_sum(_limb_value(a0, a1, a2, a3), W, dscratch, tid)
                g = uint32(st * GPS) + ul // uint32(W)
                if ul % uint32(W) == 0 and g < G:
                    row = rows[r]
                    tb[uw, uint32(r), ul // uint32(W)] = _group_term(v, zeros[row, g], float64(sxs[g]), _scale_value(sbits[row, g]),
                                                                     pow2n(exs[g] - XBITS))
            sync_warp()
            if ul < uint32(R * CPS):
                r = ul // uint32(CPS)
                c = ul % uint32(CPS)
                g0 = uint32(st * GPS) + c * uint32(CG)
                if g0 < G:
                    a = float64(0.0)
                    for i in range(CG):
                        if g0 + uint32(i) < G:
                            a += tb[uw, r, c * uint32(CG) + uint32(i)]
                    ps[uw, r, uint32(st * CPS) + c] = a
            for i in range(R2):
                wc[i] = wn[i]
            sync_warp()
        if lane < R:
            tot = float64(0.0)
            for c in range((G + CG - 1) // CG):
                tot += ps[warp, lane, c]
            tots[warp, lane] = tot
        sync_warp()
        if pair:
            if lane < RP and row0 + lane < N // 2:
                store_pair(ep, out, 0, row0 + lane, float32(tots[warp, 2 * lane]),
                           float32(tots[warp, 2 * lane + 1]), N)
        elif lane < R and row0 + lane < N:
            v = tots[warp, lane]
            if acc_flag:
                v += float64(out[0, row0 + lane])
            out[0, row0 + lane] = float32(v)

    _gemv_cache[key] = gemv
    return gemv


def _token_tiles(T: int) -> int:
    """Token tiles of 8 rows per mma block for a launch of T rows (before the shared-memory cap)."""
    return min(MAX_NTT, cdiv(T, 8))


def per_group(T: int, G: int, tiles: int) -> bool:
    """Whether a tensor-core launch of T rows, G groups a row and `tiles` row tiles (16 rows, or 8
    row pairs with an epilogue) gives each warp one group (MMA_PER_GROUP's rule)."""
    return (MMA_PER_GROUP and _token_tiles(T) == 1 and G <= MMA_GROUP_NW and tiles <= MMA_GROUP_TILES
            and G * 8 * 16 <= SMEM_DOUBLES)


def staging_shapes(T: int, K: int, group: int):
    """Shapes of the (limbs, sx, ex) buffers a launch of T rows needs: limbs uint8 (LIMBS, TP, K),
    sx int64 (TP, G), ex int32 (TP, G), TP = T rounded up to the token block."""
    NTT = _token_tiles(T)
    TP = cdiv(T, 8 * NTT) * 8 * NTT
    G = K // group
    return (LIMBS, TP, K), (TP, G), (TP, G)


def available() -> bool:
    """Whether the current device runs the kernels (integer mma: compute capability >= 8.0; the
    simulator runs their twins: kernels/_mma.py, _dp4a.py, _cp_async.py)."""
    if SIM:
        return True
    try:
        return tuple(cuda.get_current_device().compute_capability) >= (8, 0)
    except Exception:          # no device
        return False


def supports(w, scales, K: int) -> bool:
    """Whether the exact matmul serves a weight (`w` and `scales` as `matmul_exact` takes them) for
    every row count: q4 codes, a group size that is a multiple of 32 up to MAX_GROUP, and the tensor-core
    kernel's chunk partials within a block's shared memory. A shape rule: a backend that asks it
    per weight reduces that weight alike on every path."""
    if scales is None or w.dtype != np.uint8 or w.ndim != 2 or 2 * w.shape[1] != K:
        return False
    G = scales.shape[1]
    if not _groups_ok(K, G):
        return False
    return cdiv(G, chunk_groups(K // G)) * 8 * 16 <= SMEM_DOUBLES


def staging_bound(rows: int, K: int) -> tuple:
    """(limb bytes, group entries) that cover `staging_shapes` for any launch of at most `rows`
    rows with at most K inputs and groups of at least 32 (flat buffers a backend views)."""
    TP = cdiv(max(rows, 1), 8 * MAX_NTT) * 8 * MAX_NTT
    return LIMBS * TP * K, TP * cdiv(K, 32)


def needs_staging(T: int, K: int, group: int, N: int, pair: bool = False) -> bool:
    """Whether a launch of T rows of an (N, K) weight uses the staging buffers (everything but the
    one-row kernel; `pair`: with a pair epilogue)."""
    return not (T == 1 and gemv_fits(K, group, gemv_rows(N, pair)))


def matmul_exact(out, x, w, scales, zeros, limbs=None, sx=None, ex=None, accumulate=False, stream=0,
                 norm_w=None, eps=0.0, epilogue=None):
    """The exact integer matmul of x (T, K) float32 with q4 weight `w` (N, K/2) uint8, `scales`
    float16 (N, G), `zeros` uint8 (N, G); optional fused RMS norm (`norm_w`, `eps`), accumulate,
    or a pair `epilogue` as in `matmul.matmul`. A one-row launch takes the dp4a kernel when
    `gemv_fits`; every other launch is staged through the caller's `limbs`, `sx`, `ex` buffers
    (at least `staging_shapes(T, K, group)`; rows past T are read but only into outputs that are
    never stored: a tensor-core column depends on its own B column only) and runs on tensor
    cores. Both give the same bits (the numerics of tinyloop/model/exact_matmul.py)."""
    op = "matmul_exact"
    check_array(op, "x", x, np.float32, 2)
    T, K = x.shape
    check_array(op, "out", out, np.float32, 2, (T, None))
    N, ep = epilogue_args(op, epilogue, accumulate, out, T)
    check_array(op, "scales", scales, np.float16, 2, (N, None))
    G = scales.shape[1]
    check_array(op, "w", w, np.uint8, 2, (N, K // 2))
    check_array(op, "zeros", zeros, np.uint8, 2, (N, G))
    if not _groups_ok(K, G):
        raise BackendError(f"{op}: in_features={K} with {G} groups: the group size must be a "
                           f"multiple of 32 and at most {MAX_GROUP}")
    group = K // G
    norm = norm_w is not None
    eps = norm_args(op, norm_w, eps, K)
    if w.size >= _MAX_FLAT_BYTES:             # the kernels index flat views with 32-bit offsets
        raise BackendError(f"{op}: a weight of {w.size} bytes; at most {_MAX_FLAT_BYTES - 1}")
    staged = needs_staging(T, K, group, N, epilogue is not None)
    if staged:
        ls, ss, es = staging_shapes(T, K, group)
        if limbs is None or sx is None or ex is None:
            raise BackendError(f"{op}: a launch of {T} rows with in_features={K}, group {group} "
                               f"needs the staging buffers limbs {ls}, sx {ss}, ex {es}")
        check_array(op, "limbs", limbs, np.uint8, 3)
        check_array(op, "sx", sx, np.int64, 2)
        check_array(op, "ex", ex, np.int32, 2)
        if limbs.shape[0] != LIMBS or limbs.shape[2] != K or limbs.shape[1] < ls[1] or \
                sx.shape[0] < ss[0] or sx.shape[1] != G or ex.shape != sx.shape:
            raise BackendError(f"{op}: staging buffers limbs {tuple(limbs.shape)}, sx {tuple(sx.shape)}, "
                               f"ex {tuple(ex.shape)} do not fit {ls}, {ss}")
        if limbs.size >= _MAX_FLAT_BYTES:
            raise BackendError(f"{op}: staging of {limbs.size} bytes; at most {_MAX_FLAT_BYTES - 1}")
        cg = chunk_groups(group)
        nch = cdiv(G, cg)
        NTT = _token_tiles(T)
        while NTT > 1 and nch * NTT * 8 * 16 > SMEM_DOUBLES:
            NTT //= 2
        if nch * NTT * 8 * 16 > SMEM_DOUBLES:
            raise BackendError(f"{op}: in_features={K} needs {nch} chunks; at most "
                               f"{SMEM_DOUBLES // 128} fit a block")
    if T == 0:
        return
    nwx = norm_w if norm else x[0]
    if not staged:
        R = gemv_rows(N, epilogue is not None)
        per_block = GEMV_NW * (R // 2 if epilogue is not None else R)
        units = N // 2 if epilogue is not None else N
        _make_gemv(R, cdiv(K, GEMV_STEP_K), group, norm, epilogue)[cdiv(units, per_block), GEMV_NW * 32, stream](
            out, w.view(np.uint64).reshape(-1), scales.view(np.uint16), zeros, x, nwx, eps, N, 1 if accumulate else 0, ep)
        return
    TB = cdiv(T, 8 * NTT)
    _make_stage(norm)[(cdiv(G, STAGE_NT // 32), T), STAGE_NT, stream](limbs, sx, ex, x, nwx, eps, group)
    w32 = w.view(np.uint32).reshape(-1)
    w64 = w.view(np.uint64).reshape(-1)
    sbits = scales.view(np.uint16)
    l64 = limbs.view(np.uint64).reshape(-1)
    tiles = cdiv(N // 2, 8) if epilogue is not None else cdiv(N, 16)
    # the wide kernel reads token rows up to a multiple of 32: within staging_shapes' rows, which
    # round to 8 * MAX_NTT = 32 from 25 rows on
    wide = (cdiv(tiles, MMA_WIDE_NW), cdiv(T, 8 * WIDE_NTT))
    if T >= MMA_WIDE_T and wide[0] * wide[1] >= MMA_WIDE_BLOCKS:
        _make_mma_wide(group, MMA_WIDE_NW, MMA_WIDE_STAGES, epilogue)[wide, MMA_WIDE_NW * 32, stream](
            out, w32, w64, sbits, zeros, l64, sx.reshape(-1), ex.reshape(-1), T, N, cg, nch, 1 if accumulate else 0, ep)
        return
    if per_group(T, G, tiles):
        # one token tile, few blocks: a warp per group (more loads in flight per SM)
        nwb = min(MMA_GROUP_NW, G)
        kern = _make_mma(NTT, nch, group, nwb, epilogue, NG=G)
    else:
        nwb = mma_warps(nch, NTT)
        kern = _make_mma(NTT, nch, group, nwb, epilogue)
    kern[(tiles, TB), nwb * 32, stream](
        out, w32, w64, sbits, zeros, l64, sx, ex, T, N, cg, nch, 1 if accumulate else 0, ep)


def ptx_signatures(epilogues=()):
    """(name, python function, signature) triples for the PTX compile tests: both staging
    variants, the mma kernel for one and four token tiles and a long row, and each epilogue."""
    sigs = [(f"matmul_exact_stage{'_norm' if norm else ''}", _make_stage(norm).py_func,
             "void(uint8[:, :, ::1], int64[:, ::1], int32[:, ::1], float32[:, ::1], float32[::1], float32, int64)")
            for norm in (False, True)]
    head = ("float32[:, ::1], uint32[::1], uint64[::1], uint16[:, ::1], uint8[:, ::1], uint64[::1], "
            "int64[:, ::1], int32[:, ::1], int64, int64, int64, int64, int64")
    whead = ("float32[:, ::1], uint32[::1], uint64[::1], uint16[:, ::1], uint8[:, ::1], uint64[::1], "
             "int64[::1], int32[::1], int64, int64, int64, int64, int64")
    for NTT, NCH, GS, epi in [(1, 4, 128, None), (4, 4, 128, None), (1, 44, 128, None), (1, 8, 32, None),
                              (2, 4, 96, None), (1, 2, 256, None)] + [(1, 4, 128, e) for e in epilogues]:
        es = "UniTuple(int64, 1)" if epi is None else epi.sig
        tag = "" if epi is None else f"_{epi.name}"
        sigs.append((f"matmul_exact_mma{tag}_{NTT}_{NCH}_{GS}", _make_mma(NTT, NCH, GS, mma_warps(NCH, NTT), epi).py_func,
                     f"void({head}, {es})"))
    # a warp per group (one token tile): 16 and 44 groups of 128, 48 of 32
    for NCH, GS, G, epi in [(4, 128, 16, None), (11, 128, 44, None), (3, 32, 48, None)] + \
            [(4, 128, 16, e) for e in epilogues]:
        es = "UniTuple(int64, 1)" if epi is None else epi.sig
        tag = "" if epi is None else f"_{epi.name}"
        sigs.append((f"matmul_exact_mma_groups{tag}_{G}_{GS}",
                     _make_mma(1, NCH, GS, min(MMA_GROUP_NW, G), epi, NG=G).py_func, f"void({head}, {es})"))
    for GS, epi in [(128, None), (32, None), (96, None), (256, None)] + [(128, e) for e in epilogues]:
        es = "UniTuple(int64, 1)" if epi is None else epi.sig
        tag = "" if epi is None else f"_{epi.name}"
        sigs.append((f"matmul_exact_mma_wide{tag}_{GS}", _make_mma_wide(GS, MMA_WIDE_NW, MMA_WIDE_STAGES, epi).py_func,
                     f"void({whead}, {es})"))
    ghead = ("float32[:, ::1], uint64[::1], uint16[:, ::1], uint8[:, ::1], float32[:, ::1], float32[::1], "
             "float32, int64, int64")
    for NSTEP, GS, norm, epi in [(2, 128, False, None), (2, 64, True, None), (6, 32, True, None), (1, 256, False, None)] + \
            [(2, 128, True, e) for e in epilogues]:
        es = "UniTuple(int64, 1)" if epi is None else epi.sig
        tag = ("_norm" if norm else "") + ("" if epi is None else f"_{epi.name}")
        sigs.append((f"matmul_exact_gemv{tag}_{NSTEP}_{GS}", _make_gemv(GEMV_R, NSTEP, GS, norm, epi).py_func,
                     f"void({ghead}, {es})"))
    return sigs


__all__ = ["matmul_exact", "ptx_signatures", "staging_shapes", "staging_bound", "supports", "available",
           "needs_staging", "gemv_fits", "mma_warps", "MMA_MAX_NW", "MAX_NTT", "MMA_WIDE_T", "MMA_WIDE_NW", "SMEM_DOUBLES", "CHUNK_K"]
