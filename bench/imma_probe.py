"""Feasibility probe: an EXACT integer tensor-core INT4 matmul (int8 mma.sync, sm_80+).

    python bench/imma_probe.py [--quick] [--json out.json]     (JSON also to $OUT/imma_probe.json)

Definition (what the kernel computes, reproduced bit for bit by `imma_reference`). Weights: q4
codes q (uint8 (N, K/2), element 2j in the LOW nibble of byte j), zeros z uint8 (N, G), scales s
float16 (N, G), group GS = 128 along K. Activations x float32 (T, K). Per token t and group g:

* e = the frexp exponent of max |x[t, group]| taken from its float32 bits,
  e = max(biased_exponent, 1) - 126 (so |x| < 2^e; zero / subnormal groups get e = -125);
* m_k = rint(x_k * 2^(P - e)) (in float64: exact scaling, round half to even), |m_k| <= 2^P.
  P = 22: m is written as three balanced signed bytes m = d2 * 65536 + d1 * 256 + d0, each in
  [-128, 127]; that covers [-8421504, 8355711], which holds +-2^22 but not +2^23 (rint can reach
  2^P exactly when max|x| is just below 2^e, so P = 23 would not fit);
* S_p = sum_k q_k * d_p,k exactly in int32 on the tensor core (|S_p| <= 15 * 128 * 128 < 2^18),
  Z = sum_k m_k (int32, |Z| <= 2^29), D = S2 * 65536 + S1 * 256 + S0 - z * Z, formed in float64
  (every term and partial sum is an integer < 2^36: exact);
* the group contributes c = D * s * 2^(e - P) in float64, EXACT (|D| < 2^35 times an 11-bit
  significand < 2^53; the power of two is exact), so fma contraction cannot change it;
* the contributions are summed in float64: the G groups are cut into KS contiguous chunks
  [c*G//KS, (c+1)*G//KS); each chunk sums its groups in ascending order from 0.0, the chunk
  totals are added in ascending chunk order, and the float64 total is rounded once to float32.
  KS (the split-K factor) depends on the weight's shape only (`ks_for`), never on T.

Every within-group sum is exact integer arithmetic, so the order in which the tensor core adds
does not matter: the result is independent of T / the tile a row lands in (batch invariant by
construction; checked: row 0 of every T equals the T=1 row bit for bit) and of the K order inside
an mma, which is therefore permuted freely: a lane's 32-bit weight word (8 nibbles, k0..k7) is
used directly as the B registers ``lo = w & 0x0F0F0F0F`` (k0, k2, k4, k6) and
``hi = (w >> 4) & 0x0F0F0F0F`` (k1, k3, k5, k7); the prep kernel writes the x digit planes in the
matching order.

mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32, g = lane >> 2, t = lane & 3 (PTX ISA "Matrix
Fragments for mma.m16n8k32", verified on the device by `layout_test`):
  A 16x32 (.row): a0 = row g, k 4t..4t+3 (byte i = k 4t+i); a1 = row g+8, same k; a2 = row g,
                  k 16+4t..; a3 = row g+8, k 16+4t..
  B 32x8  (.col): b0 = col g, k 4t..4t+3;  b1 = col g, k 16+4t..
  C 16x8  (s32) : c0, c1 = row g, cols 2t, 2t+1;  c2, c3 = row g+8, cols 2t, 2t+1
Roles: the WEIGHTS are B (8 weight rows per mma = n), x digits are A (16 "rows" m = 4 tokens x 4
columns: column c = token + 4 * plane, planes 0..2, plane 3 zero). A lane (g, t) loads one 16-byte
weight piece of row g per group (4 words = the 4 mma k-steps of the group; word s holds k =
32t + 8s + 0..7 of the group), and per k-step one 16-byte A entry (the 4 registers) that the prep
kernel stored at [m-tile][group][s][lane]. After the 4 mma of a group the lane pair (g, g + 4)
holds the three planes of token g % 4 for weight rows 2t, 2t+1; two shfl_xor(16) give lane g row
2t and lane g + 4 row 2t + 1, each then forms D and its contribution.

Kernel: blocks of NW = 8 warps; warp w takes row tile (8 rows) blockIdx.x * (NW/KS) + w // KS and
K chunk w % KS; the block's KS partials are combined in shared memory in chunk order. blockIdx.y
takes MT m-tiles (4 tokens each). Timing: CUDA graphs of back-to-back launches (L2-resident
weights, and rotating copies > 2x L2 for "HBM").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import cuda, float32, float64, int32, types  # noqa: E402
from numba.cuda import cgutils  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402
from llvmlite import ir  # noqa: E402

P = 22
GS = 128
NW = 8
FULL = 0xFFFFFFFF
SHAPES = {"2048x2048 (wo)": (2048, 2048), "3072x2048 (q|k|v)": (3072, 2048),
          "11264x2048 (gate|up)": (11264, 2048), "2048x5632 (down)": (2048, 5632),
          "50304x2048 (head)": (50304, 2048)}
ROWS = (1, 2, 8, 32, 128)

# ----------------------------------------------------------------------------- intrinsics
_I32 = ir.IntType(32)


def _mma_codegen(context, builder, sig, args):
    vals = [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args)]
    st = ir.LiteralStructType([_I32] * 4)
    fnty = ir.FunctionType(st, [_I32] * 10)
    asm = ("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
           "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
    r = builder.call(ir.InlineAsm(fnty, asm, ",".join(["=r"] * 4 + ["r"] * 10)), vals)
    return context.make_tuple(builder, sig.return_type, [builder.extract_value(r, i) for i in range(4)])


@intrinsic
def mma_s8(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A * B + C for one m16n8k32 s8 tile: 4 A registers, 2 B, 4 C (int32 each)."""
    return types.UniTuple(types.int32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _mma_codegen


def _ld4_codegen(context, builder, sig, args):
    aryty = sig.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    idx = context.cast(builder, args[1], sig.args[1], types.intp)
    ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [idx], wraparound=False)
    addr = builder.ptrtoint(ptr, ir.IntType(64))
    st = ir.LiteralStructType([_I32] * 4)
    fnty = ir.FunctionType(st, [ir.IntType(64)])
    r = builder.call(ir.InlineAsm(fnty, "ld.global.nc.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l"), [addr])
    return context.make_tuple(builder, sig.return_type, [builder.extract_value(r, i) for i in range(4)])


