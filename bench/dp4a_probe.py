"""Feasibility probe: the exact integer INT4 matmul of bench/imma_probe.py at T = 1 on the CUDA
cores, with dp4a (four byte products and an int32 add in one instruction).

    python bench/dp4a_probe.py [--shapes 360m,ouro,big] [--json out.json]   (JSON also to $OUT/dp4a_probe.json)

Why: imma_probe.py defines a matmul whose result does not depend on the order of its additions
inside a quantization group (22-bit integer digits of x, exact int32 sums, exact float64 group
contributions summed in an order fixed by the weight's shape), so tensor cores serve T > 1 while
keeping batch invariance. At T = 1 its mma kernel wastes 15 of 16 tensor-core rows and measured
4-9 % slower than tinyloop's CUDA-core GEMV. This probe computes the same definition, bit for
bit, with one dp4a per 4 nibbles and digit plane: per 8-nibble weight word 3 logic ops
(``lo = w & 0x0F0F0F0F`` holds elements 0, 2, 4, 6; ``hi = (w >> 4) & 0x0F0F0F0F`` 1, 3, 5, 7)
and 6 dp4a (3 planes x 2 halves), against ~7 instructions per ELEMENT in tinyloop's fp32
GEMV (docs/KERNELS.md: the wide GEMVs look issue-bound). If it is faster at T = 1 the whole
matmul family can move to the exact definition: dp4a for T = 1, mma for T > 1, the same bits.

Layout. x digits per token: int32 xq[t][g][sub 0..3][plane-half 0..5][word 0..3]; plane-half
2p + h holds, for weight word j = 4 sub + word of group g, the 4 bytes d_p[8j + h], d_p[8j + 2 + h],
d_p[8j + 4 + h], d_p[8j + 6 + h] (h = 0 even elements, 1 odd), matching the nibble order of lo / hi.
Z and 2^(e - P) per (token, group) as imma_probe.prep writes them (float64).

Kernel: blocks of NWD warps, warp w takes R consecutive weight rows. Lane (gl = lane >> 2,
sub = lane & 3) takes words 4 sub .. 4 sub + 3 of group 8 it + gl (16 contiguous bytes: a warp
reads 512 contiguous bytes of a row per step), loads its 24 x words once per step for all R rows,
sums q * digit per plane in int32 (|S| < 2^18), and the 4 lanes of a group add their sums with two
xor shuffles (exact). Lane sub = 0 forms D and the group's float64 contribution (exact) into
shared memory; then lane (r, c) sums chunk c of row r's groups ascending, and lane r adds the
chunk totals ascending: imma_reference's order, with KS = imma_probe.ks_for(N, G).
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

from numba import config, cuda, float32, float64, int32, types  # noqa: E402

from bench import imma_probe as ip  # noqa: E402

GS = ip.GS
P = ip.P
M4 = ip.M4
FULL = ip.FULL

SHAPES = {
    "360m": {"wo 2048x2048": (2048, 2048), "q|k|v 3072x2048": (3072, 2048),
             "gate|up 11264x2048": (11264, 2048), "down 2048x5632": (2048, 5632)},
    "ouro": {"q|k|v 6144x2048": (6144, 2048), "down 2048x5632": (2048, 5632)},
    "big": {"huginn-like wo 5120x5120": (5120, 5120), "huginn-like gate|up 35840x5120": (35840, 5120),
            "huginn-like down 5120x17920": (5120, 17920 - 17920 % GS)},
}
#: (R rows per warp, NWD warps per block, weight loads hoisted)
CONFIGS = ((1, 4, False), (2, 4, False), (4, 4, False), (2, 8, False), (1, 4, True), (2, 4, True), (4, 4, True),
           (2, 8, True))

# ----------------------------------------------------------------------------- dp4a
from tinyloop.cuda.kernels._dp4a import dp4a_us  # noqa: E402  (the package's intrinsic and twin)

if config.ENABLE_CUDASIM:
    def ldg4(arr, idx):
        return arr[idx], arr[idx + 1], arr[idx + 2], arr[idx + 3]
else:
    ldg4 = ip.ldg4


# ----------------------------------------------------------------------------- kernels
@cuda.jit
def prep_dp4a(x, xq8, zf, sc, G):
    """Grid (G, T), one warp: the digits of imma_probe.prep in the dp4a layout (module doc)."""
    grp = cuda.blockIdx.x
    tok = cuda.blockIdx.y
    lane = cuda.threadIdx.x
    v0, v1, v2, v3, e, up = ip.group_values(x, tok, grp, lane)
    zsum = 0
    tbase = tok * 96 * G
    for i in range(4):
        v = v0 if i == 0 else (v1 if i == 1 else (v2 if i == 2 else v3))
        m, d0, d1, d2 = ip.digits(v, up)
        zsum += m
        kk = 4 * lane + i
        jw = kk >> 3
        r = kk & 7
        sub = jw >> 2
        wi = jw & 3
        h = r & 1
        byte = r >> 1
        for p in range(3):
            d = d0 if p == 0 else (d1 if p == 1 else d2)
            idx = tbase + ((grp * 4 + sub) * 6 + 2 * p + h) * 4 + wi
            xq8[idx * 4 + byte] = types.uint8(d & 255)
    ip.store_group(zsum, e, zf, sc, tok, grp, lane)


_MM = {}


#: weight words a lane may hold loaded ahead (the hoisted form's register budget)
WREG = 64


def hoist_for(R: int, G: int, hoist: bool) -> int:
    """Steps (of 8 groups) whose weight words a lane loads before using any: 1, or as many as
    WREG registers hold."""
    steps = -(-G // 8)
    return max(1, min(steps, WREG // (4 * R), 8 if R == 1 else 4)) if hoist else 1   # (fully unrolled: no local memory)


def make_dp4a(R: int, NWD: int, GMAX: int, HI: int):
    """The T = 1 dp4a matmul for R rows per warp, NWD warps per block, at most GMAX groups per
    row (the shared buffer of group contributions) and HI steps of weight words loaded before
    any is used (HI = 1: each row's 16 bytes loaded just before its dp4a), all compile-time.
    HI > 1 tests whether the kernel is bound by loads in flight: a lane issues HI * R independent
    16-byte loads back to back, then decodes them."""
    key = (R, NWD, GMAX, HI)
    if key in _MM:
        return _MM[key]
    assert R * 8 <= 32
    WB = HI * R * 4

    @cuda.jit
    def mm(out, wq, scales, zeros, xq, zf, sc, N, G, KS):
        lane = cuda.threadIdx.x & 31
        w = cuda.threadIdx.x >> 5
        row0 = (cuda.blockIdx.x * NWD + w) * R
        gl = lane >> 2
        sub = lane & 3
        KW = G * 16
        cs = cuda.shared.array((NWD, R, GMAX), float64)
        ps = cuda.shared.array((NWD, R, 8), float64)
        xr = cuda.local.array(24, int32)
        wb = cuda.local.array(WB, int32)
        if row0 < N:
            steps = (G + 7) // 8
            for ch in range((steps + HI - 1) // HI):
                for i in range(HI):
                    g = (ch * HI + i) * 8 + gl
                    for r in range(R):
                        row = row0 + r
                        if g < G and row < N:
                            w0, w1, w2, w3 = ldg4(wq, row * KW + g * 16 + sub * 4)
                        else:
                            w0 = int32(0)
                            w1 = int32(0)
                            w2 = int32(0)
                            w3 = int32(0)
                        o = (i * R + r) * 4
                        wb[o] = w0
                        wb[o + 1] = w1
                        wb[o + 2] = w2
                        wb[o + 3] = w3
                for i in range(HI):
                    g = (ch * HI + i) * 8 + gl
                    on = g < G
                    if on:
                        xb = (g * 4 + sub) * 24
                        for v in range(6):
                            a0, a1, a2, a3 = ldg4(xq, xb + 4 * v)
                            xr[4 * v] = a0
                            xr[4 * v + 1] = a1
                            xr[4 * v + 2] = a2
                            xr[4 * v + 3] = a3
                    for r in range(R):
                        row = row0 + r
                        s0 = int32(0)
                        s1 = int32(0)
                        s2 = int32(0)
                        if on and row < N:
                            o = (i * R + r) * 4
                            for j in range(4):
                                wd = wb[o + j]
                                lo = int32(wd & M4)
                                hi = int32((wd >> 4) & M4)
                                s0 = dp4a_us(lo, xr[j], s0)
                                s0 = dp4a_us(hi, xr[4 + j], s0)
                                s1 = dp4a_us(lo, xr[8 + j], s1)
                                s1 = dp4a_us(hi, xr[12 + j], s1)
                                s2 = dp4a_us(lo, xr[16 + j], s2)
                                s2 = dp4a_us(hi, xr[20 + j], s2)
                        s0 += cuda.shfl_xor_sync(FULL, s0, 1)
                        s1 += cuda.shfl_xor_sync(FULL, s1, 1)
                        s2 += cuda.shfl_xor_sync(FULL, s2, 1)
                        s0 += cuda.shfl_xor_sync(FULL, s0, 2)
                        s1 += cuda.shfl_xor_sync(FULL, s1, 2)
                        s2 += cuda.shfl_xor_sync(FULL, s2, 2)
                        if on and sub == 0 and row < N:
                            d = (float64(s2) * 65536.0 + float64(s1) * 256.0 + float64(s0)) \
                                - float64(zeros[row, g]) * zf[0, g]
                            cs[w, r, g] = (d * float64(scales[row, g])) * sc[0, g]
            cuda.syncwarp()
            rr = lane >> 3
            c = lane & 7
            if rr < R and c < KS and row0 + rr < N:
                p = 0.0
                for g in range((c * G) // KS, ((c + 1) * G) // KS):
                    p += cs[w, rr, g]
                ps[w, rr, c] = p
            cuda.syncwarp()
            if lane < R and row0 + lane < N:
                tot = ps[w, lane, 0]
                for c2 in range(1, KS):
                    tot += ps[w, lane, c2]
                out[0, row0 + lane] = float32(tot)

    _MM[key] = mm
    return mm


class Dp4a:
    """Device buffers and launchers of the dp4a path for one (N, K) weight at T = 1."""

    def __init__(self, K, ks, R=2, NWD=4, hoist=False):
        self.K, self.G, self.ks, self.R, self.NWD = K, K // GS, ks, R, NWD
        self.xq8 = cuda.to_device(np.zeros(96 * self.G * 4, np.uint8))
        self.xq = self.xq8.view(np.int32)
        self.zf = cuda.to_device(np.zeros((1, self.G), np.float64))
        self.sc = cuda.to_device(np.zeros((1, self.G), np.float64))
        self.hi = hoist_for(R, self.G, hoist)
        self.kern = make_dp4a(R, NWD, -(-self.G // 32) * 32, self.hi)

    def prep(self, x, stream):
        prep_dp4a[(self.G, 1), 32, stream](x, self.xq8, self.zf, self.sc, self.G)

    def mm(self, out, wq, s, z, N, stream):
        grid = -(-N // (self.R * self.NWD))
        self.kern[grid, self.NWD * 32, stream](out, wq, s, z, self.xq, self.zf, self.sc, N, self.G, self.ks)


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="360m,ouro,big", help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--no-hbm", action="store_true")
    ap.add_argument("--check-only", action="store_true", help="exactness only (simulator-friendly)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from tinyloop.model.arch import TensorQuant
    from tinyloop.model.quant import quantize
    from tinyloop.cuda.kernels import matmul as km
    have_torch = False
    if not args.check_only:
        try:
            import torch
            from bench import torch_int4 as ti4
            have_torch = torch.cuda.is_available()
        except Exception as e:           # noqa: BLE001
            print("torch unavailable:", e)

    t_start = time.time()
    report = {"P": P, "group": GS, "configs": [list(c) for c in CONFIGS], "rows": []}
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    all_ok = True
    shapes = {}
    for s in args.shapes.split(","):
        shapes.update(SHAPES[s] if s in SHAPES else {s: tuple(int(v) for v in s.split("x"))})
    for name, (N, K) in shapes.items():
        G = K // GS
        t0 = time.time()
        parts = quantize(rng.standard_normal((N, K), dtype=np.float32) * 0.02, TensorQuant("q4", GS))
        qh, sh, zh = parts["q"], parts["scales"], parts["zeros"]
        codes = ip.unpack_codes(qh)
        x = rng.standard_normal((1, K), dtype=np.float32)
        x[:, ::97] *= 8.0
        ks = ip.ks_for(N, G)
        ref = ip.imma_reference(ip.group_contrib(codes, sh, zh, x), ks)
        wdeq = ((codes.reshape(N, G, GS).astype(np.float64) - zh[..., None])
                * sh.astype(np.float64)[..., None]).reshape(N, K)
        ref64 = x.astype(np.float64) @ wdeq.T
        del wdeq
        q_d = cuda.to_device(qh)
        wq_d = cuda.to_device(qh.view(np.int32).reshape(-1))
        s_d, z_d = cuda.to_device(sh), cuda.to_device(zh)
        x_d = cuda.to_device(x)
        nbytes = int(qh.nbytes + sh.nbytes + zh.nbytes)
        row = {"shape": name, "N": N, "K": K, "KS": ks, "weight_bytes": nbytes, "configs": {}}
        print(f"{name}: setup {time.time() - t0:.1f}s, KS={ks}", flush=True)
        out = cuda.device_array((1, N), np.float32)
        n = args.reps
        dps = {}
        for (R, NWD, hoist) in CONFIGS:
            key = f"{R}x{NWD}" + ("h" if hoist else "")
            dp = dps[key] = Dp4a(K, ks, R, NWD, hoist)
            dp.prep(x_d, stream)
            dp.mm(out, wq_d, s_d, z_d, N, stream)
            stream.synchronize()
            got = out.copy_to_host()
            exact = ip.same_bits(got, ref)
            all_ok &= exact
            cfg = {"exact_vs_reference": exact, "relerr_vs_f64": ip.rel_err(got, ref64)}
            if not exact:
                bad = np.argwhere(got.view(np.uint32) != ref.view(np.uint32))
                cfg["mismatches"] = int(len(bad))
                print(f"  MISMATCH {key}: {len(bad)}, first {bad[:3].tolist()} "
                      f"got {got[tuple(bad[0])]} ref {ref[tuple(bad[0])]}", flush=True)
            if not args.check_only:
                cfg["us"] = ip.graph_us(stream, lambda: [dp.mm(out, wq_d, s_d, z_d, N, stream) for _ in range(n)], n)
                cfg["prep_us"] = ip.graph_us(stream, lambda: [dp.prep(x_d, stream) for _ in range(n)], n)
            cfg["hoisted_steps"] = dp.hi
            row["configs"][key] = cfg
            print(f"  dp4a {key} (hoisted steps {dp.hi}): exact={exact} err64={cfg['relerr_vs_f64']:.2e}"
                  + (f" {cfg['us']:.2f} us (prep {cfg['prep_us']:.2f})" if "us" in cfg else ""), flush=True)
        if args.check_only:
            report["rows"].append(row)
            continue
        best = min(row["configs"], key=lambda k: row["configs"][k]["us"])
        best_plain = min((k for k in row["configs"] if not k.endswith("h")), key=lambda k: row["configs"][k]["us"])
        best_hoist = min((k for k in row["configs"] if k.endswith("h")), key=lambda k: row["configs"][k]["us"])
        row.update(best=best, best_plain=best_plain, best_hoisted=best_hoist)
        dp, dph = dps[best_plain], dps[best_hoist]
        dp.prep(x_d, stream)
        dph.prep(x_d, stream)
        tl = cuda.device_array((1, N), np.float32)
        km.matmul(tl, x_d, q_d, s_d, z_d, stream=stream)
        stream.synchronize()
        row["tinyloop_relerr_vs_f64"] = ip.rel_err(tl.copy_to_host(), ref64)
        row["dp4a_us"] = row["configs"][best_plain]["us"]
        row["dp4a_hoisted_us"] = row["configs"][best_hoist]["us"]
        row["tinyloop_us"] = ip.graph_us(stream, lambda: [km.matmul(tl, x_d, q_d, s_d, z_d, stream=stream)
                                                          for _ in range(n)], n)
        im = ip.Imma(1, K, ks)
        im.prep(x_d, stream)
        row["imma_us"] = ip.graph_us(stream, lambda: [im.mm(out, wq_d, s_d, z_d, N, stream) for _ in range(n)], n)
        tg = xb = None
        if have_torch:
            try:
                sg, zg = ti4.tinyloop_grid(sh, zh)
                tg = ti4.to_tinygemm(codes, sg, zg)
                xb = torch.from_numpy(x).cuda().to(torch.bfloat16)
                row["tinygemm_us"] = ip.torch_graph_us(
                    lambda i: torch.ops.aten._weight_int4pack_mm(xb, tg[0], tg[2], tg[1]), n)
            except Exception as e:   # noqa: BLE001
                print("  tinygemm failed:", e)
                tg = None
        if not args.no_hbm:
            nc = max(2, math.ceil(240e6 / nbytes))
            cop = [(cuda.to_device(qh.view(np.int32).reshape(-1)), cuda.to_device(sh), cuda.to_device(zh),
                    cuda.to_device(qh)) for _ in range(nc)]
            nn = max(n, 2 * nc) if nc <= 100 else nc
            row["hbm_copies"] = nc
            row["dp4a_hbm_us"] = ip.graph_us(stream, lambda: [dp.mm(out, cop[i % nc][0], cop[i % nc][1],
                                                                    cop[i % nc][2], N, stream)
                                                              for i in range(nn)], nn)
            row["dp4a_hoisted_hbm_us"] = ip.graph_us(stream, lambda: [dph.mm(out, cop[i % nc][0], cop[i % nc][1],
                                                                             cop[i % nc][2], N, stream)
                                                                       for i in range(nn)], nn)
            row["tinyloop_hbm_us"] = ip.graph_us(stream, lambda: [km.matmul(tl, x_d, cop[i % nc][3], cop[i % nc][1],
                                                                            cop[i % nc][2], stream=stream)
                                                                  for i in range(nn)], nn)
            del cop
            if tg is not None:
                try:
                    tgs = [ti4.to_tinygemm(codes, sg, zg) for _ in range(nc)]
                    row["tinygemm_hbm_us"] = ip.torch_graph_us(
                        lambda i: torch.ops.aten._weight_int4pack_mm(xb, tgs[i % nc][0], tgs[i % nc][2],
                                                                     tgs[i % nc][1]), nn)
                    del tgs
                except Exception as e:   # noqa: BLE001
                    print("  tinygemm hbm failed:", e)
            row["dp4a_hbm_GBps"] = nbytes / (row["dp4a_hbm_us"] * 1e-6) / 1e9
            row["dp4a_hoisted_hbm_GBps"] = nbytes / (row["dp4a_hoisted_hbm_us"] * 1e-6) / 1e9
        report["rows"].append(row)
        g = lambda k: f"{row[k]:8.2f}" if k in row else "     n/a"   # noqa: E731
        print(f"  best {best_plain} / {best_hoist}: dp4a {g('dp4a_us')} hoisted {g('dp4a_hoisted_us')} tinyloop {g('tinyloop_us')} imma {g('imma_us')} "
              f"tinygemm {g('tinygemm_us')} | HBM dp4a {g('dp4a_hbm_us')} hoisted {g('dp4a_hoisted_hbm_us')} tinyloop {g('tinyloop_hbm_us')} "
              f"tinygemm {g('tinygemm_hbm_us')}", flush=True)
    report["all_exact"] = all_ok
    report["wall_s"] = time.time() - t_start
    if not args.check_only:
        print("\nshape (T = 1, us)              dp4a hoisted  prep  tinyloop   imma  tinygemm | HBM: dp4a hoisted "
              "tinyloop tinygemm | GB/s dp4a hoisted")
        for r in report["rows"]:
            g = lambda k: f"{r[k]:7.2f}" if k in r else "    n/a"   # noqa: E731
            pre = r["configs"][r["best_plain"]]["prep_us"]
            print(f"{r['shape']:30} {g('dp4a_us')} {g('dp4a_hoisted_us')} {pre:5.2f} {g('tinyloop_us')} "
                  f"{g('imma_us')} {g('tinygemm_us')} | {g('dp4a_hbm_us')} {g('dp4a_hoisted_hbm_us')} "
                  f"{g('tinyloop_hbm_us')} {g('tinygemm_hbm_us')} | {r.get('dp4a_hbm_GBps', 0):6.0f} "
                  f"{r.get('dp4a_hoisted_hbm_GBps', 0):6.0f}")
    print(f"all exact: {all_ok}; wall {report['wall_s']:.0f}s")
    dest = args.json or (os.path.join(os.environ["OUT"], "dp4a_probe.json") if os.environ.get("OUT") else None)
    if dest:
        Path(dest).write_text(json.dumps(report, indent=2))
    return 0 if all_ok else 2


if __name__ == "__main__":
    raise SystemExit(main())
