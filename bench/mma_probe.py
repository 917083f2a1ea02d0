"""Prototype of the exact integer tensor-core matmul (docs/KERNELS.md, "Exact integer matmul"):
q4 weights x activations staged as three signed 7-bit limbs per element, int8 mma.sync, group
sums exact in int32/int64, groups combined in float64 in a fixed order. Checks the result bit for
bit against a numpy model of the same numerics, reports the error of both this kernel and the
fast fp32 kernel against float64, and times both inside captured graphs on the 360m shapes.

    python bench/mma_probe.py [--rows 1,2,4,8,16,32,128] [--cg 2,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"6144x2048": (6144, 2048), "2048x2048": (2048, 2048), "11264x2048": (11264, 2048),
          "2048x5632": (2048, 5632), "50304x2048": (50304, 2048)}
GS = 128           # weight group = x exponent group
LIMB_BITS = 7
XBITS = 20         # |X| <= 2^20 after scaling by 2^(XBITS - E)
TOK_TILES = 4      # token tiles of 8 per warp (32 tokens); more tokens -> grid.y


def exp_of(m: np.ndarray) -> np.ndarray:
    """E with m < 2^E (frexp's exponent for normal m; subnormals and 0 use the smallest normal's)."""
    bits = m.astype(np.float32).view(np.int32)
    eb = (bits >> 23) & 0xFF
    return np.maximum(eb, 1) - 126


def reference(x: np.ndarray, q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, CG: int) -> np.ndarray:
    """The numerics in numpy: exact integer group sums, float64 group terms added in group order
    within a chunk of CG groups, chunks added in order, one rounding to float32."""
    T, K = x.shape
    N = q.shape[0]
    G = K // GS
    xg = x.reshape(T, G, GS)
    E = exp_of(np.abs(xg).max(axis=2))                                  # (T, G)
    X = np.rint(xg.astype(np.float64) * np.ldexp(1.0, XBITS - E)[:, :, None]).astype(np.int64)
    SX = X.sum(axis=2)                                                  # (T, G)
    qg = q.reshape(N, G, GS).astype(np.float64)
    Xf = X.astype(np.float64)
    # every partial sum is an integer below 2^28: exact in float64 in any order (BLAS is fine)
    V = np.stack([(Xf[:, g, :] @ qg[:, g, :].T).astype(np.int64) for g in range(G)], axis=2)
    V = V - zeros.astype(np.int64)[None] * SX[:, None, :]
    sp = scales.astype(np.float64)[None] * np.ldexp(1.0, E - XBITS)[:, None, :]   # (T, N, G)
    d = V.astype(np.float64) * sp
    total = np.zeros((T, N))
    for c in range(G // CG):
        acc = np.zeros((T, N))
        for g in range(c * CG, (c + 1) * CG):
            acc = acc + d[:, :, g]
        total = total + acc
    return total.astype(np.float32)


def build(NTT: int):
    from numba import cuda, float64, int32, int64, uint32, uint64

    from tinyloop.cuda.kernels._mma import mma_u8s8

    M = uint32(0x0F0F0F0F)
    LO = uint64(0xFFFFFFFF)
    NL = 3
    NACC = NTT * 4
    NIA = NL * NTT * 4

    @cuda.jit
    def stage(x, limbs8, sx, pw, K):
        g = cuda.blockIdx.x
        t = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        k = g * GS + tid
        v = x[t, k]
        sm = cuda.shared.array(GS, np.float32)
        si = cuda.shared.array(GS, np.int32)
        sm[tid] = abs(v)
        cuda.syncthreads()
        s = GS // 2
        while s > 0:
            if tid < s:
                sm[tid] = max(sm[tid], sm[tid + s])
            cuda.syncthreads()
            s //= 2
        bits = cuda.libdevice.float_as_int(sm[0])
        eb = (bits >> 23) & 0xFF
        E = max(eb, 1) - 126
        X = int32(cuda.libdevice.rint(float64(v) * cuda.libdevice.ldexp(1.0, XBITS - E)))
        l2 = ((X + 64) & 127) - 64
        X1 = (X - l2) >> 7
        l1 = ((X1 + 64) & 127) - 64
        l0 = (X1 - l1) >> 7
        pos = (k & ~7) + ((k & 7) >> 1) + (k & 1) * 4
        limbs8[0, t, pos] = l0 & 0xFF
        limbs8[1, t, pos] = l1 & 0xFF
        limbs8[2, t, pos] = l2 & 0xFF
        si[tid] = X
        cuda.syncthreads()
        s = GS // 2
        while s > 0:
            if tid < s:
                si[tid] += si[tid + s]
            cuda.syncthreads()
            s //= 2
        if tid == 0:
            sx[t, g] = si[0]
            pw[t, g] = cuda.libdevice.ldexp(1.0, E - XBITS)

    @cuda.jit
    def mm(part, w64, scales, zeros, limbs64, sx, pw, N, T, nchunk, CG):
        lane = cuda.threadIdx.x & 31
        warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> 5
        tok0 = cuda.blockIdx.y * (8 * NTT)
        tile = warp // nchunk
        chunk = warp - tile * nchunk
        if tile * 16 >= N:
            return
        gid = lane >> 2
        tig = lane & 3
        r0 = tile * 16 + gid
        r1 = r0 + 8
        acc = cuda.local.array(NACC, float64)
        for i in range(NACC):
            acc[i] = 0.0
        ia = cuda.local.array(NIA, int32)
        for gi in range(CG):
            grp = chunk * CG + gi
            wi = grp * 8 + tig * 2
            wa = (w64[r0, wi], w64[r0, wi + 1])
            wb = (w64[r1, wi], w64[r1, wi + 1])
            for i in range(NIA):
                ia[i] = 0
            for j in range(4):
                sh = uint64((j & 1) * 32)
                u0 = uint32((wa[j >> 1] >> sh) & LO)
                u1 = uint32((wb[j >> 1] >> sh) & LO)
                a0 = uint32(u0 & M)
                a2 = uint32((u0 >> uint32(4)) & M)
                a1 = uint32(u1 & M)
                a3 = uint32((u1 >> uint32(4)) & M)
                li = (grp * GS + tig * 32 + j * 8) >> 3
                for tt in range(NTT):
                    tok = tok0 + tt * 8 + gid
                    for L in range(NL):
                        bw = limbs64[L, tok, li]
                        b0 = uint32(bw & LO)
                        b1 = uint32(bw >> uint64(32))
                        base = (L * NTT + tt) * 4
                        d = mma_u8s8(a0, a1, a2, a3, b0, b1, ia[base], ia[base + 1], ia[base + 2], ia[base + 3])
                        ia[base] = d[0]
                        ia[base + 1] = d[1]
                        ia[base + 2] = d[2]
                        ia[base + 3] = d[3]
            s0 = float64(scales[r0, grp])
            s1 = float64(scales[r1, grp])
            z0 = int64(zeros[r0, grp])
            z1 = int64(zeros[r1, grp])
            for tt in range(NTT):
                for c in range(2):
                    tok = tok0 + tt * 8 + tig * 2 + c
                    p = pw[tok, grp]
                    sxv = int64(sx[tok, grp])
                    for h in range(2):
                        idx = h * 2 + c
                        z = z0 if h == 0 else z1
                        s = s0 if h == 0 else s1
                        v = ((int64(ia[tt * 4 + idx]) << 14) + (int64(ia[(NTT + tt) * 4 + idx]) << 7)
                             + int64(ia[(2 * NTT + tt) * 4 + idx]) - z * sxv)
                        acc[tt * 4 + idx] += float64(v) * (s * p)
        for tt in range(NTT):
            for idx in range(4):
                tok = tok0 + tt * 8 + tig * 2 + (idx & 1)
                row = r0 if idx < 2 else r1
                if tok < T:
                    part[chunk, tok, row] = acc[tt * 4 + idx]

    @cuda.jit
    def reduce(out, part, nchunk, T, N):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i >= T * N:
            return
        t = i // N
        n = i - t * N
        a = 0.0
        for c in range(nchunk):
            a += part[c, t, n]
        out[t, n] = np.float32(a)

    return stage, mm, reduce


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,128")
    ap.add_argument("--cg", default="2,4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = [int(t) for t in args.rows.split(",")]
    cgs = [int(c) for c in args.cg.split(",")]
    from numba import cuda

    from bench.decode_bench import graph_time_ms
    from tinyloop.cuda.kernels import matmul as km
    from tinyloop.model.arch import TensorQuant
    from tinyloop.model.quant import dequantize, quantize, unpack
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    kernels = {}
    results = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        G = K // GS
        w = rng.standard_normal((N, K), dtype=np.float32) * 0.02
        tq = TensorQuant("q4", GS)
        parts = quantize(w, tq)
        wdq = dequantize(parts, tq, (N, K)).astype(np.float64)
        qcodes = unpack(parts["q"], 4, K)
        q, s, z = (cuda.to_device(parts[k]) for k in ("q", "scales", "zeros"))
        w64 = cuda.to_device(np.ascontiguousarray(parts["q"]).view(np.uint64))
        for T in rows:
            NTT = min(TOK_TILES, -(-T // 8))
            TB = -(-T // (8 * NTT))
            TP = TB * 8 * NTT
            if NTT not in kernels:
                kernels[NTT] = build(NTT)
            stage, mm, red = kernels[NTT]
            xh = rng.standard_normal((T, K), dtype=np.float32)
            xh[:, ::97] *= 30.0                      # a few large activations, as real models have
            x = cuda.to_device(xh)
            out = cuda.device_array((T, N), np.float32)
            limbs8 = cuda.to_device(np.zeros((3, TP, K), np.uint8))
            limbs64 = cuda.devicearray.DeviceNDArray((3, TP, K // 8), (TP * K, K, 8), np.uint64,
                                                     gpu_data=limbs8.gpu_data)
            sx = cuda.to_device(np.zeros((TP, G), np.int32))
            pw = cuda.to_device(np.zeros((TP, G), np.float64))

            def run_fast():
                for _ in range(args.reps):
                    km.matmul(out, x, q, s, z, stream=stream)
            us_fast = graph_time_ms(stream, run_fast, args.reps) * 1e3
            ref_fast = out.copy_to_host()
            exact = xh.astype(np.float64) @ wdq.T
            scale = np.abs(exact).max()
            err_fast = float(np.abs(ref_fast - exact).max() / scale)
            for CG in cgs:
                if G % CG:
                    continue
                nchunk = G // CG
                part = cuda.device_array((nchunk, TP, N), np.float64)
                warps = (N // 16) * nchunk
                grid = (-(-warps // 4), TB)

                def run_stage():
                    for _ in range(args.reps):
                        stage[(G, T), GS, stream](x, limbs8, sx, pw, K)

                def run_mm():
                    for _ in range(args.reps):
                        mm[grid, 128, stream](part, w64, s, z, limbs64, sx, pw, N, T, nchunk, CG)

                def run_all():
                    for _ in range(args.reps):
                        stage[(G, T), GS, stream](x, limbs8, sx, pw, K)
                        mm[grid, 128, stream](part, w64, s, z, limbs64, sx, pw, N, T, nchunk, CG)
                        red[-(-(T * N) // 256), 256, stream](out, part, nchunk, T, N)
                try:
                    us_all = graph_time_ms(stream, run_all, args.reps) * 1e3
                    us_mm = graph_time_ms(stream, run_mm, args.reps) * 1e3
                    us_st = graph_time_ms(stream, run_stage, args.reps) * 1e3
                except Exception as e:   # report and go on: this is a probe
                    print(f"{name} T={T} CG={CG}: FAILED {type(e).__name__}: {e}", flush=True)
                    results.append({"shape": name, "T": T, "CG": CG, "error": f"{type(e).__name__}: {e}"})
                    continue
                run_all()
                stream.synchronize()
                got = out.copy_to_host()
                want = reference(xh, qcodes, parts["scales"], parts["zeros"], CG)
                same = bool(np.array_equal(got, want))
                nbad = int((got != want).sum())
                err_mma = float(np.abs(got.astype(np.float64) - exact).max() / scale)
                r = {"shape": name, "T": T, "CG": CG, "fast_us": us_fast, "mma_us": us_all, "mma_kernel_us": us_mm,
                     "stage_us": us_st, "speedup": us_fast / us_all, "bit_exact_vs_numpy": same, "mismatches": nbad,
                     "err_fast": err_fast, "err_mma": err_mma}
                results.append(r)
                print(f"{name:11} T={T:<3} CG={CG}  fast {us_fast:7.1f} us  mma {us_all:7.1f} us "
                      f"(kernel {us_mm:6.1f}, stage {us_st:5.1f})  x{us_fast / us_all:5.2f}  exact={same} "
                      f"({nbad} off)  err fast {err_fast:.1e} mma {err_mma:.1e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