@intrinsic
def ldg4(typingctx, arr, idx):
    """Four int32 at arr[idx .. idx+3] (1-D int32 array, idx % 4 == 0) in one 16-byte
    read-only load."""
    return types.UniTuple(types.int32, 4)(arr, idx), _ld4_codegen


M4 = 0x0F0F0F0F


# ----------------------------------------------------------------------------- kernels
@cuda.jit
def layout_test(out, a, b, c_in):
    """One mma with the documented fragment layouts: a int32 (16, 32) values in [-128, 127],
    b int32 (32, 8), c_in int32 (16, 8); out (16, 8) = a @ b + c_in when the layout is right."""
    lane = cuda.threadIdx.x
    g = lane >> 2
    t = lane & 3
    r0 = 0
    r1 = 0
    r2 = 0
    r3 = 0
    s0 = 0
    s1 = 0
    for i in range(4):
        r0 |= (a[g, 4 * t + i] & 255) << (8 * i)
        r1 |= (a[g + 8, 4 * t + i] & 255) << (8 * i)
        r2 |= (a[g, 16 + 4 * t + i] & 255) << (8 * i)
        r3 |= (a[g + 8, 16 + 4 * t + i] & 255) << (8 * i)
        s0 |= (b[4 * t + i, g] & 255) << (8 * i)
        s1 |= (b[16 + 4 * t + i, g] & 255) << (8 * i)
    d0, d1, d2, d3 = mma_s8(r0, r1, r2, r3, s0, s1, c_in[g, 2 * t], c_in[g, 2 * t + 1],
                            c_in[g + 8, 2 * t], c_in[g + 8, 2 * t + 1])
    out[g, 2 * t] = d0
    out[g, 2 * t + 1] = d1
    out[g + 8, 2 * t] = d2
    out[g + 8, 2 * t + 1] = d3


@cuda.jit(device=True, inline=True)
def group_values(x, tok, grp, lane):
    """One warp over one (token, group): lane's 4 values and the group's e and 2^(P - e)."""
    base = grp * GS + 4 * lane
    v0 = x[tok, base]
    v1 = x[tok, base + 1]
    v2 = x[tok, base + 2]
    v3 = x[tok, base + 3]
    mx = max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3)))
    for o in (16, 8, 4, 2, 1):
        mx = max(mx, cuda.shfl_xor_sync(FULL, mx, o))
    bexp = (cuda.libdevice.float_as_int(mx) >> 23) & 255
    e = max(bexp, 1) - 126
    return v0, v1, v2, v3, e, cuda.libdevice.longlong_as_double(types.int64(1023 + P - e) << 52)


@cuda.jit(device=True, inline=True)
def digits(v, up):
    """m = rint(v * 2^(P - e)) and its balanced signed byte digits d0, d1, d2."""
    m = int32(cuda.libdevice.rint(float64(v) * up))
    d0 = ((m + 128) & 255) - 128
    m1 = (m - d0) >> 8
    d1 = ((m1 + 128) & 255) - 128
    return m, d0, d1, (m1 - d1) >> 8


@cuda.jit(device=True, inline=True)
def store_group(zsum, e, zf, sc, tok, grp, lane):
    """The warp's sum of m as Z, and 2^(e - P), for (token, group)."""
    for o in (16, 8, 4, 2, 1):
        zsum += cuda.shfl_xor_sync(FULL, zsum, o)
    if lane == 0:
        zf[tok, grp] = float64(zsum)
        sc[tok, grp] = cuda.libdevice.longlong_as_double(types.int64(1023 + e - P) << 52)


@cuda.jit
def prep(x, xd8, zf, sc, G):
    """Grid (G, T), one warp: token t = blockIdx.y, group blockIdx.x. Writes the 3 digit planes
    into xd8 (uint8, layout [m-tile][group][s][lane][16 bytes]), Z (float64) and 2^(e-P)."""
    grp = cuda.blockIdx.x
    tok = cuda.blockIdx.y
    lane = cuda.threadIdx.x
    v0, v1, v2, v3, e, up = group_values(x, tok, grp, lane)
    mt = tok >> 2
    tt = tok & 3
    zsum = 0
    for i in range(4):
        v = v0 if i == 0 else (v1 if i == 1 else (v2 if i == 2 else v3))
        m, d0, d1, d2 = digits(v, up)
        zsum += m
        kk = 4 * lane + i
        j8 = kk >> 3
        r = kk & 7
        tq = j8 >> 2
        s = j8 & 3
        ebase = ((mt * G + grp) * 4 + s) * 32
        byte = (r & 1) * 8 + (r >> 1)          # register (odd*2 + half) * 4 + byte, half added below
        # plane 0: column tt -> lane g = tt, half 0; plane 1: column tt + 4 -> g = tt + 4, half 0;
        # plane 2: column tt + 8 -> g = tt, half 1 (register + 1)
        xd8[(ebase + tt * 4 + tq) * 16 + byte] = types.uint8(d0 & 255)
        xd8[(ebase + (tt + 4) * 4 + tq) * 16 + byte] = types.uint8(d1 & 255)
        xd8[(ebase + tt * 4 + tq) * 16 + byte + 4] = types.uint8(d2 & 255)
    store_group(zsum, e, zf, sc, tok, grp, lane)


_MM = {}


def make_mm(MT: int, KS: int):
    """The IMMA matmul for MT m-tiles per block and split-K factor KS (both compile-time)."""
    key = (MT, KS)
    if key in _MM:
        return _MM[key]
    RPB = NW // KS

    @cuda.jit(device=True, inline=True)
    def step(xd, idx, on, lo, hi, c0, c1, c2, c3):
        if on:
            a0, a1, a2, a3 = ldg4(xd, idx)
        else:
            a0 = int32(0)
            a1 = int32(0)
            a2 = int32(0)
            a3 = int32(0)
        return mma_s8(a0, a1, a2, a3, lo, hi, c0, c1, c2, c3)

    @cuda.jit
    def mm(out, wq, scales, zeros, xd, zf, sc, T, N, G, nmt):
        lane = cuda.threadIdx.x & 31
        w = cuda.threadIdx.x >> 5
        kc = w % KS
        rt = cuda.blockIdx.x * RPB + w // KS
        g = lane >> 2
        t = lane & 3
        hi = g >> 2
        orow = rt * 8 + 2 * t + hi
        wrow = rt * 8 + g
        live = rt * 8 < N
        g0 = (kc * G) // KS
        g1 = ((kc + 1) * G) // KS
        mt0 = cuda.blockIdx.y * MT
        KW = G * 16
        acc = cuda.local.array(MT, float64)
        for j in range(MT):
            acc[j] = 0.0
        if live:
            for grp in range(g0, g1):
                w0, w1, w2, w3 = ldg4(wq, wrow * KW + grp * 16 + t * 4)
                l0 = int32(w0 & M4)
                h0 = int32((w0 >> 4) & M4)
                l1 = int32(w1 & M4)
                h1 = int32((w1 >> 4) & M4)
                l2 = int32(w2 & M4)
                h2 = int32((w2 >> 4) & M4)
                l3 = int32(w3 & M4)
                h3 = int32((w3 >> 4) & M4)
                sv = float64(scales[orow, grp])
                zv = float64(zeros[orow, grp])
                for j in range(MT):
                    mt = mt0 + j
                    if mt < nmt:
                        tok = mt * 4 + (g & 3)
                        on = tok < T
                        eb = (((mt * G + grp) * 4) * 32 + lane) * 4
                        c0, c1, c2, c3 = step(xd, eb, on, l0, h0, int32(0), int32(0), int32(0), int32(0))
                        c0, c1, c2, c3 = step(xd, eb + 128, on, l1, h1, c0, c1, c2, c3)
                        c0, c1, c2, c3 = step(xd, eb + 256, on, l2, h2, c0, c1, c2, c3)
                        c0, c1, c2, c3 = step(xd, eb + 384, on, l3, h3, c0, c1, c2, c3)
                        r1 = cuda.shfl_xor_sync(FULL, c1 if hi == 0 else c0, 16)
                        r2 = cuda.shfl_xor_sync(FULL, c3, 16)
                        if hi == 0:
                            p0 = c0
                            p1 = r1
                            p2 = c2
                        else:
                            p0 = r1
                            p1 = c1
                            p2 = r2
                        d = (float64(p2) * 65536.0 + float64(p1) * 256.0 + float64(p0)) - zv * zf[tok, grp]
                        acc[j] += (d * sv) * sc[tok, grp]
        if KS > 1:
            part = cuda.shared.array((NW, MT, 32), float64)
            for j in range(MT):
                part[w, j, lane] = acc[j]
            cuda.syncthreads()
            if kc == 0:
                for j in range(MT):
                    tot = part[w, j, lane]
                    for c in range(1, KS):
                        tot += part[w + c, j, lane]
                    acc[j] = tot
        if live and kc == 0:
            for j in range(MT):
                mt = mt0 + j
                tok = mt * 4 + (g & 3)
                if mt < nmt and tok < T:
                    out[tok, orow] = float32(acc[j])

    _MM[key] = mm
    return mm


def ks_for(N: int, G: int) -> int:
    """Split-K factor from the weight's shape only (enough warps for a one-row launch)."""
    tiles = N // 8
    ks = 8 if tiles <= 512 else 4 if tiles <= 1024 else 2 if tiles <= 2048 else 1
    while ks > 1 and ks > G:
        ks //= 2
    return ks


def mt_for(T: int) -> int:
    nmt = -(-T // 4)
    return 1 if nmt <= 1 else 2 if nmt <= 2 else 4 if nmt <= 4 else 8


class Imma:
    """Device buffers and launchers of the IMMA path for one (N, K) weight and T rows."""

    def __init__(self, T, K, ks, mt=None):
        self.T, self.K, self.G = T, K, K // GS
        self.nmt = -(-T // 4)
        self.mt = mt or mt_for(T)
        self.ks = ks
        self.xd8 = cuda.to_device(np.zeros(self.nmt * self.G * 4 * 32 * 16, np.uint8))
        self.xd = self.xd8.view(np.int32)
        self.zf = cuda.to_device(np.zeros((self.nmt * 4, self.G), np.float64))
        self.sc = cuda.to_device(np.zeros((self.nmt * 4, self.G), np.float64))
        self.kern = make_mm(self.mt, ks)

    def prep(self, x, stream):
        prep[(self.G, self.T), 32, stream](x, self.xd8, self.zf, self.sc, self.G)

    def mm(self, out, wq, s, z, N, stream):
        grid = (-(-(N // 8) // (NW // self.ks)), -(-self.nmt // self.mt))
        self.kern[grid, NW * 32, stream](out, wq, s, z, self.xd, self.zf, self.sc, self.T, N, self.G, self.nmt)


# ----------------------------------------------------------------------------- numpy reference
def unpack_codes(q: np.ndarray) -> np.ndarray:
    N, H = q.shape
    c = np.empty((N, 2 * H), np.uint8)
    c[:, 0::2] = q & 15
    c[:, 1::2] = q >> 4
    return c


def x_digits_ref(x: np.ndarray):
    T, K = x.shape
    xg = np.ascontiguousarray(x, np.float32).reshape(T, K // GS, GS)
    mx = np.abs(xg).max(-1)
    bexp = ((mx.view(np.uint32) >> 23) & 255).astype(np.int64)
    e = np.maximum(bexp, 1) - 126
    m = np.rint(xg.astype(np.float64) * np.ldexp(1.0, P - e)[..., None])
    assert np.abs(m).max() <= 2 ** P
    return m, e, m.sum(-1)          # m, Z are integer-valued float64 (exact)


def group_contrib(codes, scales, zeros, x):
    """c[g, n, t] = D * s * 2^(e - P) (float64, exact) for every group g."""
    m, e, Z = x_digits_ref(x)
    N, K = codes.shape
    G = K // GS
    T = x.shape[0]
    out = np.empty((G, N, T), np.float64)
    for g in range(G):
        qg = codes[:, g * GS:(g + 1) * GS].astype(np.float64)
        S = qg @ m[:, g, :].T                      # integers < 2^35: exact in float64 BLAS
        D = S - zeros[:, g, None].astype(np.float64) * Z[None, :, g]
        out[g] = (D * scales[:, g, None].astype(np.float64)) * np.ldexp(1.0, e[:, g] - P)[None, :]
    return out


def imma_reference(contrib: np.ndarray, ks: int) -> np.ndarray:
    """(T, N) float32: chunked ascending float64 sum of the group contributions (module doc)."""
    G = contrib.shape[0]
    total = None
    for c in range(ks):
        p = np.zeros(contrib.shape[1:], np.float64)
        for g in range((c * G) // ks, ((c + 1) * G) // ks):
            p = p + contrib[g]
        total = p if total is None else total + p
    return total.astype(np.float32).T.copy()


def rel_err(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def same_bits(a, b) -> bool:
    return a.shape == b.shape and bool(np.array_equal(np.ascontiguousarray(a).view(np.uint32),
                                                      np.ascontiguousarray(b).view(np.uint32)))


# ----------------------------------------------------------------------------- timing
def graph_us(stream, fn, n: int) -> float:
    """us per launch of `fn` (n launches on `stream`) replayed as one captured graph."""
    from bench.decode_bench import graph_time_ms
    return graph_time_ms(stream, fn, n) * 1e3


def torch_graph_us(fn, n: int, replays: int = 3) -> float:
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(0)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(replays):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        best = min(best, e0.elapsed_time(e1))
    return best * 1e3 / n


# ----------------------------------------------------------------------------- main
def run_layout_test() -> bool:
    rng = np.random.default_rng(1)
    ok = True
    for trial in range(3):
        a = rng.integers(-128, 128, (16, 32)).astype(np.int32)
        b = rng.integers(-128, 128, (32, 8)).astype(np.int32)
        c = rng.integers(-2 ** 20, 2 ** 20, (16, 8)).astype(np.int32)
        out = cuda.to_device(np.zeros((16, 8), np.int32))
        layout_test[1, 32](out, cuda.to_device(a), cuda.to_device(b), cuda.to_device(c))
        got = out.copy_to_host()
        ok &= bool(np.array_equal(got, a.astype(np.int64) @ b + c))
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, T in 1, 8; no HBM / sweeps")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--rows", default="")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--hbm-rows", default="1,8")
    ap.add_argument("--sweep", action="store_true", help="time every KS at T = 1 and 8")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from tinyloop.model.arch import TensorQuant
    from tinyloop.model.quant import quantize
    from tinyloop.cuda.kernels import matmul as km
    try:
        import torch
        from bench import torch_int4 as ti4
        have_torch = torch.cuda.is_available()
    except Exception as e:           # noqa: BLE001
        print("torch unavailable:", e)
        have_torch = False

    t_start = time.time()
    report = {"P": P, "group": GS, "NW": NW, "rows": []}
    lay = run_layout_test()
    report["layout_ok"] = lay
    print(f"m16n8k32 s8 fragment layout test: {'OK' if lay else 'FAILED'}", flush=True)
    if not lay:
        return 1

    shapes = dict(SHAPES)
    rows = list(ROWS)
    if args.quick:
        shapes = {k: v for k, v in SHAPES.items() if v in ((2048, 2048), (2048, 5632))}
        rows = [1, 3, 8]
    if args.shapes:
        shapes = {k: v for k, v in SHAPES.items() if any(s in k for s in args.shapes.split(","))}
    if args.rows:
        rows = [int(r) for r in args.rows.split(",")]
    hbm_rows = {int(r) for r in args.hbm_rows.split(",") if r} if not args.quick else set()

    stream = cuda.stream()
    rng = np.random.default_rng(0)
    Tmax = max(rows)
    all_ok = True
    for name, (N, K) in shapes.items():
        G = K // GS
        t0 = time.time()
        parts = quantize(rng.standard_normal((N, K), dtype=np.float32) * 0.02, TensorQuant("q4", GS))
        qh, sh, zh = parts["q"], parts["scales"], parts["zeros"]
        codes = unpack_codes(qh)
        wdeq = (codes.reshape(N, G, GS).astype(np.float64) - zh[..., None]) * sh.astype(np.float64)[..., None]
        wdeq = wdeq.reshape(N, K)
        xall = rng.standard_normal((Tmax, K), dtype=np.float32)
        xall[:, ::97] *= 8.0                       # a few larger activations
        contrib_all = group_contrib(codes, sh, zh, xall)
        ref64_all = xall.astype(np.float64) @ wdeq.T
        q_d = cuda.to_device(qh)
        wq_d = cuda.to_device(qh.view(np.int32).reshape(-1))
        s_d, z_d = cuda.to_device(sh), cuda.to_device(zh)
        nbytes = int(qh.nbytes + sh.nbytes + zh.nbytes)
        ks = ks_for(N, G)
        print(f"{name}: setup {time.time() - t0:.1f}s, KS={ks}", flush=True)
        tg = None
        if have_torch:
            try:
                sg, zg = ti4.tinyloop_grid(sh, zh)
                tg = ti4.to_tinygemm(codes, sg, zg)
            except Exception as e:   # noqa: BLE001
                print("  tinygemm packing failed:", e)
        row1 = None
        for T in rows:
            x = xall[:T]
            x_d = cuda.to_device(x)
            out = cuda.device_array((T, N), np.float32)
            im = Imma(T, K, ks)
            im.prep(x_d, stream)
            im.mm(out, wq_d, s_d, z_d, N, stream)
            stream.synchronize()
            got = out.copy_to_host()
            ref = imma_reference(contrib_all[:, :, :T], ks)
            exact = same_bits(got, ref)
            if T == rows[0]:
                row1 = got[0]
            binv = same_bits(got[0], row1)
            ref64 = ref64_all[:T]
            e64 = rel_err(got, ref64)
            tl = cuda.device_array((T, N), np.float32)
            km.matmul(tl, x_d, q_d, s_d, z_d, stream=stream)
            stream.synchronize()
            tlh = tl.copy_to_host()
            e_tl64 = rel_err(tlh, ref64)
            d_tl = rel_err(got, tlh)
            all_ok &= exact and binv
            row = {"shape": name, "N": N, "K": K, "T": T, "KS": ks, "MT": im.mt, "exact_vs_numpy": exact,
                   "row0_equals_T1": binv, "relerr_vs_f64": e64, "tinyloop_relerr_vs_f64": e_tl64,
                   "relerr_imma_vs_tinyloop": d_tl, "weight_bytes": nbytes}
            if not exact:
                bad = np.argwhere(got.view(np.uint32) != ref.view(np.uint32))
                row["mismatches"] = int(len(bad))
                print(f"  MISMATCH T={T}: {len(bad)} elements, first {bad[:3].tolist()} "
                      f"got {got[tuple(bad[0])]} ref {ref[tuple(bad[0])]}", flush=True)
            n = args.reps if T <= 8 else max(10, args.reps // 5)
            row["imma_us"] = graph_us(stream, lambda: [im.mm(out, wq_d, s_d, z_d, N, stream) for _ in range(n)], n)
            row["prep_us"] = graph_us(stream, lambda: [im.prep(x_d, stream) for _ in range(n)], n)
            row["tinyloop_us"] = graph_us(stream, lambda: [km.matmul(tl, x_d, q_d, s_d, z_d, stream=stream)
                                                           for _ in range(n)], n)
            row["imma_GBps"] = nbytes / (row["imma_us"] * 1e-6) / 1e9
            xb = None
            if tg is not None:
                try:
                    xb = torch.from_numpy(x).cuda().to(torch.bfloat16)
                    y = torch.ops.aten._weight_int4pack_mm(xb, tg[0], tg[2], tg[1])
                    row["tinygemm_relerr_vs_f64"] = rel_err(y.float().cpu().numpy(), ref64)
                    row["tinygemm_us"] = torch_graph_us(
                        lambda i: torch.ops.aten._weight_int4pack_mm(xb, tg[0], tg[2], tg[1]), n)
                except Exception as e:   # noqa: BLE001
                    print("  tinygemm failed:", e)
            if args.sweep and T in (1, 8):
                row["ks_sweep_us"] = {}
                for k2 in (1, 2, 4, 8):
                    if k2 > G:
                        continue
                    im2 = Imma(T, K, k2)
                    im2.prep(x_d, stream)
                    o2 = cuda.device_array((T, N), np.float32)
                    us = graph_us(stream, lambda: [im2.mm(o2, wq_d, s_d, z_d, N, stream) for _ in range(n)], n)
                    ok2 = same_bits(o2.copy_to_host(), imma_reference(contrib_all[:, :, :T], k2))
                    row["ks_sweep_us"][k2] = us
                    all_ok &= ok2
                    print(f"    KS={k2}: {us:.2f} us exact={ok2}", flush=True)
            if T in hbm_rows:
                nc = max(2, math.ceil(240e6 / nbytes))
                cop = [(cuda.to_device(qh.view(np.int32).reshape(-1)), cuda.to_device(sh), cuda.to_device(zh),
                        cuda.to_device(qh)) for _ in range(nc)]
                nn = max(n, 2 * nc) if nc <= 100 else nc
                row["hbm_copies"] = nc
                row["imma_hbm_us"] = graph_us(stream, lambda: [im.mm(out, cop[i % nc][0], cop[i % nc][1],
                                                                     cop[i % nc][2], N, stream)
                                                               for i in range(nn)], nn)
                row["tinyloop_hbm_us"] = graph_us(stream, lambda: [km.matmul(tl, x_d, cop[i % nc][3], cop[i % nc][1],
                                                                             cop[i % nc][2], stream=stream)
                                                                   for i in range(nn)], nn)
                row["imma_hbm_GBps"] = nbytes / (row["imma_hbm_us"] * 1e-6) / 1e9
                del cop
                if tg is not None and xb is not None:
                    try:
                        tgs = [ti4.to_tinygemm(codes, sg, zg) for _ in range(nc)]
                        row["tinygemm_hbm_us"] = torch_graph_us(
                            lambda i: torch.ops.aten._weight_int4pack_mm(xb, tgs[i % nc][0], tgs[i % nc][2],
                                                                         tgs[i % nc][1]), nn)
                        del tgs
                    except Exception as e:   # noqa: BLE001
                        print("  tinygemm hbm failed:", e)
            report["rows"].append(row)
            f = lambda k: f"{row[k]:8.2f}" if k in row else "     n/a"   # noqa: E731
            print(f"  T={T:<4} exact={exact} binv={binv} err64={e64:.2e} tl_err64={e_tl64:.2e} "
                  f"imma-vs-tl={d_tl:.2e} | imma {f('imma_us')} prep {f('prep_us')} tinyloop {f('tinyloop_us')} "
                  f"tinygemm {f('tinygemm_us')} | {row['imma_GBps']:6.0f} GB/s"
                  + (f" | HBM imma {f('imma_hbm_us')} tl {f('tinyloop_hbm_us')} tg {f('tinygemm_hbm_us')}"
                     if 'imma_hbm_us' in row else ""), flush=True)
        del contrib_all, ref64_all, wdeq
    report["all_exact"] = all_ok
    report["wall_s"] = time.time() - t_start

    print("\nshape                   T     imma_us  prep_us  tinyloop_us  tinygemm_us  imma_GB/s | HBM: imma  tinyloop  tinygemm")
    for r in report["rows"]:
        g = lambda k: f"{r[k]:9.2f}" if k in r else "      n/a"   # noqa: E731
        print(f"{r['shape']:22} {r['T']:4} {g('imma_us')} {g('prep_us')} {g('tinyloop_us')}    {g('tinygemm_us')}"
              f"  {r['imma_GBps']:8.0f} | {g('imma_hbm_us')} {g('tinyloop_hbm_us')} {g('tinygemm_hbm_us')}")
    print(f"all exact / batch-invariant: {all_ok}; wall {report['wall_s']:.0f}s")
    dest = args.json or (os.path.join(os.environ["OUT"], "imma_probe.json") if os.environ.get("OUT") else None)
    if dest:
        Path(dest).write_text(json.dumps(report, indent=2))
    return 0 if all_ok else 2


if __name__ == "__main__":
    raise SystemExit(main())
